"""Where a lone short request's time goes: the model, our handler, and TorchServe (a speed goal: benchmarks/goals.py).

Why: at concurrency 1 a client waits for the whole path, not the model alone. This splits it, in one run:

    in process   our Pt2Handler.handle() under TorchServe's own Context and metrics cache (ts.context,
                 ts.metrics), as the worker calls it: the engine's stages (parse, preprocess = tokenize,
                 forward = padding + guard + compiled model, postprocess) and the adapter around them (reading
                 the row, metrics, the JSON response)
    through TS   the same archive served by TorchServe on loopback (token auth on), one keep-alive client
                 sending the same lone requests one after another: what the client waits for

Handler's own time = handle() - forward. In the worker, each answer's Server-Timing header
(handlers/serving/server_timing.py) gives the same split for that very request: the worker's handler call and its
forward. TorchServe's share = what the
client waited - the worker's handler call, request by request (its frontend, batching window, the socket to the
worker, the worker's protocol code). The in-process forward is the model alone, back to back; the worker's forward
is the same model between requests that come through TorchServe.

TorchServe's floor: the same TorchServe also serves benchmarks/floor_handler.py, a handler that answers at once,
twice: with the model YAML's batchSize and maxBatchDelay ("floor") and with batchSize 1 ("floor unbatched"). The
same client sends it the same requests in each timed block. The floor is what any handler pays for a lone request
through this TorchServe; floor - floor unbatched is the batching window alone (a lone request waits up to
maxBatchDelay for a second one, and a batchSize of 1 does not batch at all).

Both are loaded side by side, warmed up with ``--warmup`` untimed requests each, then timed in ``--blocks``
alternated blocks of the same requests (in process, then through TorchServe): this VM's speed drifts by up to a
quarter within minutes, and with the two timed one after the other that drift landed in TorchServe's share.

    .venv/bin/python -m benchmarks.overhead [--config model_configs/minilm-embeddings.yaml] [--requests 300]
        [--warmup 30] [--blocks 4] [--words 8 16] [--skip-torchserve] [--idle-ms 100]

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.e2e import Client, single_token_words
from benchmarks.harness import (DEFAULT_OUT, REPO, OtherCpu, log, markdown_table, pids_with_arg, run_header, summarize,
                                write_csv, write_plot)
from handlers.serving import archive
from handlers.serving import server as torchserve

MODEL = "overhead"
STAGES = ("parse", "preprocess", "forward", "postprocess")
FLOOR_HANDLER = REPO / "benchmarks" / "floor_handler.py"
FLOORS = {"floor": None, "floor_unbatched": 1}  # archive name -> its batchSize (None: the model YAML's)
# Read from each answer's Server-Timing: the worker's handler call, its forward, the rest of the call (the worker's own
# time), and what the client waited beyond the call (TorchServe's share).
WORKER_PARTS = ("worker_handler", "worker_forward", "worker_own", "torchserve")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=archive.DEFAULT_CONFIG, help="model YAML")
    parser.add_argument("--requests", type=int, default=300, help="timed lone requests, in process and through TS")
    parser.add_argument("--warmup", type=int, default=30, help="untimed requests first")
    parser.add_argument("--words", type=int, nargs=2, default=[8, 16], metavar=("MIN", "MAX"),
                        help="words per text (one token each)")
    parser.add_argument("--skip-torchserve", action="store_true", help="the in-process part only")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="idle time before each timed request (0: back to back)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="alternated blocks the timed requests are split into, in process then through TorchServe")
    parser.add_argument("--port-shift", type=int, default=22000)
    parser.add_argument("--server-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="lines added to TorchServe's config.properties (e.g. async_logging=true)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "overhead", help="CSV/PNG/markdown path stem")
    return parser.parse_args()


def make_bodies(count: int, words: tuple[int, int], seed: int = 0) -> list[bytes]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(archive.default_model_dir())
    vocabulary = single_token_words(tokenizer)
    rng = random.Random(seed)
    return [json.dumps({"text": " ".join(rng.choices(vocabulary, k=rng.randint(*words)))}).encode()
            for _ in range(count)]


def torchserve_context(config: Path, work: Path) -> Any:
    """The Context a TorchServe worker hands the handler: the archive's contents (handlers/serving/archive.py's layout),
    the model YAML, and TorchServe's metrics cache built from our metrics.yaml."""
    from ts.context import Context
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    raw = yaml.safe_load(config.read_text())
    archive.stage(archive.default_model_dir(), work)
    metrics = MetricsCacheYamlImpl(config_file_path=str(REPO / "model_configs" / "metrics.yaml"))
    metrics.initialize_cache()
    metrics.model_name = MODEL
    return Context(MODEL, str(work), {"model": {"modelVersion": "1.0"}}, 4, None, "0.12.0", metrics=metrics,
                   model_yaml_config=raw)


