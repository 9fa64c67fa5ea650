"""Image classification end to end through TorchServe on loopback (token auth on): per network (MobileNetV2 with its
ImageNet weights, ResNet-50 with random ones: benchmarks/vision_networks.py), one TorchServe serving the same model.py
+ state_dict + index_to_name.json in three archives, side by side:

    stock          TorchServe's image_classifier handler (benchmarks/baseline_image_handler.py), fp32 eager
    stock-compile  the same with TorchServe's own ``pt2: {compile: {enable: true, backend: inductor}}``: it compiles
                   at the first request, whose time is reported
    pt2-handlers   model_configs/mobilenet-image-classification.yaml's settings (the ladder, at load)
    pt2-handlers-int8  with --int8: the same with ``dtype: [int8, auto]`` and ``pick: fastest``: int8 (the compile
                   rung's static int8 of the convolutions and linear layers) where the gate keeps it and it is faster
                   than what auto picks, raced against OpenVINO

With ``--stock torchvision`` the two stock archives are TorchServe's own ``image_classifier`` handler, which imports
torchvision and captum: they are served by a second TorchServe run from a venv of torch's CUDA build (on CPU),
torchvision and captum (``scripts/setup.sh --profile stock-vision``: built on first use outside the clone, several
GB, never in CI), beside the first; rounds alternate between all archives as in one server. By default
(``--stock replica``) they are benchmarks/baseline_image_handler.py, the same handler with PIL doing torchvision's
four transforms, in the same TorchServe as pt2-handlers.

All take the same batching (batchSize / maxBatchDelay of the shipped YAML) and one worker each. Every request
is one photograph (scikit-learn's two 640 x 427 JPEGs) as base64 text in a JSON string (which both handlers read); the
answers' top labels are compared first (a difference is logged). Per concurrency, each archive gets --requests
requests in --rounds rounds that alternate which goes first; requests per second and latency percentiles, as
multiples of the stock handler's.

    .venv/bin/python -m benchmarks.e2e_vision [--networks mobilenet_v2 resnet50] [--requests 200] [--concurrency 1 16]
        [--int8]

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
from benchmarks.harness import (DEFAULT_OUT, REPO, log, markdown_table, profile_venv, run_header, write_csv,
                                write_json, write_plot)
from benchmarks.vision_networks import LABELS, NETWORKS, SHIPPED, Network
from handlers.serving import archive
from handlers.serving import server as torchserve

HANDLER = REPO / "benchmarks" / "baseline_image_handler.py"
STOCK, STOCK_COMPILE, OURS, OURS_INT8 = "stock", "stock-compile", "pt2-handlers", "pt2-handlers-int8"
INT8_SETTINGS = {"dtype": ["int8", "auto"], "pick": "fastest"}
LONE_STAGES = ("parse", "preprocess", "forward", "postprocess", "handler", "outside_handler", "client")
SHARED_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--requests", type=int, default=200, help="timed requests per archive per concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per concurrency (requests split)")
    parser.add_argument("--warmup", type=int, default=40, help="untimed requests per archive first")
    parser.add_argument("--port-shift", type=int, default=23000)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for READY")
    parser.add_argument("--stock", choices=("replica", "torchvision"), default="replica",
                        help="the stock rows: the replica handler beside ours, or TorchServe's own image_classifier "
                             "from the stock-vision venv in a second TorchServe (see above)")
    parser.add_argument("--int8", action="store_true",
                        help=f"a fourth archive, {OURS_INT8}: the shipped YAML with " + ", ".join(
                            f"{key}: {value}" for key, value in INT8_SETTINGS.items()))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "e2e-vision")
    args = parser.parse_args()
    needs = [name for name in args.networks if NETWORKS[name].needs_transformers]
    if args.stock == "torchvision" and needs:
        parser.error(f"--stock torchvision: the model.py of {', '.join(needs)} imports transformers, which the "
                     "stock-vision venv does not hold; pass --networks without them")
    args.models = (STOCK, STOCK_COMPILE, OURS, *((OURS_INT8,) if args.int8 else ()))
    return args


def package_stock(name: str, network: Network, weights: Path, store: Path, work: Path, compiled: bool,
                  venv: Path | None = None) -> None:
    """The stock handler's archive, as torch-model-archiver packs TorchServe's image classifier example: with
    ``venv``, by that venv's archiver with TorchServe's own ``image_classifier``; else with the replica."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    config = {key: shipped[key] for key in SHARED_KEYS if key in shipped}
    if compiled:
        config["pt2"] = {"compile": {"enable": True, "backend": "inductor"}}
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    archiver = str(venv / "bin" / "torch-model-archiver") if venv else archive.archiver()
    command = [archiver, "--model-name", name, "--version", "1.0", "--model-file", str(network.model_file),
               "--serialized-file", str(weights), "--handler", "image_classifier" if venv else str(HANDLER),
               "--extra-files", str(LABELS), "--config-file", str(config_path),
               "--export-path", str(store), "--force"]
    log(f"packaging {name}: {' '.join(command)}")
    subprocess.run(command, check=True)


