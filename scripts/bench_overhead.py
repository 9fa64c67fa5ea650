#!/usr/bin/env python3
"""Where a lone short request's time goes: the model, our handler, and TorchServe (issue 19, item 2).

Why: at concurrency 1 a client waits for the whole path, not the model alone. This splits it, in one run:

    in process   our Pt2Handler.handle() under TorchServe's own Context and metrics cache (ts.context,
                 ts.metrics), as the worker calls it: the engine's stages (parse, preprocess = tokenize,
                 forward = padding + guard + compiled model, postprocess) and the adapter around them (reading
                 the row, metrics, the JSON response)
    through TS   the same archive served by TorchServe on loopback (token auth on), one keep-alive client
                 sending the same lone requests one after another: what the client waits for

Handler's own time = handle() - forward. TorchServe's share = the client's p50 - handle()'s p50 (its frontend,
batching window, the socket to the worker, the worker's protocol code).

    .venv/bin/python scripts/bench_overhead.py [--config model_configs/minilm-embeddings.yaml] [--requests 300]
        [--words 8 16] [--skip-torchserve] [--idle-ms 100]

``--idle-ms`` sleeps that long before each timed request, in process and through TorchServe: a client whose
requests come seldom, so that the worker's cores go idle between them (its OpenMP threads asleep, and under a
hypervisor its idle virtual CPUs descheduled), against the default back-to-back requests, which keep them awake.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import package
import tsctl
import yaml
from bench_common import (DEFAULT_OUT, REPO, OtherCpu, log, markdown_table, pids_with_arg, run_header, summarize,
                          write_csv, write_plot)
from bench_e2e import Client, single_token_words

MODEL = "overhead"
STAGES = ("parse", "preprocess", "forward", "postprocess")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=package.DEFAULT_CONFIG, help="model YAML")
    parser.add_argument("--requests", type=int, default=300, help="timed lone requests, in process and through TS")
    parser.add_argument("--warmup", type=int, default=30, help="untimed requests first")
    parser.add_argument("--words", type=int, nargs=2, default=[8, 16], metavar=("MIN", "MAX"),
                        help="words per text (one token each)")
    parser.add_argument("--skip-torchserve", action="store_true", help="the in-process part only")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="idle time before each timed request (0: back to back)")
    parser.add_argument("--port-shift", type=int, default=30000)
    parser.add_argument("--server-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="lines added to TorchServe's config.properties (e.g. async_logging=true)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "overhead", help="CSV/PNG/markdown path stem")
    return parser.parse_args()


def make_bodies(count: int, words: tuple[int, int], seed: int = 0) -> list[bytes]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(package.default_model_dir())
    vocabulary = single_token_words(tokenizer)
    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choices(vocabulary, k=rng.randint(*words)))}).encode()
            for _ in range(count)]


def torchserve_context(config: Path, work: Path) -> Any:
    """The Context a TorchServe worker hands the handler: the archive's contents (scripts/package.py's layout),
    the model YAML, and TorchServe's metrics cache built from our metrics.yaml."""
    from ts.context import Context
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    raw = yaml.safe_load(config.read_text())
    package.stage(package.default_model_dir(), work)
    metrics = MetricsCacheYamlImpl(config_file_path=str(REPO / "model_configs" / "metrics.yaml"))
    metrics.initialize_cache()
    metrics.model_name = MODEL
    return Context(MODEL, str(work), {"model": {"modelVersion": "1.0"}}, 4, None, "0.12.0", metrics=metrics,
                   model_yaml_config=raw)


def in_process(args: argparse.Namespace, bodies: list[bytes]) -> dict[str, list[float]]:
    """Per request: handle()'s wall time, each engine stage, and the adapter's rest (ms)."""
    sys.path.insert(0, str(REPO))
    from ts.context import RequestProcessor

    from handlers.torchserve_handler import Pt2Handler

    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        context = torchserve_context(args.config, Path(tmp))
        handler = Pt2Handler()
        log(f"in process: loading {args.config.name} (compile and warmup; a minute or two with a cold cache)")
        started = time.perf_counter()
        handler.initialize(context)
        log(f"in process: READY on {handler.engine.active_rung} ({handler.engine.dtype.value.value}) in "
            f"{time.perf_counter() - started:.1f}s")
        samples: dict[str, list[float]] = {name: [] for name in ("handle", *STAGES, "adapter", "ours")}
        for index, body in enumerate(bodies):
            context.request_ids = {0: f"r{index}"}
            context.request_processor = [RequestProcessor({})]
            context.metrics.request_ids = context.request_ids
            idle(args, index)
            started = time.perf_counter()
            [answer] = handler.handle([{"body": bytearray(body)}], context)
            took = (time.perf_counter() - started) * 1000
            assert b'"embedding"' in answer, answer[:200]  # the worker answers bytes (orjson)
            if index < args.warmup:
                continue
            stages = handler.engine.last_batch.milliseconds
            samples["handle"].append(took)
            for stage in STAGES:
                samples[stage].append(stages.get(stage, 0.0))
            samples["adapter"].append(took - sum(stages.get(stage, 0.0) for stage in STAGES))
            samples["ours"].append(took - stages.get("forward", 0.0))
        return samples


