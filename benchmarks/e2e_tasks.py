"""Per task, end to end through one TorchServe on loopback (token auth on): the shipped model YAML (compile at
load) vs the same archive served eagerly (``ladder: [eager]``, compile off), side by side in one run.

Both archives of a task are registered together (one worker each, the shipped batchSize / maxBatchDelay), so
only the optimization differs. Per workload x concurrency cell each model gets --requests requests (the
workload's bodies, cycled) in --rounds rounds that alternate which model goes first; the answers of the two are
checked equal first. text-generation also streams --streams requests per model at concurrency 1: time to first
token and decode tokens/s as a client reads them from the chunked response.

    .venv/bin/python -m benchmarks.e2e_tasks [--tasks ...] [--requests 40] [--concurrency 1 4] \
        [--cache-dir .cache/inductor]

Ports: the shipped ones + --port-shift (default 22000), clear of a dev server, the tests and benchmarks.e2e.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.e2e import Client, send_all
from benchmarks.harness import (DEFAULT_OUT, REPO, log, markdown_table, run_header, summarize, write_csv, write_json,
                                write_plot)
from benchmarks.tasks import TASK_MODELS, check_agreement, model_dir, workloads
from handlers.serving import archive
from handlers.serving import server as torchserve

VARIANTS = ("shipped", "eager")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_tasks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASK_MODELS), choices=list(TASK_MODELS))
    parser.add_argument("--requests", type=int, default=40, help="timed requests per model per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell (requests split)")
    parser.add_argument("--streams", type=int, default=6, help="text-generation: streamed requests per model")
    parser.add_argument("--models", type=Path, default=REPO / ".cache" / "test-models")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir for the workers (default: a new one)")
    parser.add_argument("--port-shift", type=int, default=22000)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for READY")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "e2e-tasks")
    return parser.parse_args()


def package_variants(task: str, args: argparse.Namespace, store: Path, work: Path) -> dict[str, str]:
    """Archive name per variant: the shipped YAML, and the same with compile off and ``ladder: [eager]``."""
    shipped = REPO / "model_configs" / TASK_MODELS[task][0]
    raw = yaml.safe_load(shipped.read_text())
    raw["pt2"] = {"compile": {"enable": False}}
    raw["pt2_handlers"]["ladder"] = ["eager"]
    eager = work / f"{task}-eager.yaml"
    eager.write_text(yaml.safe_dump(raw))
    names = {"shipped": f"bench-{task}", "eager": f"bench-{task}-eager"}  # not token-*: see archive.check_name
    for variant, config in (("shipped", shipped), ("eager", eager)):
        archive.build(names[variant], model_dir(task, args.models), config, store)
    return names


def answers(server: torchserve.Server, model: str, bodies: list[Any]) -> list[Any]:
    client = Client(server.inference_url, server.key("inference"), timeout=300)
    try:
        return [json.loads(client.post(f"/predictions/{model}", json.dumps(body).encode())[1]) for body in bodies]
    finally:
        client.close()


def stream_once(server: torchserve.Server, model: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed request: ms to the first token line, and tokens/s from the first token line to the last."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(server.inference_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    started = time.perf_counter()
    connection.request("POST", f"/predictions/{model}", json.dumps({**body, "stream": True}).encode(),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {server.key('inference')}"})
    response = connection.getresponse()
    arrivals = [time.perf_counter() for line in iter(response.readline, b"") if line.startswith(b'{"token_id"')]
    connection.close()
    decode = arrivals[-1] - arrivals[0]
    return {"ttft_ms": (arrivals[0] - started) * 1000,
            "tokens_per_s": (len(arrivals) - 1) / decode if decode > 0 else float("nan")}


def bench_task(server: torchserve.Server, task: str, names: dict[str, str], args: argparse.Namespace) -> list[dict]:
    for variant in VARIANTS:
        status, body = server.management(
            "POST", f"/models?url={names[variant]}.mar&initial_workers=1&synchronous=true", timeout=args.timeout)
        if status != 200:
            raise SystemExit(f"{names[variant]} did not load: {body[:300]!r}")
    optimization = describe(server, names["shipped"])["optimization"]
    log(f"{task}: shipped READY on rung {optimization['active']} ({optimization['dtype']})")
    rows = []
    try:
        for workload, bodies in workloads(task).items():
            check_agreement(task, answers(server, names["shipped"], bodies), answers(server, names["eager"], bodies))
            for concurrency in args.concurrency:
                row = {"task": task, "workload": workload, "concurrency": concurrency,
                       "active_rung": optimization["active"], "dtype": optimization["dtype"],
                       **run_cell(server, names, bodies, concurrency, args)}
                log(f"  {workload} c{concurrency}: eager {row['eager_rps']} req/s p50 {row['eager_p50_ms']} ms, "
                    f"shipped {row['shipped_rps']} req/s p50 {row['shipped_p50_ms']} ms ({row['speedup_rps']:.2f}x)")
                rows.append(row)
        if task == "text-generation":
            rows.append(stream_row(server, task, names, optimization, args))
    finally:
        for variant in VARIANTS:
            server.management("DELETE", f"/models/{names[variant]}")
    return rows


def describe(server: torchserve.Server, name: str, attempts: int = 5) -> dict[str, Any]:
    """Our describe metadata. Retried: TorchServe 0.12 now and then answers 400 ("Failed to update key file")."""
    for attempt in range(attempts):
        status, raw = server.management("GET", f"/models/{name}?customized=true")
        if status == 200:
            return json.loads(raw)[0]["customizedMetadata"]
        log(f"describe {name}: HTTP {status} {raw[:120]!r}; retrying ({attempt + 1}/{attempts})")
        time.sleep(1)
    raise SystemExit(f"describe {name} kept failing")


def run_cell(server: torchserve.Server, names: dict[str, str], bodies: list[Any], concurrency: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """Both variants, --requests each, in alternating rounds: p50/p90 ms, req/s and errors per variant."""
    merged: dict[str, dict[str, Any]] = {v: {"latencies": [], "errors": [], "seconds": 0.0} for v in VARIANTS}
    per_round = max(1, args.requests // args.rounds)
    batch = [bodies[i % len(bodies)] for i in range(per_round)]
    for variant in VARIANTS:
        send_all(server, names[variant], batch[:concurrency], concurrency)  # untimed warmup
    for round_index in range(args.rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            result = send_all(server, names[variant], batch, concurrency)
            for key in ("latencies", "errors"):
                merged[variant][key] += result[key]
            merged[variant]["seconds"] += result["seconds"]
    row: dict[str, Any] = {}
    for variant in VARIANTS:
        stats = summarize(merged[variant]["latencies"])
        row[f"{variant}_p50_ms"] = round(stats["p50"], 2)
        row[f"{variant}_p90_ms"] = round(stats["p90"], 2)
        row[f"{variant}_rps"] = round(len(merged[variant]["latencies"]) / merged[variant]["seconds"], 2)
        row[f"{variant}_errors"] = len(merged[variant]["errors"])
    row["speedup_rps"] = round(row["shipped_rps"] / row["eager_rps"], 3)
    return row


def stream_row(server: torchserve.Server, task: str, names: dict[str, str], optimization: dict, args) -> dict[str, Any]:
    body = {"text": "serving compiled models in production keeps", "max_new_tokens": 64}
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for variant in VARIANTS:
        stream_once(server, names[variant], body)  # untimed
    for _ in range(args.streams):
        for variant in VARIANTS:
            runs[variant].append(stream_once(server, names[variant], body))
    row = {"task": task, "workload": "stream-b1-64-tokens", "concurrency": 1, "active_rung": optimization["active"],
           "dtype": optimization["dtype"]}
    for variant in VARIANTS:
        row[f"{variant}_ttft_p50_ms"] = round(summarize([r["ttft_ms"] for r in runs[variant]])["p50"], 2)
        row[f"{variant}_tokens_per_s"] = round(summarize([r["tokens_per_s"] for r in runs[variant]])["p50"], 1)
    row["speedup_tokens_per_s"] = round(row["shipped_tokens_per_s"] / row["eager_tokens_per_s"], 3)
    log(f"  streamed: tokens/s eager {row['eager_tokens_per_s']}, shipped {row['shipped_tokens_per_s']} "
        f"({row['speedup_tokens_per_s']:.2f}x); TTFT eager {row['eager_ttft_p50_ms']} ms, shipped "
        f"{row['shipped_ttft_p50_ms']} ms")
    return row


def wait_for_management(server: torchserve.Server, timeout: float) -> None:
    """The key file exists before the management API listens: poll it until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if server.management("GET", "/models")[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the management API did not answer")
        time.sleep(0.5)


def main() -> None:
    args = parse_args()
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="bench-e2e-tasks-inductor-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    header = run_header(args, {"inductor_cache": str(cache)})
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-tasks-"))
    store = work / "model_store"
    names = {task: package_variants(task, args, store, work) for task in args.tasks}
    run_dir = work / "run"
    server = torchserve.start(torchserve.shifted_config(work, args.port_shift), store, [], run_dir, args.timeout,
                              extra_env={"TORCHINDUCTOR_CACHE_DIR": str(cache.resolve())})
    rows = []
    try:
        wait_for_management(server, args.timeout)
        for task in args.tasks:
            rows += bench_task(server, task, names[task], args)
    finally:
        torchserve.stop(run_dir)
    request_rows = [r for r in rows if "speedup_rps" in r]
    table = markdown_table(
        ["task", "workload", "concurrency", "rung (dtype)", "eager req/s", "shipped req/s", "speedup",
         "eager p50 ms", "shipped p50 ms"],
        [[r["task"], r["workload"], r["concurrency"], f"{r['active_rung']} ({r['dtype']})", r["eager_rps"],
          r["shipped_rps"], f"{r['speedup_rps']:.2f}x", r["eager_p50_ms"], r["shipped_p50_ms"]] for r in request_rows])
    for r in rows:
        if "speedup_tokens_per_s" in r:
            table += (f"\n\n{r['task']} streamed, one request of 64 tokens at a time: decode {r['eager_tokens_per_s']}"
                      f" tokens/s eager vs {r['shipped_tokens_per_s']} shipped ({r['speedup_tokens_per_s']:.2f}x); "
                      f"time to first token {r['eager_ttft_p50_ms']} vs {r['shipped_ttft_p50_ms']} ms (p50)")
    write_csv(args.out / "e2e_tasks.csv", rows)
    write_json(args.out / "e2e_tasks.json", {"header": header, "rows": rows})
    (args.out / "e2e_tasks.md").write_text(f"`{header['command']}`\n\n{table}\n")
    write_plot(args.out / "e2e_tasks.png", "Per task through TorchServe: eager vs shipped (req/s)",
               [f"{r['task']}\n{r['workload']} c{r['concurrency']}" for r in request_rows],
               [("req/s", {variant: [r[f"{variant}_rps"] for r in request_rows] for variant in VARIANTS})])
    print(table)


if __name__ == "__main__":
    main()