def bodies(count: int) -> list[str]:
    import sklearn.datasets

    photos = sorted((Path(sklearn.datasets.__file__).parent / "images").glob("*.jpg"))
    encoded = [base64.b64encode(path.read_bytes()).decode() for path in photos]
    return [encoded[index % len(encoded)] for index in range(count)]


def first_answers(servers: dict[str, torchserve.Server]) -> dict[str, tuple[float, Any]]:
    """Each archive's first request (``servers``: model -> the TorchServe serving it): seconds, and its answer
    (stock-compile compiles here)."""
    found = {}
    for model, server in servers.items():
        started = time.perf_counter()
        status, raw = server.call("POST", f"{server.inference_url}/predictions/{model}", "inference",
                                  json.dumps(bodies(1)[0]).encode(), "application/json", timeout=900)
        seconds = time.perf_counter() - started
        assert status == 200, (model, raw[:300])
        found[model] = (seconds, json.loads(raw))
        log(f"{model}: first request answered in {seconds:.2f}s: {list(found[model][1])[:2]}")
    tops = {model: next(iter(answer)) for model, (_, answer) in found.items()}
    if len(set(tops.values())) != 1:
        log(f"WARNING: the archives' most likely labels differ: {tops}")
    return found


def main() -> int:
    args = parse_args()
    header = run_header(args)
    rows: list[dict[str, Any]] = []
    for name in args.networks:
        rows.extend(serve_and_load(args, NETWORKS[name]))
    report(args, header, rows)
    return 0


def serve_and_load(args: argparse.Namespace, network: Network) -> list[dict[str, Any]]:
    """``network`` in each archive (one TorchServe; two with ``--stock torchvision``); its rows."""
    work = Path(tempfile.mkdtemp(prefix="e2e-vision-"))
    store = work / "store"
    store.mkdir()
    weights = network.weights(work)
    log(f"== {network.title}")
    stock_venv = profile_venv("stock-vision", "bin/torchserve") if args.stock == "torchvision" else None
    stock_store = work / "stock-store" if stock_venv else store
    stock_store.mkdir(exist_ok=True)
    package_stock(STOCK, network, weights, stock_store, work, compiled=False, venv=stock_venv)
    package_stock(STOCK_COMPILE, network, weights, stock_store, work, compiled=True, venv=stock_venv)
    archive.build(OURS, None, SHIPPED, store, extra_files=(LABELS,),
                  files=archive.ModelForm(network.model_file, weights))
    if OURS_INT8 in args.models:
        int8 = yaml.safe_load(SHIPPED.read_text())
        int8["pt2_handlers"].update(INT8_SETTINGS)
        (work / f"{OURS_INT8}.yaml").write_text(yaml.safe_dump(int8, sort_keys=False))
        archive.build(OURS_INT8, None, work / f"{OURS_INT8}.yaml", store, extra_files=(LABELS,),
                      files=archive.ModelForm(network.model_file, weights))
    models = args.models
    ours = [model for model in models if not (stock_venv and model in (STOCK, STOCK_COMPILE))]
    started = time.perf_counter()
    server = torchserve.start(torchserve.shifted_config(work, args.port_shift), store,
                              [f"{model}={model}.mar" for model in ours], work / "run", args.timeout,
                              extra_env={"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")})
    log(f"TorchServe READY with {', '.join(ours)} in {time.perf_counter() - started:.1f}s")
    servers = {model: server for model in ours}
    try:
        if stock_venv:
            servers.update(start_stock(args, work, stock_store, stock_venv))
        return measure(args, network, servers)
    finally:
        for run_dir in {served.run_dir for served in servers.values()}:
            torchserve.stop(run_dir)
        shutil.rmtree(work, ignore_errors=True)


def start_stock(args: argparse.Namespace, work: Path, store: Path, venv: Path) -> dict[str, torchserve.Server]:
    """The second TorchServe, from ``venv``, serving the two stock archives."""
    (work / "stock").mkdir()
    started = time.perf_counter()
    server = torchserve.start(torchserve.shifted_config(work / "stock", args.port_shift + 100), store,
                              [f"{model}={model}.mar" for model in (STOCK, STOCK_COMPILE)], work / "stock-run",
                              args.timeout, extra_env={"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-stock")},
                              venv=venv)
    log(f"the stock TorchServe ({venv.name}) READY in {time.perf_counter() - started:.1f}s")
    return {STOCK: server, STOCK_COMPILE: server}


