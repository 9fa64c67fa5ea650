"""Cold start vs warm starts of the shipped archive through a real TorchServe on loopback.

Three measurements, one run, one fresh compile cache directory:

1. cold: TorchServe starts with an empty cache; time until the model's worker is READY.
2. scale-up on the same host: a second worker is added (management API, synchronous); time until it is
   READY. It finds the first worker's graphs and kernels in the shared cache directory. With ``--clients N``, N
   clients keep sending texts of mixed lengths (8-96 words) to the first worker, and what they got before the
   scale-up and while the second worker loaded is recorded (req/s, p50 / p99): a worker that loads beside a
   serving one loads on its share of the cores (``CoreShare.loading``).
3. a new host: TorchServe is stopped, the cache directory is copied elsewhere (as a volume mounted into a new
   pod would be) and a new TorchServe starts from the copy; time until READY.
4. the same from a copy without what the loads measured (``handlers.ladder.decisions``: the races, int8's choice of
   layers), so the worker measures again: what remembering them saves.
5. with ``--workers N`` (N > 1): a cold start of the model YAML with ``minWorkers: N``, from another empty cache;
   time until the first worker is READY and until all are (workers on the same cores load in turn, each on every core,
   and the next loads from what the first kept: ``CoreShare.loading``).
6. with ``--with-model CONFIG``: a cold start of this model and another (CONFIG, served as ``other``) at once, from
   another empty cache, as ``--models a.mar b.mar`` starts them; time until the first model is READY and until both
   are (workers on the same cores load in turn, whatever their model).

Each worker's own load time (from the handler's READY log line) is recorded beside the wall-clock times.

    .venv/bin/python -m benchmarks.restart [--config model_configs/minilm-embeddings.yaml]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness
from handlers.ladder.decisions import DIRECTORY as MEASURED
from handlers.serving import archive
from handlers.serving import server as torchserve

PORT_SHIFT = 22000  # away from the shipped ports, the tests (+10000 ... +17000) and benchmarks.e2e (+20000)
MODEL = "minilm"


def worker_load_seconds(run_dir: Path, model: str = MODEL) -> list[float]:
    """Each worker's own load time (model loaded, ladder run, READY), from the handler's log line."""
    log = run_dir / "logs" / "model_log.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [float(m) for m in re.findall(rf"model {model} READY on rung \S+ after ([0-9.]+)s", text)]


class LiveClients:
    """``count`` clients that send texts of mixed lengths to the model, one after another each, until ``stop``;
    what they got in any window of time (``served``)."""

    def __init__(self, server: torchserve.Server, count: int, texts: list[str]):
        from benchmarks.e2e import Client

        self._clients = [Client(server.inference_url, server.key("inference") or "") for _ in range(count)]
        self._bodies = [json.dumps({"text": text}).encode() for text in texts]
        self._answers: list[tuple[float, float, bool]] = []  # (ended, ms, a 200 with an embedding)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> LiveClients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        for client in self._clients:
            client.close()

    def _send(self, index: int) -> None:
        client, step = self._clients[index], len(self._clients)
        while not self._stop.is_set():
            body = self._bodies[index % len(self._bodies)]
            started = time.monotonic()
            try:
                status, payload = client.post(f"/predictions/{MODEL}", body)
                good = status == 200 and b'"embedding"' in payload
            except OSError:
                good = False
            ended = time.monotonic()
            self._answers.append((ended, (ended - started) * 1000, good))
            index += step

    def served(self, start: float, end: float) -> dict[str, float]:
        """req/s, p50 / p99 ms and failed answers between two ``time.monotonic`` readings."""
        window = [(ms, good) for ended, ms, good in list(self._answers) if start <= ended < end]
        latencies = [ms for ms, good in window if good]
        return {"req_s": round(len(latencies) / max(end - start, 1e-9), 1),
                "p50_ms": round(harness.percentile(latencies, 50), 1) if latencies else None,
                "p99_ms": round(harness.percentile(latencies, 99), 1) if latencies else None,
                "failed": sum(not good for _, good in window)}


def mixed_texts(count: int) -> list[str]:
    """Texts of 8-96 words (benchmarks.e2e's mixed workload), from the model's own single-token words."""
    import transformers
    from benchmarks.e2e import make_texts, single_token_words

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(archive.default_model_dir()), local_files_only=True)
    return make_texts(single_token_words(tokenizer), "mixed", count, random.Random(0))


def scale_up(server: torchserve.Server, args: argparse.Namespace, run_dir: Path) -> dict:
    """Case 2: a second worker, timed to READY; under ``args.clients`` clients when asked."""
    def add_worker() -> float:
        started = time.monotonic()
        status, body = server.management("PUT", f"/models/{MODEL}?min_worker=2&max_worker=2&synchronous=true",
                                         timeout=900)
        if status != 200:
            raise RuntimeError(f"scale-up failed: {status} {body[:200]!r}")
        torchserve.wait_ready(server, MODEL, timeout=900, count=2)
        return time.monotonic() - started

    row: dict = {"case": "second worker, same host"}
    if not args.clients:
        row["ready_seconds"] = round(add_worker(), 1)
    else:
        row["case"] += f", {args.clients} clients sending"
        with LiveClients(server, args.clients, mixed_texts(2000)) as clients:
            started = time.monotonic()
            harness.log(f"    {args.clients} clients for {args.settle:.0f}s before the scale-up")
            time.sleep(args.settle)
            scaled = time.monotonic()
            row["ready_seconds"] = round(add_worker(), 1)
            before, loading = clients.served(started + 5, scaled), clients.served(scaled, time.monotonic())
        row.update({f"clients_before_{key}": value for key, value in before.items()})
        row.update({f"clients_loading_{key}": value for key, value in loading.items()})
        harness.log(f"    clients before: {before}; while the second worker loaded: {loading}")
    row["worker_load_seconds"] = worker_load_seconds(run_dir)[-1]
    return row


def start_timed(config: Path, store: Path, run_dir: Path, cache: Path) -> tuple[torchserve.Server, float]:
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    started = time.monotonic()
    server = torchserve.start(config, store, [f"{MODEL}={MODEL}.mar"], run_dir, timeout=900, extra_env=env_cache)
    return server, time.monotonic() - started


def measure(args: argparse.Namespace, tmp: Path) -> list[dict]:
    store = tmp / "store"
    archive.build(MODEL, archive.default_model_dir(), args.config.resolve(), store)
    config = torchserve.shifted_config(tmp, PORT_SHIFT)
    cache = tmp / "cache-host-a"
    rows = []
    harness.log("1/4 cold start (empty compile cache)")
    server, cold = start_timed(config, store, tmp / "run-a", cache)
    rows.append({"case": "cold start", "ready_seconds": round(cold, 1),
                 "worker_load_seconds": worker_load_seconds(tmp / "run-a")[-1]})
    try:
        harness.log("2/4 scale-up: a second worker on the same host, shared cache")
        rows.append(scale_up(server, args, tmp / "run-a"))
    finally:
        torchserve.stop(tmp / "run-a")
    volume = tmp / "cache-volume-copy"
    shutil.copytree(cache, volume)
    size_mb = sum(f.stat().st_size for f in volume.rglob("*") if f.is_file()) / 1e6
    harness.log(f"3/4 new host: a new TorchServe with a copy of the cache ({size_mb:.1f} MB)")
    server, warm = start_timed(config, store, tmp / "run-b", volume)
    torchserve.stop(tmp / "run-b")
    rows.append({"case": "new host, cache volume", "ready_seconds": round(warm, 1),
                 "worker_load_seconds": worker_load_seconds(tmp / "run-b")[-1]})
    harness.log(f"4/4 new host: a copy of the cache without {MEASURED}/ (what the loads measured is measured again)")
    shutil.copytree(cache, tmp / "cache-volume-unmeasured", ignore=shutil.ignore_patterns(MEASURED))
    server, unmeasured = start_timed(config, store, tmp / "run-c", tmp / "cache-volume-unmeasured")
    torchserve.stop(tmp / "run-c")
    rows.append({"case": "new host, graphs only", "ready_seconds": round(unmeasured, 1),
                 "worker_load_seconds": worker_load_seconds(tmp / "run-c")[-1]})
    if args.workers > 1:
        rows += cold_workers(args, tmp, config)
    if args.with_model:
        rows += two_models(args, tmp, config)
    for row in rows:
        row["vs_cold"] = round(row["ready_seconds"] / cold, 2)
        row["cache_mb"] = round(size_mb, 1)
    return rows


def cold_workers(args: argparse.Namespace, tmp: Path, config: Path) -> list[dict]:
    """Case 5: a cold start with ``minWorkers: args.workers``, timed to the first READY worker and to the last."""
    import yaml

    harness.log(f"5/5 cold start with minWorkers {args.workers} (another empty compile cache)")
    model_yaml = harness.apply_settings(yaml.safe_load(args.config.read_text()), [f"minWorkers={args.workers}"])
    (tmp / "workers.yaml").write_text(yaml.safe_dump(model_yaml, sort_keys=False))
    store = tmp / "store-workers"
    archive.build(MODEL, archive.default_model_dir(), tmp / "workers.yaml", store)
    started = time.monotonic()
    server, first = start_timed(config, store, tmp / "run-d", tmp / "cache-workers")
    try:
        torchserve.wait_ready(server, MODEL, timeout=900, count=args.workers)
        every = time.monotonic() - started
    finally:
        torchserve.stop(tmp / "run-d")
    loads = worker_load_seconds(tmp / "run-d")  # each worker's, its wait for its turn included
    return [{"case": f"minWorkers {args.workers}, cold: first READY", "ready_seconds": round(first, 1),
             "worker_load_seconds": min(loads)},
            {"case": f"minWorkers {args.workers}, cold: all READY", "ready_seconds": round(every, 1),
             "worker_load_seconds": max(loads)}]


def two_models(args: argparse.Namespace, tmp: Path, config: Path) -> list[dict]:
    """Case 6: this model and ``other`` (``--with-model``) started at once, cold; wall time to each one's READY."""
    other = "other"
    harness.log(f"6/6 cold start of {MODEL} and {other} ({args.with_model}) at once (another empty compile cache)")
    store = tmp / "store"  # this model's archive, built for case 1, beside the other's
    archive.build(other, archive.default_model_dir(), args.with_model.resolve(), store)
    run_dir = tmp / "run-e"
    ready: dict[str, float] = {}
    started = time.monotonic()
    done = threading.Event()

    def watch(server: torchserve.Server) -> None:  # each model's READY, as it comes
        while not done.is_set() and len(ready) < 2:
            for name in (MODEL, other):
                try:
                    serving = any(w.get("status") == "READY" for w in torchserve.workers(server, name))
                except (OSError, ValueError, KeyError):  # not up yet: no key file, no answer
                    serving = False
                if name not in ready and serving:
                    ready[name] = round(time.monotonic() - started, 1)
            time.sleep(0.2)

    server = torchserve.server_for(config, run_dir)  # the ports; the key file is read once the server writes it
    watcher = threading.Thread(target=watch, args=(server,), daemon=True)
    watcher.start()
    try:
        torchserve.start(config, store, [f"{MODEL}={MODEL}.mar", f"{other}={other}.mar"], run_dir, timeout=900,
                    extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache-two")})
        watcher.join(timeout=5)
    finally:
        done.set()
        torchserve.stop(run_dir)
    loads = {name: worker_load_seconds(run_dir, name)[-1] for name in (MODEL, other)}
    harness.log(f"    READY after (s): {ready}; each worker's load (its wait for its turn included): {loads}")
    first, second = sorted(ready, key=ready.get)
    return [{"case": f"{MODEL} and {other} at once, cold: first READY ({first})", "ready_seconds": ready[first],
             "worker_load_seconds": loads[first]},
            {"case": f"{MODEL} and {other} at once, cold: both READY", "ready_seconds": ready[second],
             "worker_load_seconds": loads[second]}]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=harness.REPO / "model_configs" / "minilm-embeddings.yaml")
    parser.add_argument("--out", type=Path, default=harness.DEFAULT_OUT)
    parser.add_argument("--workers", type=int, default=1,
                        help="above 1: also a cold start with this minWorkers (first and last worker READY)")
    parser.add_argument("--clients", type=int, default=0,
                        help="clients sending to the first worker through the scale-up (case 2); 0: none")
    parser.add_argument("--settle", type=float, default=20.0,
                        help="seconds the clients send before the scale-up (the first 5 are left out)")
    parser.add_argument("--with-model", type=Path, default=None, metavar="CONFIG",
                        help="also a cold start of this model and another (this model YAML) at once")
    args = parser.parse_args()
    header = harness.run_header(args)
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        try:
            rows = measure(args, Path(tmp))
        finally:  # the workers' own timings (per warmup shape), kept beside the results
            for run in ("run-a", "run-b", "run-c", "run-d", "run-e"):
                log = Path(tmp) / run / "logs" / "model_log.log"
                if log.is_file():
                    args.out.mkdir(parents=True, exist_ok=True)
                    shutil.copy(log, args.out / f"restart-{run}-model_log.log")
    harness.write_json(args.out / "restart.json", {"header": header, "rows": rows})
    harness.write_csv(args.out / "restart.csv", rows)
    harness.write_plot(args.out / "restart.png", "Time to READY (s): cold vs warm", [r["case"] for r in rows],
                  [("seconds to READY", {"TorchServe": [r["ready_seconds"] for r in rows]})])
    print(harness.markdown_table(["case", "READY after (s)", "worker load (s)", "vs cold"],
                            [[r["case"], r["ready_seconds"], r["worker_load_seconds"], r["vs_cold"]]
                             for r in rows]))
    if args.clients:
        row = rows[1]
        print(harness.markdown_table(
            ["clients", "req/s", "p50 / p99 ms", "failed"],
            [[when, row[f"clients_{key}_req_s"], f"{row[f'clients_{key}_p50_ms']} / {row[f'clients_{key}_p99_ms']}",
              row[f"clients_{key}_failed"]] for when, key in (("before the scale-up", "before"),
                                                              ("while the second worker loaded", "loading"))]))


if __name__ == "__main__":
    main()