class InProcess:
    """Our Pt2Handler under TorchServe's own Context and metrics cache, called as the worker calls it."""

    def __init__(self, args: argparse.Namespace, work: Path):
        from handlers.serving.torchserve_handler import Pt2Handler

        self.context = torchserve_context(args.config, work)
        self.handler = Pt2Handler()
        log(f"in process: loading {args.config.name} (compile and warmup; a minute or two with a cold cache)")
        started = time.perf_counter()
        self.handler.initialize(self.context)
        log(f"in process: READY on {self.handler.engine.active_rung} ({self.handler.engine.dtype.value.value}) in "
            f"{time.perf_counter() - started:.1f}s")
        self.samples: dict[str, list[float]] = {name: [] for name in ("handle", *STAGES, "adapter", "ours")}

    def run(self, bodies: list[bytes], first: int, idle_ms: float, timed: bool) -> None:
        """handle() each body alone; ``timed``: keep its wall time, each engine stage and the adapter's rest (ms)."""
        from ts.context import RequestProcessor

        context = self.context
        for index, body in enumerate(bodies, first):
            context.request_ids = {0: f"r{index}"}
            context.request_processor = [RequestProcessor({})]
            context.metrics.request_ids = context.request_ids
            if timed:
                idle(idle_ms)
            started = time.perf_counter()
            [answer] = self.handler.handle([{"body": bytearray(body)}], context)
            took = (time.perf_counter() - started) * 1000
            assert b'"embedding"' in answer, answer[:200]  # the worker answers bytes (orjson)
            if not timed:
                continue
            stages = self.handler.engine.last_batch.milliseconds
            self.samples["handle"].append(took)
            for stage in STAGES:
                self.samples[stage].append(stages.get(stage, 0.0))
            self.samples["adapter"].append(took - sum(stages.get(stage, 0.0) for stage in STAGES))
            self.samples["ours"].append(took - stages.get("forward", 0.0))


def idle(idle_ms: float) -> None:
    """``--idle-ms`` of sleep before a timed request (the untimed warmup ones go back to back)."""
    if idle_ms:
        time.sleep(idle_ms / 1000)


