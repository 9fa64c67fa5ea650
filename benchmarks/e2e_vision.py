"""Image classification end to end through one TorchServe on loopback (token auth on): MobileNetV2 with its ImageNet
weights, the same model.py + state_dict + index_to_name.json in three archives, side by side:

    stock          TorchServe's image_classifier handler (benchmarks/baseline_image_handler.py), fp32 eager
    stock-compile  the same with TorchServe's own ``pt2: {compile: {enable: true, backend: inductor}}``: it compiles
                   at the first request, whose time is reported
    pt2-handlers   model_configs/mobilenet-image-classification.yaml (the ladder, at load)

All three take the same batching (batchSize / maxBatchDelay of the shipped YAML) and one worker each. Every request
is one photograph as base64 text in a JSON string (which both handlers read); the answers' top labels are checked
equal first. Per concurrency, each archive gets --requests requests in --rounds rounds that alternate which goes
first; requests per second and latency percentiles, as multiples of the stock handler's.

    .venv/bin/python -m benchmarks.e2e_vision [--requests 200] [--concurrency 1 16] [--rounds 2]

Ports: the shipped ones + --port-shift (default 23000), clear of a dev server, the tests and the other benchmarks.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.e2e import send_all
from benchmarks.harness import (DEFAULT_OUT, REPO, log, markdown_table, run_header, write_csv, write_json,
                                write_plot)
from handlers.serving import archive
from handlers.serving import server as torchserve

EXAMPLE = REPO / "docs" / "examples" / "mobilenet_v2"
SHIPPED = REPO / "model_configs" / "mobilenet-image-classification.yaml"
HANDLER = REPO / "benchmarks" / "baseline_image_handler.py"
STOCK, STOCK_COMPILE, OURS = "stock", "stock-compile", "pt2-handlers"
MODELS = (STOCK, STOCK_COMPILE, OURS)
SHARED_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per archive per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per concurrency (requests split)")
    parser.add_argument("--warmup", type=int, default=40, help="untimed requests per archive first")
    parser.add_argument("--weights", type=Path, help="mobilenet_v2-b0353104.pth (default: scripts/setup.sh fetches it)")
    parser.add_argument("--port-shift", type=int, default=23000)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for READY")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "e2e-vision")
    return parser.parse_args()


def package_stock(name: str, weights: Path, store: Path, work: Path, compiled: bool) -> None:
    """The stock handler's archive, as torch-model-archiver packs TorchServe's image classifier example."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    config = {key: shipped[key] for key in SHARED_KEYS if key in shipped}
    if compiled:
        config["pt2"] = {"compile": {"enable": True, "backend": "inductor"}}
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [archive.archiver(), "--model-name", name, "--version", "1.0", "--model-file", str(EXAMPLE / "model.py"),
               "--serialized-file", str(weights), "--handler", str(HANDLER),
               "--extra-files", str(EXAMPLE / "index_to_name.json"), "--config-file", str(config_path),
               "--export-path", str(store), "--force"]
    log(f"packaging {name}: {' '.join(command)}")
    subprocess.run(command, check=True)


def bodies(count: int) -> list[str]:
    import sklearn.datasets

    photos = sorted((Path(sklearn.datasets.__file__).parent / "images").glob("*.jpg"))
    encoded = [base64.b64encode(path.read_bytes()).decode() for path in photos]
    return [encoded[index % len(encoded)] for index in range(count)]


def first_answers(server: torchserve.Server) -> dict[str, tuple[float, Any]]:
    """Each archive's first request: seconds, and its answer (stock-compile compiles here)."""
    found = {}
    for model in MODELS:
        started = time.perf_counter()
        status, raw = server.call("POST", f"{server.inference_url}/predictions/{model}", "inference",
                                  json.dumps(bodies(1)[0]).encode(), "application/json", timeout=900)
        seconds = time.perf_counter() - started
        assert status == 200, (model, raw[:300])
        found[model] = (seconds, json.loads(raw))
        log(f"{model}: first request answered in {seconds:.2f}s: {list(found[model][1])[:2]}")
    tops = {model: next(iter(answer)) for model, (_, answer) in found.items()}
    assert len(set(tops.values())) == 1, tops
    return found