def idle(args: argparse.Namespace, index: int) -> None:
    """``--idle-ms`` of sleep before a timed request (the untimed warmup ones go back to back)."""
    if args.idle_ms and index >= args.warmup:
        time.sleep(args.idle_ms / 1000)


def through_torchserve(args: argparse.Namespace, bodies: list[bytes], work: Path) -> tuple[list[float], float | None]:
    """Client latency (ms) of each lone request through TorchServe, one keep-alive connection, one at a time; and
    the CPU share of processes other than this one and that TorchServe meanwhile."""
    store = work / "model_store"
    package.build(MODEL, package.default_model_dir(), args.config.resolve(), store)
    config = tsctl.shifted_config(work, args.port_shift, extra=args.server_set)
    started = time.monotonic()
    server = tsctl.start(config, store, [f"{MODEL}={MODEL}.mar"], work / "run", 900, every_worker=True)
    log(f"TorchServe READY in {time.monotonic() - started:.0f}s")
    try:
        client = Client(server.inference_url, server.key("inference"))
        latencies = []
        # torchserve --start detaches the frontend from this process: ours by its run directory
        with OtherCpu({os.getpid(), *pids_with_arg(str(work))}) as other:
            for index, body in enumerate(bodies):
                idle(args, index)
                started = time.perf_counter()
                status, answer = client.post(f"/predictions/{MODEL}", body)
                took = (time.perf_counter() - started) * 1000
                assert status == 200, answer[:200]
                if index >= args.warmup:
                    latencies.append(took)
        client.close()
        return latencies, other.percent
    finally:
        tsctl.stop(work / "run")


def main() -> None:
    args = parse_args()
    # The handler's own progress (ladder attempts, warmup), as a worker's log would show it.
    logging.basicConfig(level=logging.INFO, format="[handler] %(message)s", stream=sys.stdout, force=True)
    for noisy in ("torch", "transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    header = run_header(args)
    bodies = make_bodies(args.warmup + args.requests, tuple(args.words))
    with OtherCpu() as other:
        samples = in_process(args, bodies)
    other_pct = {"in process": other.percent}
    if not args.skip_torchserve:
        with tempfile.TemporaryDirectory(prefix="bench-overhead-ts-") as tmp:
            samples["client"], other_pct["through TorchServe"] = through_torchserve(args, bodies, Path(tmp))
    stats = {name: summarize(values) for name, values in samples.items()}
    if "client" in stats:
        stats["torchserve"] = {q: stats["client"][q] - stats["handle"][q] for q in ("p50", "p90", "p99", "mean")}
    rows = [{"part": name, **{f"{q}_ms": round(value, 3) for q, value in s.items()}, "requests": args.requests,
             "other_cpu_pct": other_pct.get("through TorchServe" if name in ("client", "torchserve") else "in process")}
            for name, s in stats.items()]
    write_csv(args.out.with_suffix(".csv"), rows)
    order = [name for name in ("client", "torchserve", "handle", "ours", "forward", *STAGES[:2], STAGES[3], "adapter")
             if name in stats]
    table = markdown_table(["part", "p50 ms", "p90 ms", "p99 ms", "mean ms"],
                           [[name, *(f"{stats[name][q]:.3f}" for q in ("p50", "p90", "p99", "mean"))]
                            for name in order])
    spacing = f", each after {args.idle_ms:g} ms idle" if args.idle_ms else ", back to back"
    notes = (f"lone requests of {args.words[0]}-{args.words[1]} words, {args.requests} timed after {args.warmup}"
             f"{spacing}; "
             "other processes used " + " / ".join(f"{v}% ({k})" for k, v in other_pct.items()) + " of the CPU")
    args.out.with_suffix(".md").write_text(f"{header['command']}\n\n{table}\n\n{notes}\n")
    write_plot(args.out.with_suffix(".png"), "a lone short request: where the time goes (p50)", order,
               [("ms (p50)", {"p50": [stats[name]["p50"] for name in order]})])
    print(table)
    log(notes)
    if "client" in stats:
        log(f"p50: client {stats['client']['p50']:.2f} ms = TorchServe {stats['torchserve']['p50']:.2f} + handle() "
            f"{stats['handle']['p50']:.2f} (model forward {stats['forward']['p50']:.2f}, ours "
            f"{stats['ours']['p50']:.2f}); client / forward = {stats['client']['p50'] / stats['forward']['p50']:.2f}x")


if __name__ == "__main__":
    main()