class ThroughTorchServe:
    """The same archive served by TorchServe on loopback, one keep-alive client sending lone requests."""

    def __init__(self, args: argparse.Namespace, work: Path):
        store = work / "model_store"
        archive.build(MODEL, archive.default_model_dir(), args.config.resolve(), store)
        floors = [build_floor(name, batch_size, args.config, work, store) for name, batch_size in FLOORS.items()]
        config = torchserve.shifted_config(work, args.port_shift, extra=args.server_set)
        self.run_dir = work / "run"
        started = time.monotonic()
        server = torchserve.start(config, store, [f"{MODEL}={MODEL}.mar", *floors], self.run_dir, 900,
                                  every_worker=True)
        log(f"TorchServe READY in {time.monotonic() - started:.0f}s")
        self.client = Client(server.inference_url, server.key("inference"))
        self.latencies: dict[str, list[float]] = {name: [] for name in (MODEL, *FLOORS)}
        self.worker: dict[str, list[float]] = {part: [] for part in WORKER_PARTS}
        from handlers.serving import server_timing

        self.timing = server_timing

    def run(self, bodies: list[bytes], idle_ms: float, timed: bool) -> None:
        """The model's archive, then each floor archive: the same bodies, one after another."""
        for name in self.latencies:
            for body in bodies:
                if timed:
                    idle(idle_ms)
                started = time.perf_counter()
                status, answer, headers = self.client.exchange(f"/predictions/{name}", body)
                took = (time.perf_counter() - started) * 1000
                assert status == 200, answer[:200]
                if timed:
                    self.latencies[name].append(took)
                    if name == MODEL:
                        self.keep_worker_timing(headers.get(self.timing.NAME) or "", took)

    def keep_worker_timing(self, header: str, took: float) -> None:
        """One answer's Server-Timing: the worker's handler call and forward, and the client's wait beyond the call."""
        timing = self.timing.durations(header)
        assert {"handler", "forward"} <= timing.keys(), f"no worker timing in Server-Timing: {header!r}"
        handler, forward = timing["handler"], timing["forward"]
        for part, value in zip(WORKER_PARTS, (handler, forward, handler - forward, took - handler), strict=True):
            self.worker[part].append(value)

    def stop(self) -> None:
        self.client.close()
        torchserve.stop(self.run_dir)


def build_floor(name: str, batch_size: int | None, config: Path, work: Path, store: Path) -> str:
    """benchmarks/floor_handler.py as archive ``name`` in ``store``: one worker, the model YAML's batching, or
    ``batch_size`` requests a batch where given. Returns its --models entry."""
    model_yaml = yaml.safe_load(config.read_text())
    batching = {key: model_yaml[key] for key in ("batchSize", "maxBatchDelay") if key in model_yaml}
    if batch_size is not None:
        batching["batchSize"] = batch_size
    floor_yaml = work / f"{name}.yaml"
    floor_yaml.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1, **batching}))
    command = [archive.archiver(), "--model-name", name, "--version", "1.0", "--handler", str(FLOOR_HANDLER),
               "--config-file", str(floor_yaml), "--export-path", str(store), "--archive-format", "no-archive",
               "--force"]
    log(f"packaging {name} ({batching}): {' '.join(command)}")
    subprocess.run(command, check=True)
    return f"{name}={name}"