def measure(args: argparse.Namespace, network: Network, servers: dict[str, torchserve.Server]) -> list[dict[str, Any]]:
    """Each archive's first request, then rounds at each concurrency, alternating which goes first; the rows."""
    models = tuple(model for model in args.models if model in servers)
    rows: list[dict[str, Any]] = []
    firsts = first_answers({model: servers[model] for model in models})
    for model in models:
        send_all(servers[model], model, bodies(args.warmup), 2)
    for concurrency in args.concurrency:
        results: dict[str, list[dict[str, Any]]] = {model: [] for model in models}
        share = args.requests // args.rounds
        for round_index in range(args.rounds):
            for model in models if round_index % 2 == 0 else tuple(reversed(models)):
                results[model].append(send_all(servers[model], model, bodies(share), concurrency))
                log(f"{network.name} c{concurrency} round {round_index + 1}: {model} "
                    f"{share / results[model][-1]['seconds']:.1f} req/s")
        rows.extend({"network": network.name, **cell} for cell in cell_rows(results, concurrency, firsts))
    stages = lone_request_stages(servers[OURS], args.requests // 2)
    for row in rows:
        if row["archive"] == OURS and row["concurrency"] == 1:
            row.update({f"lone_{stage}_ms": ms for stage, ms in stages.items()})
    return rows


def lone_request_stages(server: torchserve.Server, count: int) -> dict[str, float]:
    """Where a lone request's time goes in pt2-handlers, from each answer's Server-Timing: the median of each stage
    (parse: base64, decode, resize, crop and normalize; forward; postprocess: softmax, top k, labels), the worker's
    whole call, and what the client waited beyond it (TorchServe's frontend, its batching window, HTTP)."""
    from benchmarks.e2e import Client
    from benchmarks.harness import percentile
    from handlers.serving import server_timing

    client = Client(server.inference_url, server.key("inference") or "")
    seen: dict[str, list[float]] = {}
    try:
        for body in bodies(count):
            started = time.perf_counter()
            status, raw, headers = client.exchange(f"/predictions/{OURS}", json.dumps(body).encode())
            took = (time.perf_counter() - started) * 1000
            assert status == 200, raw[:200]
            timing = server_timing.durations(headers.get(server_timing.NAME) or "")
            timing["client"] = took
            timing["outside_handler"] = took - timing.get(server_timing.HANDLER, took)
            for stage, ms in timing.items():
                seen.setdefault(stage, []).append(ms)
    finally:
        client.close()
    medians = {stage: round(percentile(values, 50), 2) for stage, values in seen.items()}
    log("a lone request's median ms per stage: " + ", ".join(f"{stage} {ms}" for stage, ms in medians.items()))
    return medians


def cell_rows(results: dict[str, list[dict[str, Any]]], concurrency: int,
              firsts: dict[str, tuple[float, Any]]) -> list[dict[str, Any]]:
    from benchmarks.harness import percentile

    cells = []
    for model, runs in results.items():
        latencies = [ms for run in runs for ms in run["latencies"]]
        errors = sum(len(run["errors"]) for run in runs)
        rps = len(latencies) / sum(run["seconds"] for run in runs)
        cells.append({"archive": model, "concurrency": concurrency, "rps": round(rps, 2),
                      "p50_ms": round(percentile(latencies, 50), 2), "p99_ms": round(percentile(latencies, 99), 2),
                      "errors": errors, "first_request_s": round(firsts[model][0], 2)})
    stock = next(cell["rps"] for cell in cells if cell["archive"] == STOCK)
    for cell in cells:
        cell["x_stock"] = round(cell["rps"] / stock, 2)
    return cells


def report(args: argparse.Namespace, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "e2e_vision.csv", rows)
    write_json(args.out / "e2e_vision.json", {**header, "rows": rows})
    table = markdown_table(["network", "archive", "clients", "req/s", "x stock", "p50 ms", "p99 ms", "errors",
                            "first request s"],
                           [[r["network"], r["archive"], r["concurrency"], r["rps"], r["x_stock"], r["p50_ms"],
                             r["p99_ms"], r["errors"], r["first_request_s"]] for r in rows])
    lone = [[r["network"], *(r.get(f"lone_{stage}_ms", "") for stage in LONE_STAGES)]
            for r in rows if r["archive"] == OURS and r["concurrency"] == 1]
    table += "\n\nA lone request to pt2-handlers, median ms per stage (Server-Timing):\n\n" + markdown_table(
        ["network", *LONE_STAGES], lone)
    print(table)
    (args.out / "e2e_vision.md").write_text(table + "\n")
    write_plot(args.out / "e2e_vision.png", "Image classifiers through TorchServe (requests per second)",
               [f"{c} clients" for c in args.concurrency],
               [(NETWORKS[name].title, {model: [next(r["rps"] for r in rows if r["network"] == name
                                                     and r["archive"] == model and r["concurrency"] == c)
                                                for c in args.concurrency] for model in args.models})
                for name in args.networks])


if __name__ == "__main__":
    raise SystemExit(main())
