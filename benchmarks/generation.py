"""text-generation: time to first token and decode tokens/s, eager fp32 vs the compiled decode step, in one run.

The shipped ``model_configs/tiny-llama-generation.yaml`` is loaded twice through the handler's engine (no
TorchServe): as shipped (the decode step compiled at load, gated on greedy tokens) and with ``ladder: [eager]``.
Both generate the same greedy requests, alternating per round so that drift on a shared machine hits both alike;
their token ids are checked identical before any timing counts. Requests stream, so each token's arrival is
timed where a client would see it:

* ``ttft_ms``: request in -> first token out (tokenize, prefill, first pick: the prefill is eager in both);
* ``decode tokens/s``: tokens after the first / time from the first token to the last (the decode steps).

Workloads: ``b1`` (one request) and ``b4`` (four requests of different prompt lengths in one batch; tokens/s
counts every row's tokens). ``--new-tokens`` per request (default 64).

    .venv/bin/python -m benchmarks.generation [--rounds 10] [--new-tokens 64] [--cache-dir .cache/inductor] \
        [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import (DEFAULT_OUT, REPO, apply_settings, log, markdown_table, run_header, summarize,
                                write_csv, write_json, write_plot)

PROMPTS = ["Serving compiled models in production", "The quick brown fox", "A longer prompt about the latency "
           "of every request that a server answers while it batches", "Tea"]


def load_engine(eager: bool, model_dirs: Path, settings: Sequence[str] = ()) -> tuple[Any, float]:
    import torch
    import yaml

    from handlers.config import load_config
    from handlers.serving.engine import Engine

    from tests import tiny_models

    raw = copy.deepcopy(yaml.safe_load((REPO / "model_configs" / "tiny-llama-generation.yaml").read_text()))
    raw["pt2_handlers"]["model_dir"] = str(tiny_models.build("tiny-llama", model_dirs))
    if eager:
        raw["pt2_handlers"]["ladder"] = ["eager"]
    else:
        apply_settings(raw, settings)
    started = time.perf_counter()
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), "eager" if eager else "compiled")
    engine.load()
    return engine, time.perf_counter() - started


def timed(engine: Any, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch, streamed: time to first token, decode tokens/s, and the token ids per request."""
    arrivals: list[float] = []
    tokens = 0

    def emit(chunks: dict[int, Any]) -> None:
        nonlocal tokens
        arrivals.append(time.perf_counter())
        tokens += len(chunks)

    started = time.perf_counter()
    answers = engine.predict(bodies, emit)
    ids = [answer[0]["details"]["token_ids"] for answer in answers]
    first_tokens = len(ids)  # the first emit carries one token per row
    decode_seconds = arrivals[-1] - arrivals[0]
    return {"ttft_ms": (arrivals[0] - started) * 1000, "ids": ids,
            "tokens_per_s": (tokens - first_tokens) / decode_seconds if decode_seconds > 0 else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed batches per engine and workload")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per engine and workload")
    parser.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of every request")
    parser.add_argument("--models", type=Path, default=REPO / ".cache" / "test-models")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir (default: a new empty one = cold)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "generation")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override the compiled engine's model YAML, e.g. 'pt2.compile.options={}' "
                             "(no C++ wrapper)")
    args = parser.parse_args()
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="bench-generation-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before torch imports inductor
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    header = run_header(args, {"inductor_cache": str(cache)})
    compiled, compiled_load = load_engine(eager=False, model_dirs=args.models, settings=args.set)
    eager, eager_load = load_engine(eager=True, model_dirs=args.models)
    log(f"compiled READY in {compiled_load:.1f}s on rung {compiled.active_rung}; eager in {eager_load:.1f}s")
    engines = {"eager": eager, "compiled": compiled}
    rows = []
    for workload, prompts in (("b1", PROMPTS[:1]), ("b4", PROMPTS)):
        bodies = [{"text": prompt, "max_new_tokens": args.new_tokens, "stream": True, "details": True}
                  for prompt in prompts]
        if timed(compiled, bodies)["ids"] != timed(eager, bodies)["ids"]:
            raise SystemExit(f"{workload}: the compiled decode's greedy tokens differ from eager's")
        for _ in range(args.warmup):
            timed(compiled, bodies), timed(eager, bodies)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for index in range(args.rounds):  # alternate, so drift on a shared machine hits both alike
            for name, engine in engines.items():
                runs[name].append(timed(engine, bodies))
            log(f"  {workload} round {index + 1}/{args.rounds}: tokens/s eager {runs['eager'][-1]['tokens_per_s']:.0f}"
                f", compiled {runs['compiled'][-1]['tokens_per_s']:.0f}")
        stats = {name: {"ttft": summarize([r["ttft_ms"] for r in results]),
                        "tps": summarize([r["tokens_per_s"] for r in results])} for name, results in runs.items()}
        row = {"workload": workload, "rows": len(bodies), "new_tokens": args.new_tokens,
               "active_rung": compiled.active_rung, "compiled_load_s": round(compiled_load, 1)}
        for name in engines:
            row[f"{name}_ttft_p50_ms"] = round(stats[name]["ttft"]["p50"], 2)
            row[f"{name}_tokens_per_s_p50"] = round(stats[name]["tps"]["p50"], 1)
        row["decode_speedup"] = round(row["compiled_tokens_per_s_p50"] / row["eager_tokens_per_s_p50"], 3)
        row["ttft_ratio"] = round(row["eager_ttft_p50_ms"] / row["compiled_ttft_p50_ms"], 3)
        log(f"{workload}: decode tokens/s eager {row['eager_tokens_per_s_p50']}, compiled "
            f"{row['compiled_tokens_per_s_p50']} ({row['decode_speedup']:.2f}x); TTFT eager {row['eager_ttft_p50_ms']}"
            f" ms, compiled {row['compiled_ttft_p50_ms']} ms")
        rows.append(row)
    table = markdown_table(
        ["workload", "decode tokens/s eager", "decode tokens/s compiled", "speedup", "TTFT ms eager",
         "TTFT ms compiled"],
        [[r["workload"], r["eager_tokens_per_s_p50"], r["compiled_tokens_per_s_p50"], f"{r['decode_speedup']:.2f}x",
          r["eager_ttft_p50_ms"], r["compiled_ttft_p50_ms"]] for r in rows])
    write_csv(args.out / "generation.csv", rows)
    write_json(args.out / "generation.json", {"header": header, "rows": rows})
    (args.out / "generation.md").write_text(f"`{header['command']}`\n\n{table}\n")
    write_plot(args.out / "generation.png", "text-generation: eager vs compiled decode step (p50)",
               [r["workload"] for r in rows],
               [("decode tokens/s", {name: [r[f"{name}_tokens_per_s_p50"] for r in rows] for name in engines}),
                ("TTFT ms", {name: [r[f"{name}_ttft_p50_ms"] for r in rows] for name in engines})])
    print(table)


if __name__ == "__main__":
    main()