def measure(args: argparse.Namespace, bodies: list[bytes], work: Path) -> tuple[dict[str, list[float]], float | None]:
    """Warm both up, then time them in ``--blocks`` alternated blocks of the same requests: in process, then through
    TorchServe. This VM's speed drifts within minutes, and a ratio of two phases run minutes apart (client / forward)
    measured the drift as much as TorchServe. Also the CPU share of processes other than ours meanwhile."""
    ours = InProcess(args, work / "in-process")
    served = None if args.skip_torchserve else ThroughTorchServe(args, work / "torchserve")
    try:
        warmup, timed = bodies[:args.warmup], bodies[args.warmup:]
        log(f"warmup: {len(warmup)} untimed requests each" + ("" if served else " (in process only)"))
        ours.run(warmup, 0, 0.0, timed=False)
        if served:
            served.run(warmup, 0.0, timed=False)
        roots = {os.getpid()}
        if served:  # torchserve --start detaches the frontend from this process: ours by its run directory
            roots |= set(pids_with_arg(str(work)))
        size = -(-len(timed) // args.blocks)
        with OtherCpu(roots) as other:
            for block, first in enumerate(range(0, len(timed), size), 1):
                chunk = timed[first:first + size]
                ours.run(chunk, args.warmup + first, args.idle_ms, timed=True)
                if served:
                    served.run(chunk, args.idle_ms, timed=True)
                log(f"block {block}/{args.blocks}: forward p50 {summarize(ours.samples['forward'])['p50']:.2f} ms"
                    + (f", in the worker {summarize(served.worker['worker_forward'])['p50']:.2f} ms"
                       f", client p50 {summarize(served.latencies[MODEL])['p50']:.2f} ms, floor p50 "
                       f"{summarize(served.latencies['floor'])['p50']:.2f} ms" if served else "") + " so far")
    finally:
        if served:
            served.stop()
    samples = dict(ours.samples)
    if served:
        samples["client"] = served.latencies[MODEL]
        samples.update((name, served.latencies[name]) for name in FLOORS)
        samples.update(served.worker)
    return samples, other.percent


def main() -> None:
    args = parse_args()
    # The handler's own progress (ladder attempts, warmup), as a worker's log would show it.
    logging.basicConfig(level=logging.INFO, format="[handler] %(message)s", stream=sys.stdout, force=True)
    for noisy in ("torch", "transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    header = run_header(args)
    bodies = make_bodies(args.warmup + args.requests, tuple(args.words))
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        samples, other_pct = measure(args, bodies, Path(tmp))
    stats = {name: summarize(values) for name, values in samples.items()}
    if "client" in stats:
        stats["batching_window"] = {q: stats["floor"][q] - stats["floor_unbatched"][q]
                                    for q in ("p50", "p90", "p99", "mean")}
    rows = [{"part": name, **{f"{q}_ms": round(value, 3) for q, value in s.items()}, "requests": args.requests,
             "other_cpu_pct": other_pct}
            for name, s in stats.items()]
    write_csv(args.out.with_suffix(".csv"), rows)
    order = [name for name in ("client", "torchserve", "floor", "batching_window", "floor_unbatched", "worker_handler",
                               "worker_own", "worker_forward", "handle", "ours", "forward", *STAGES[:2], STAGES[3],
                               "adapter")
             if name in stats]
    table = markdown_table(["part", "p50 ms", "p90 ms", "p99 ms", "mean ms"],
                           [[name, *(f"{stats[name][q]:.3f}" for q in ("p50", "p90", "p99", "mean"))]
                            for name in order])
    spacing = f", each after {args.idle_ms:g} ms idle" if args.idle_ms else ", back to back"
    where = ("in process" if args.skip_torchserve
             else f"in {args.blocks} alternated blocks, in process and through TorchServe")
    notes = (f"lone requests of {args.words[0]}-{args.words[1]} words, {args.requests} timed after {args.warmup} "
             f"untimed{spacing}, {where}; other processes used {other_pct}% of the CPU meanwhile")
    args.out.with_suffix(".md").write_text(f"{header['command']}\n\n{table}\n\n{notes}\n")
    write_plot(args.out.with_suffix(".png"), "a lone short request: where the time goes (p50)", order,
               [("ms (p50)", {"p50": [stats[name]["p50"] for name in order]})])
    print(table)
    log(notes)
    if "client" in stats:
        log(f"p50: client {stats['client']['p50']:.2f} ms; per request, TorchServe {stats['torchserve']['p50']:.2f} "
            f"beyond the worker's handler call {stats['worker_handler']['p50']:.2f} (its forward "
            f"{stats['worker_forward']['p50']:.2f}, its own {stats['worker_own']['p50']:.2f})")
        log(f"p50: in process, back to back: handle() {stats['handle']['p50']:.2f} (model forward "
            f"{stats['forward']['p50']:.2f}, ours {stats['ours']['p50']:.2f}); client / forward = "
            f"{stats['client']['p50'] / stats['forward']['p50']:.2f}x")
        log(f"p50: TorchServe's floor (a handler that answers at once) {stats['floor']['p50']:.2f} ms with this "
            f"batching, {stats['floor_unbatched']['p50']:.2f} with batchSize 1: its batching window "
            f"{stats['batching_window']['p50']:.2f} ms")


if __name__ == "__main__":
    main()