def main() -> int:
    args = parse_args()
    header = run_header(args)
    from benchmarks.vision import weights_path

    weights = weights_path(args.weights)
    work = Path(tempfile.mkdtemp(prefix="e2e-vision-"))
    store = work / "store"
    store.mkdir()
    package_stock(STOCK, weights, store, work, compiled=False)
    package_stock(STOCK_COMPILE, weights, store, work, compiled=True)
    archive.build(OURS, None, SHIPPED, store, extra_files=(EXAMPLE / "index_to_name.json",),
                  files=archive.ModelForm(EXAMPLE / "model.py", weights))
    config = torchserve.shifted_config(work, args.port_shift)
    started = time.perf_counter()
    server = torchserve.start(config, store, [f"{model}={model}.mar" for model in MODELS], work / "run",
                              args.timeout, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")})
    log(f"TorchServe READY with {', '.join(MODELS)} in {time.perf_counter() - started:.1f}s")
    rows: list[dict[str, Any]] = []
    try:
        firsts = first_answers(server)
        for model in MODELS:
            send_all(server, model, bodies(args.warmup), 2)
        for concurrency in args.concurrency:
            results: dict[str, list[dict[str, Any]]] = {model: [] for model in MODELS}
            share = args.requests // args.rounds
            for round_index in range(args.rounds):
                order = MODELS if round_index % 2 == 0 else tuple(reversed(MODELS))
                for model in order:
                    results[model].append(send_all(server, model, bodies(share), concurrency))
                    last = results[model][-1]
                    log(f"c{concurrency} round {round_index + 1}: {model} {share / last['seconds']:.1f} req/s")
            rows.extend(cell_rows(results, concurrency, firsts))
    finally:
        torchserve.stop(server.run_dir)
        shutil.rmtree(work / "run" / "tmp", ignore_errors=True)
    report(args, header, rows)
    return 0


def cell_rows(results: dict[str, list[dict[str, Any]]], concurrency: int,
              firsts: dict[str, tuple[float, Any]]) -> list[dict[str, Any]]:
    from benchmarks.harness import percentile

    cells = []
    for model, runs in results.items():
        latencies = [ms for run in runs for ms in run["latencies"]]
        errors = sum(len(run["errors"]) for run in runs)
        rps = len(latencies) / sum(run["seconds"] for run in runs)
        cells.append({"model": model, "concurrency": concurrency, "rps": round(rps, 2),
                      "p50_ms": round(percentile(latencies, 50), 2), "p99_ms": round(percentile(latencies, 99), 2),
                      "errors": errors, "first_request_s": round(firsts[model][0], 2)})
    stock = next(cell["rps"] for cell in cells if cell["model"] == STOCK)
    for cell in cells:
        cell["x_stock"] = round(cell["rps"] / stock, 2)
    return cells


def report(args: argparse.Namespace, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "e2e_vision.csv", rows)
    write_json(args.out / "e2e_vision.json", {**header, "rows": rows})
    table = markdown_table(["archive", "clients", "req/s", "x stock", "p50 ms", "p99 ms", "errors", "first request s"],
                           [[r["model"], r["concurrency"], r["rps"], r["x_stock"], r["p50_ms"], r["p99_ms"],
                             r["errors"], r["first_request_s"]] for r in rows])
    print(table)
    (args.out / "e2e_vision.md").write_text(table + "\n")
    write_plot(args.out / "e2e_vision.png", "MobileNetV2 through TorchServe (requests per second)",
               [f"{c} clients" for c in args.concurrency],
               [("req/s", {model: [next(r["rps"] for r in rows if r["model"] == model and r["concurrency"] == c)
                                   for c in args.concurrency] for model in MODELS})])


if __name__ == "__main__":
    raise SystemExit(main())
