"""What a new node costs with each kind of archive: a worker's time to READY through a real TorchServe on loopback,
its first request against a steady one, and its steady throughput, per model, in one run.

Per model (``--models``), three archives of the same weights and model YAML:

    jit            the shipped YAML: the ladder compiles at load
    jit-artifacts  the same with pt2_handlers.compile_artifacts: torch's compile cache artifacts built into the archive
                   by packaging, loaded by the worker before its ladder (inductor skips code generation)
    aot            the same with pt2.export.aot_compile: AOTInductor packages built into the archive

and four starts, each a new TorchServe with a new, empty compile cache directory (a new node), but the third:

    jit, cold            nothing compiled anywhere
    jit, warm cache      a new TorchServe on the cache directory the cold start left (a volume a new pod mounts)
    jit-artifacts, cold  the archive's compile artifacts only
    aot, cold            the archive's packages only

Each start reports the wall time from ``torchserve --start`` to READY, the worker's own load (its log line), the rung
and precision it serves, the first request after READY and the median of the next ``--steady`` (one client), then
``--requests`` requests from ``--concurrency`` clients (req/s, p50, p99). Archive build times and sizes are reported
too (the packages and artifacts are built then). The page cache is not dropped (that needs root): the archive's files
may be read from memory, as on a node that just pulled the image.

    .venv/bin/python -m benchmarks.cold_start [--models minilm minilm-int8 mobilenet] [--requests 400]

Ports: the shipped ones + --port-shift (default 26000), clear of a dev server, the tests and the other benchmarks.
Writes cold_start.json, .csv and .png under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import harness
from benchmarks.e2e import send_all
from benchmarks.restart import mixed_texts, worker_load_seconds
from handlers.serving import archive
from handlers.serving import server as torchserve


@dataclass(frozen=True)
class Model:
    name: str
    config: Path
    build: Callable[[str, Path, Path], Path]  # (archive name, model YAML, store) -> the archive
    bodies: Callable[[int], list[Any]]
    answer_has: bytes


def _minilm(name: str, yaml_path: Path, store: Path) -> Path:
    return archive.build(name, archive.default_model_dir(), yaml_path, store)


def _mobilenet(name: str, yaml_path: Path, store: Path) -> Path:
    from benchmarks.vision_networks import LABELS, NETWORKS

    network = NETWORKS["mobilenet_v2"]
    return archive.build(name, None, yaml_path, store, extra_files=(LABELS,),
                         files=archive.ModelForm(network.model_file, network.weights(store)))


def _image_bodies(count: int) -> list[Any]:
    from benchmarks.e2e_vision import bodies

    return bodies(count)


def _text_bodies(count: int) -> list[Any]:
    return [{"text": text} for text in mixed_texts(count)]


CONFIGS = harness.REPO / "model_configs"
MODELS = {model.name: model for model in (
    Model("minilm", CONFIGS / "minilm-embeddings.yaml", _minilm, _text_bodies, b"embedding"),
    Model("minilm-int8", CONFIGS / "minilm-embeddings-int8.yaml", _minilm, _text_bodies,
          b"embedding"),
    Model("mobilenet", CONFIGS / "mobilenet-image-classification.yaml", _mobilenet, _image_bodies, b"{"),
)}
VARIANTS = {
    "jit": {},
    "jit-artifacts": {"pt2_handlers": {"compile_artifacts": True}},
    "aot": {"pt2": {"export": {"aot_compile": True}}},
}


def variant_yaml(model: Model, variant: str, out: Path) -> Path:
    raw = yaml.safe_load(model.config.read_text())
    for section, values in VARIANTS[variant].items():
        raw.setdefault(section, {}).update(values)
    path = out / f"{model.name}-{variant}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def build_archives(model: Model, variants: list[str], store: Path, work: Path) -> dict[str, dict[str, Any]]:
    built = {}
    for variant in variants:
        name = f"{model.name}-{variant}"
        harness.log(f"packaging {name}")
        started = time.perf_counter()
        path = model.build(name, variant_yaml(model, variant, work), store)
        built[variant] = {"archive": name, "build_seconds": round(time.perf_counter() - started, 1),
                          "archive_mb": round(path.stat().st_size / 1e6, 1)}
        harness.log(f"  {name}: {built[variant]['archive_mb']} MB in {built[variant]['build_seconds']}s")
    return built


def start(args: argparse.Namespace, model: Model, name: str, store: Path, work: Path, run: str,
          cache: Path) -> dict[str, Any]:
    """One TorchServe serving ``name`` on ``cache``: its start, first and steady requests, and load; then stopped."""
    config = torchserve.shifted_config(work, args.port_shift)
    run_dir = work / run
    started = time.monotonic()
    server = torchserve.start(config, store, [f"{model.name}={name}.mar"], run_dir, timeout=900,
                              extra_env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    ready = time.monotonic() - started
    try:
        status, raw = server.management("GET", f"/models/{model.name}?customized=true")
        described = json.loads(raw)[0].get("customizedMetadata", {}) if status == 200 else {}
        optimization = described.get("optimization", {}) if isinstance(described, dict) else {}
        bodies = model.bodies(args.steady + 1)
        times = []
        for body in bodies:
            began = time.perf_counter()
            status, answer = server.call("POST", f"{server.inference_url}/predictions/{model.name}", "inference",
                                         json.dumps(body).encode(), "application/json", timeout=300)
            times.append((time.perf_counter() - began) * 1000)
            assert status == 200, answer[:300]
        steady = statistics.median(times[1:])
        loaded = send_all(server, model.name, model.bodies(args.requests), args.concurrency, model.answer_has)
    finally:
        torchserve.stop(run_dir)
        log = run_dir / "logs" / "model_log.log"
        if log.is_file():
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, args.out / f"cold_start-{run}-model_log.log")
    latencies = loaded["latencies"]
    return {"ready_seconds": round(ready, 1), "worker_load_seconds": (worker_load_seconds(run_dir, model.name)
                                                                     or [None])[-1],
            "rung": optimization.get("active"), "dtype": optimization.get("dtype"),
            "first_ms": round(times[0], 1), "steady_ms": round(steady, 1),
            "first_vs_steady": round(times[0] / steady, 2),
            "req_s": round(len(latencies) / loaded["seconds"], 1),
            "p50_ms": round(harness.percentile(latencies, 50), 1),
            "p99_ms": round(harness.percentile(latencies, 99), 1),
            "failed": len(loaded["errors"])}


def measure_model(args: argparse.Namespace, model: Model) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix=f"cold-start-{model.name}-"))
    try:
        store = work / "store"
        built = build_archives(model, args.variants, store, work)
        starts = [("jit", "cold", "cache-jit"), ("jit", "warm cache", "cache-jit"),
                  ("jit-artifacts", "cold", "cache-artifacts"), ("aot", "cold", "cache-aot")]
        rows = []
        for index, (variant, case, cache) in enumerate(starts):
            if variant not in built:
                continue
            harness.log(f"{model.name}: {variant}, {case} ({index + 1}/{len(starts)})")
            row = {"model": model.name, "archive": variant, "case": case, **built[variant],
                   **start(args, model, built[variant]["archive"], store, work, f"{variant}-{case.replace(' ', '-')}",
                           work / cache)}
            harness.log(f"  READY after {row['ready_seconds']}s (worker {row['worker_load_seconds']}s) on "
                        f"{row['rung']} ({row['dtype']}); first request {row['first_ms']} ms, steady "
                        f"{row['steady_ms']} ms; {row['req_s']} req/s, p99 {row['p99_ms']} ms")
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steady", type=int, default=20, help="lone requests after the first (their median)")
    parser.add_argument("--requests", type=int, default=400, help="requests from --concurrency clients")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port-shift", type=int, default=26000)
    parser.add_argument("--out", type=Path, default=harness.DEFAULT_OUT)
    args = parser.parse_args()
    header = harness.run_header(args)
    harness.warn_if_busy()
    rows = [row for name in args.models for row in measure_model(args, MODELS[name])]
    harness.write_json(args.out / "cold_start.json", {"header": header, "rows": rows})
    harness.write_csv(args.out / "cold_start.csv", rows)
    labels = [f"{row['model']} {row['archive']} {row['case']}" for row in rows]
    harness.write_plot(args.out / "cold_start.png", "A new node: seconds to READY", labels,
                       [("seconds to READY", {"TorchServe": [row["ready_seconds"] for row in rows]})])
    print(harness.markdown_table(
        ["model", "archive", "case", "archive MB", "READY (s)", "worker load (s)", "serves", "first / steady ms",
         "req/s", "p50 / p99 ms"],
        [[row["model"], row["archive"], row["case"], row["archive_mb"], row["ready_seconds"],
          row["worker_load_seconds"], f"{row['rung']} ({row['dtype']})", f"{row['first_ms']} / {row['steady_ms']}",
          row["req_s"], f"{row['p50_ms']} / {row['p99_ms']}"] for row in rows]))


if __name__ == "__main__":
    main()
