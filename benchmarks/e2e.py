"""End to end through one TorchServe on loopback (token auth on): pt2-handlers vs a plain eager baseline.

Why: the model-only numbers (benchmarks/model.py) leave out HTTP, batching and tokenization; this is what
a client sees. Both archives are served by the same TorchServe with the same batchSize / maxBatchDelay /
workers (benchmarks/baseline.yaml mirrors the model YAML), so only the handler differs:

    minilm     python -m handlers package with model_configs/minilm-embeddings.yaml (or --config)
    baseline   benchmarks/baseline_handler.py: fp32 eager, padded to 128 tokens (TorchServe's HF example)

Per workload x concurrency cell, each model gets --requests requests from --concurrency keep-alive clients,
in --rounds rounds that alternate the order (ABBA...: forward, then reversed), so drift on the box hits all; each
model's share of a round follows --settle untimed requests, one at a time, as it has sat idle while the others ran. The
ports are the shipped ones + --port-shift (default 20000), clear of a dev server (+0) and the tests (+10000).

More rows, same load, same run (each gets its own row in the CSV, PNG and table, with its ratio to the baseline):

    --extra-archive NAME=YAML [KEY=VALUE ...]
                                another archive of the same model directory, packaged with that model YAML (each
                                KEY=VALUE overriding it, as --set does) and served by the same TorchServe
                                (repeatable), e.g. --extra-archive int8=model_configs/minilm-embeddings-int8.yaml
    --scale NAME=WORKERS        once READY, scale that archive to WORKERS workers through the management API, as an
                                operator would (the model YAML's minWorkers stays what it was), e.g. --scale int8=2
    --openai NAME               that archive (or peer) once more as OpenAI's SDK calls it: the same texts in the
                                SDK's default request (base64 answers; an archive's at .../<version>/v1/embeddings),
                                a row NAME+openai
    --peers infinity-torch infinity-optimum
                                the Infinity embedding server (benchmarks/peers.py) on the same directory, 127.0.0.1,
                                mean pooling, batch size 32, from its own venv (scripts/setup.sh --profile infinity,
                                built the first time, ~1 min); its answers are checked against sentence-transformers
                                first and a peer below min cosine 0.99 is refused (no row)

    .venv/bin/python -m benchmarks.e2e [--requests 200] [--concurrency 1 4 16] [--workloads uniform mixed] \
        [--peers infinity-torch infinity-optimum] [--extra-archive NAME=YAML [KEY=VALUE ...] ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks import peers
from benchmarks.harness import (DEFAULT_OUT, REPO, OtherCpu, apply_settings, log, markdown_table, pids_with_arg,
                                run_header, summarize, write_csv, write_json, write_plot)
from handlers.serving import archive, management
from handlers.serving import server as torchserve

OURS, BASELINE = "minilm", "baseline"
MODELS = (OURS, BASELINE)  # always served; --extra-archive adds archives, --peers adds other servers
LABELS = {OURS: "pt2-handlers (minilm)", BASELINE: "eager baseline", **peers.LABELS}
BASELINE_HANDLER = REPO / "benchmarks" / "baseline_handler.py"
BASELINE_YAML = REPO / "benchmarks" / "baseline.yaml"
# words per text; each word is one token (+2 specials). short: the speed goals' lone short request (8-16 words), not
# run unless asked
WORKLOADS = {"uniform": (118, 118), "mixed": (8, 96), "short": (8, 16)}
MIN_AGREEMENT = 0.99  # ours may serve bf16; the baseline is fp32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per model per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=list(WORKLOADS),
                        help="uniform: ~120-token texts; mixed: 8-96 words; short: 8-16 words")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell (requests split)")
    # Each target sits idle for seconds while the others take their turn in a round, which a steady stream of requests
    # at one concurrency never does: under a hypervisor its idle cores are given up, and at concurrency 1 its first
    # request after that was a cell's p99. What idleness costs a lone request is benchmarks.overhead --idle-ms's to say.
    parser.add_argument("--settle", type=int, default=2,
                        help="untimed requests to each target, one at a time, before its timed share of a round")
    # TorchServe's frontend (a JVM) serves a lone request ~2-5 ms slower for its first few hundred requests, while its
    # JIT compiles; a serving server is past that, and so is a peer, which needs no warming (docs/performance.md).
    parser.add_argument("--warmup", type=int, default=400, help="untimed requests per model and workload first")
    parser.add_argument("--config", type=Path, default=archive.DEFAULT_CONFIG, help="model YAML for ours")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override the model YAML (both models' batching follows it), e.g. maxBatchDelay=1 "
                             "minWorkers=2 pt2_handlers.threads=1")
    parser.add_argument("--server-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="lines added to TorchServe's config.properties, e.g. vmargs=-XX:TieredStopAtLevel=4 "
                             "(the JVM's default JIT, C2, instead of the shipped C1 only)")
    parser.add_argument("--port-shift", type=int, default=20000)
    parser.add_argument("--cold-cache", action="store_true",
                        help="a new empty inductor cache (default: the repo's .cache/inductor, like scripts/start.sh)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for READY")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "e2e",
                        help="output stem: writes STEM.csv, .png, .md, .json (default bench_results/e2e)")
    parser.add_argument("--extra-archive", action="append", default=[], nargs="+", metavar="NAME=YAML [KEY=VALUE]",
                        help="also package the model with this YAML as archive NAME and time it (repeatable); "
                             "KEY=VALUE pairs after it override that YAML as --set does, e.g. --extra-archive "
                             "py=model_configs/minilm-embeddings-int8.yaml 'pt2.compile.options={}'")
    parser.add_argument("--scale", nargs="+", default=[], metavar="NAME=WORKERS", type=scale_arg,
                        help="once READY, scale these archives through the management API (minWorkers stays)")
    parser.add_argument("--openai", nargs="+", default=[], metavar="NAME",
                        help="also time these archives (or --peers) as OpenAI's SDK calls them: the same texts in "
                             "its default request ({\"input\", \"model\", \"encoding_format\": \"base64\"}; an "
                             "archive at .../<version>/v1/embeddings), a row NAME+openai each")
    parser.add_argument("--peers", nargs="+", default=[], choices=peers.PEERS,
                        help="also time these servers on the same model directory (benchmarks/peers.py)")
    parser.add_argument("--peer-batch-size", type=int, default=32, help="the peers' --batch-size")
    parser.add_argument("--peer-timeout", type=float, default=600,
                        help="seconds a peer may take to answer /health (and its ONNX export)")
    args = parser.parse_args()
    try:
        args.extra_archive = [(*extra_archive(first), tuple(settings)) for first, *settings in args.extra_archive]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--extra-archive: {exc}")
    names = [name for name, _, _ in args.extra_archive]
    unknown = {name for name, _ in args.scale} - {OURS, BASELINE, *names}
    if unknown:
        parser.error(f"--scale: no archive named {sorted(unknown)}")
    if set(args.openai) - {OURS, *names, *args.peers}:
        parser.error(f"--openai: no archive or peer named {sorted(set(args.openai) - {OURS, *names, *args.peers})}")
    if len(set(names)) != len(names) or set(names) & {OURS, BASELINE, *peers.PEERS}:
        parser.error(f"--extra-archive names must be unique and not {OURS}, {BASELINE} or a peer: {names}")
    return args


def scale_arg(value: str) -> tuple[str, int]:
    name, sep, workers = value.partition("=")
    if not sep or not workers.isdigit() or int(workers) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=WORKERS, got {value!r}")
    return name, int(workers)


def extra_archive(value: str) -> tuple[str, Path]:
    name, sep, config = value.partition("=")
    if not sep or not name or not Path(config).is_file():
        raise argparse.ArgumentTypeError(f"expected NAME=YAML with an existing model YAML, got {value!r}")
    archive.check_name(name)
    return name, Path(config).resolve()


SHARED_KEYS = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay")  # what makes it a fair comparison


def overridden_config(config: Path, settings: Sequence[str], work: Path, name: str = OURS) -> Path:
    """``config`` with each ``key.sub=value`` (value read as YAML) applied, written as ``work/NAME.yaml``;
    ``config`` itself if none."""
    import yaml

    if not settings:
        return config
    data = apply_settings(yaml.safe_load(config.read_text()), settings)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    log(f"model YAML of {name}: {config} with {' '.join(settings)}")
    return path


def baseline_yaml(our_config: Path, work: Path) -> Path:
    """benchmarks/baseline.yaml with our model YAML's batching and workers, so a --config variant (e.g. a
    longer maxBatchDelay) changes both sides alike."""
    import yaml

    baseline = yaml.safe_load(BASELINE_YAML.read_text())
    ours = yaml.safe_load(our_config.read_text())
    baseline.update({key: ours[key] for key in SHARED_KEYS if key in ours})
    path = work / "baseline.yaml"
    path.write_text(yaml.safe_dump(baseline, sort_keys=False))
    return path


def package_baseline(model_dir: Path, store: Path, config: Path) -> Path:
    """baseline.mar: the handler file + ``model/`` only; it needs torch, transformers and ts, not ``handlers``."""
    with tempfile.TemporaryDirectory(prefix="baseline-stage-") as tmp:
        staging = Path(tmp) / "archive"
        shutil.copytree(model_dir, staging / "model", ignore=lambda _dir, names: [
            n for n in names if n.startswith(".") or Path(n).suffix in archive.EXCLUDED_SUFFIXES])
        shutil.copy(BASELINE_HANDLER, staging / BASELINE_HANDLER.name)
        command = [archive.archiver(), "--model-name", BASELINE, "--version", "1.0",
                   "--handler", str(staging / BASELINE_HANDLER.name), "--extra-files", str(staging),
                   "--config-file", str(config), "--export-path", str(store), "--force"]
        log(f"packaging baseline: {' '.join(command)}")
        subprocess.run(command, check=True)
    return store / f"{BASELINE}.mar"


def make_texts(words: Sequence[str], workload: str, count: int, rng: random.Random) -> list[str]:
    low, high = WORKLOADS[workload]
    return [" ".join(rng.choices(words, k=rng.randint(low, high))) for _ in range(count)]


def single_token_words(tokenizer: Any) -> list[str]:
    """Whole-word vocabulary entries: each is exactly one token, so a text's length in tokens is known."""
    return sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and 3 <= len(w) <= 10)


class Client:
    """One keep-alive HTTP/1.1 connection; reconnects once if the server closed it."""

    def __init__(self, url: str, key: str, timeout: float = 120):
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, payload, _ = self.exchange(path, body)
        return status, payload

    def exchange(self, path: str, body: bytes) -> tuple[int, bytes, http.client.HTTPMessage]:
        """POST ``body``: (status, payload, the response's headers)."""
        for attempt in (0, 1):
            try:
                self.conn.request("POST", path, body=body, headers=self.headers)
                response = self.conn.getresponse()
                return response.status, response.read(), response.headers
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


EMBEDDING = b'"embedding"'  # in every good answer of every system (TorchServe's and the peers' /embeddings)


def text_bodies(texts: Sequence[str]) -> list[dict[str, str]]:
    return [{"text": text} for text in texts]


@dataclass(frozen=True)
class Target:
    """One system under load, a TorchServe archive or a peer server: every cell sends each the same texts."""

    name: str  # the CSV's "model" column
    url: str
    key: str
    path: str
    body: Callable[[str], Any]  # one text -> the JSON request body

    @property
    def label(self) -> str:
        return label(self.name)


OPENAI_ROW = "+openai"  # the suffix of an --openai row's name


def label(name: str) -> str:
    """The legend's and the table's name of a system: an --extra-archive is "pt2-handlers (NAME)"."""
    if name.endswith(OPENAI_ROW):
        return f"{label(name.removesuffix(OPENAI_ROW))} via OpenAI's SDK (base64)"
    return LABELS.get(name, f"pt2-handlers ({name})")


def archive_target(server: torchserve.Server, model: str) -> Target:
    return Target(model, server.inference_url, server.key("inference") or "", f"/predictions/{model}",
                  lambda text: {"text": text})


def openai_target(server: torchserve.Server, model: str) -> Target:
    """``model`` as OpenAI's SDK calls it (handlers/tasks/embeddings.py): its default body, answered in base64."""
    status, raw = server.management("GET", f"/models/{model}")
    if status != 200:
        raise RuntimeError(f"describe {model}: {status} {raw[:200]!r}")
    version = json.loads(raw)[0]["modelVersion"]
    return Target(model + OPENAI_ROW, server.inference_url, server.key("inference") or "",
                  f"/predictions/{model}/{version}/v1/embeddings",
                  lambda text: {"input": text, "model": model, "encoding_format": "base64"})


def openai_peer_target(peer: Target) -> Target:
    """A peer as OpenAI's SDK calls it: its own body, answered in base64 (Infinity serves OpenAI's encoding_format)."""
    return Target(peer.name + OPENAI_ROW, peer.url, peer.key, peer.path,
                  lambda text: {**peer.body(text), "encoding_format": "base64"})


def peer_target(peer: peers.InfinityPeer) -> Target:
    return Target(peer.name, peer.url, peer.key, peer.path, peer.body)


def send_all(server: torchserve.Server, model: str, bodies: Sequence[Any], concurrency: int,
             answer_has: bytes = b"") -> dict[str, Any]:
    """POST every JSON body to ``model`` from ``concurrency`` clients; latencies (ms), errors and wall seconds.
    A 200 counts only if its payload contains ``answer_has``."""
    return send_bodies(server.inference_url, server.key("inference") or "", f"/predictions/{model}", bodies,
                       concurrency, answer_has)


def send_texts(target: Target, texts: Sequence[str], concurrency: int) -> dict[str, Any]:
    return send_bodies(target.url, target.key, target.path, [target.body(text) for text in texts], concurrency,
                       EMBEDDING)


def send_bodies(url: str, key: str, path: str, bodies: Sequence[Any], concurrency: int,
                answer_has: bytes = b"") -> dict[str, Any]:
    jobs: queue.Queue[bytes] = queue.Queue()
    for body in bodies:
        jobs.put(json.dumps(body).encode())
    latencies: list[float] = []
    errors: list[str] = []

    def client_loop() -> None:
        client = Client(url, key)
        try:
            while True:
                try:
                    body = jobs.get_nowait()
                except queue.Empty:
                    return
                started = time.perf_counter()
                try:
                    status, payload = client.post(path, body)
                except OSError as exc:  # http.client errors after the retry, timeouts, refused
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if status == 200 and answer_has in payload:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    errors.append(f"HTTP {status}: {payload[:200].decode(errors='replace')}")
        finally:
            client.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(client_loop) for _ in range(concurrency)]:
            future.result()
    return {"latencies": latencies, "errors": errors, "seconds": time.perf_counter() - started}


def run_cell(targets: Sequence[Target], texts: list[str], concurrency: int, rounds: int,
             settle: int = 0) -> dict[str, dict[str, Any]]:
    """Every target, same texts, ``rounds`` rounds alternating the order (forward, reversed); merged per target.
    Each target's share of a round follows ``settle`` untimed requests of its first texts, one at a time (their
    errors count)."""
    merged = {target.name: {"latencies": [], "errors": [], "seconds": 0.0} for target in targets}
    per_round = math.ceil(len(texts) / rounds)
    for index in range(rounds):
        chunk = texts[index * per_round:(index + 1) * per_round]
        for target in (targets if index % 2 == 0 else targets[::-1]):
            if settle:
                merged[target.name]["errors"] += send_texts(target, chunk[:settle], 1)["errors"]
            result = send_texts(target, chunk, concurrency)
            for key in ("latencies", "errors"):
                merged[target.name][key] += result[key]
            merged[target.name]["seconds"] += result["seconds"]
    return merged


def cell_row(workload: str, concurrency: int, model: str, result: dict[str, Any]) -> dict[str, Any]:
    stats = summarize(result["latencies"])
    ok = len(result["latencies"])
    return {"workload": workload, "concurrency": concurrency, "model": model, "requests": ok + len(result["errors"]),
            "ok": ok, "errors": len(result["errors"]), "seconds": round(result["seconds"], 3),
            "throughput_rps": round(ok / result["seconds"], 2) if result["seconds"] else 0.0,
            **{f"{k}_ms": round(v, 2) for k, v in stats.items()}}


def embed(server: torchserve.Server, model: str, text: str) -> list[float]:
    status, raw = server.call("POST", f"{server.inference_url}/predictions/{model}", "inference",
                              json.dumps({"text": text}).encode(), "application/json")
    if status != 200:
        raise RuntimeError(f"{model} answered {status}: {raw[:300].decode(errors='replace')}")
    return json.loads(raw)["embedding"]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def check_agreement(server: torchserve.Server, texts: Sequence[str], tokenizer: Any,
                    model: str = OURS) -> dict[str, Any]:
    """An archive vs the baseline on the same texts (each within 128 tokens, so the baseline truncates nothing)."""
    tokens = max(len(tokenizer(text)["input_ids"]) for text in texts)
    values = [cosine(embed(server, model, text), embed(server, BASELINE, text)) for text in texts]
    result = {"texts": len(texts), "max_tokens": tokens, "min_cosine": round(min(values), 6),
              "ok": min(values) >= MIN_AGREEMENT}
    verdict = "OK" if result["ok"] else f"MISMATCH (below {MIN_AGREEMENT})"
    who = "ours" if model == OURS else model
    log(f"agreement {who} vs baseline: min cosine {min(values):.6f} over {len(texts)} texts "
        f"(longest {tokens} tokens) -- {verdict}")
    return result


def describe_ours(server: torchserve.Server, model: str = OURS) -> dict[str, Any]:
    status, raw = server.management("GET", f"/models/{model}?customized=true")
    if status != 200:
        log(f"describe {model}: HTTP {status}")
        return {}
    meta = json.loads(raw)[0].get("customizedMetadata") or {}
    return json.loads(meta) if isinstance(meta, str) else meta


def print_describe(meta: dict[str, Any], model: str = OURS) -> None:
    opt = meta.get("optimization") or {}
    log(f"{'ours' if model == OURS else model}: state {meta.get('state')}, active rung {opt.get('active')}, "
        f"dtype {opt.get('dtype')} ({opt.get('dtype_reason')}), threads {opt.get('threads')}, "
        f"load {meta.get('load_seconds')}s")
    for attempt in opt.get("attempts", []):
        reason = f" -- {attempt['reason']}" if attempt.get("reason") else ""
        log(f"  rung {attempt['rung']:<13} {attempt['status']:<9} {attempt['seconds']:>7.1f}s{reason}")


def archive_names(args: argparse.Namespace) -> list[str]:
    """Every archive TorchServe serves here, ours first and the baseline last."""
    return [OURS, *(name for name, _, _ in args.extra_archive), BASELINE]


def untimed_texts(words: Sequence[str], args: argparse.Namespace) -> tuple[list[str], list[str], random.Random]:
    """The agreement sample and the warm-up texts, and the generator the timed texts then come from (seed 0)."""
    rng = random.Random(0)
    sample = [text for name in args.workloads for text in make_texts(words, name, 4, rng)]
    warm = [text for name in args.workloads for text in make_texts(words, name, args.warmup, rng)]
    return sample, warm, rng


def bench(server: torchserve.Server, args: argparse.Namespace, tokenizer: Any,
          peer_targets: Sequence[Target] = ()) -> tuple[list[dict[str, Any]], dict]:
    # Ours: this process (the peers are its children) and the TorchServe started here (its frontend is the only
    # process given our work dir).
    roots = {os.getpid(), *pids_with_arg(str(server.run_dir.parent))}
    words = single_token_words(tokenizer)
    sample, warm, rng = untimed_texts(words, args)
    archives = archive_names(args)
    targets = [*(archive_target(server, name) for name in archives),
               *(openai_target(server, name) for name in args.openai if name in archives), *peer_targets,
               *(openai_peer_target(peer) for peer in peer_targets if peer.name in args.openai)]
    for target in targets:
        result = send_texts(target, warm, min(4, max(args.concurrency)))
        log(f"warm-up {target.name}: {len(result['latencies'])} ok, {len(result['errors'])} errors")
    agreement = check_agreement(server, sample, tokenizer)
    if len(archives) > 2:
        agreement["archives"] = {name: check_agreement(server, sample, tokenizer, name) for name in archives[1:-1]}
    rows = []
    for workload in args.workloads:
        for concurrency in args.concurrency:
            texts = make_texts(words, workload, args.requests, rng)
            with OtherCpu(roots) as other:
                merged = run_cell(targets, texts, concurrency, args.rounds, args.settle)
            cell = [{**cell_row(workload, concurrency, target.name, merged[target.name]),
                     "other_cpu_pct": other.percent} for target in targets]
            add_ratio(cell)
            rows += cell
            log_cell(cell, merged)
    return rows, agreement


def add_ratio(cell: list[dict[str, Any]]) -> None:
    """Each row's throughput over the baseline's in the same cell; every row also keeps ours / baseline."""
    by = {row["model"]: row for row in cell}
    base = by[BASELINE]["throughput_rps"]
    for row in cell:
        row["throughput_vs_baseline"] = round(row["throughput_rps"] / base, 3) if base else math.nan
        row["throughput_ours_over_baseline"] = round(by[OURS]["throughput_rps"] / base, 3) if base else math.nan


def log_cell(cell: list[dict[str, Any]], merged: dict[str, dict[str, Any]]) -> None:
    width = max(8, *(len(row["model"]) for row in cell))
    for row in cell:
        log(f"{row['workload']:>7} c={row['concurrency']:<3} {row['model']:>{width}}: {row['throughput_rps']:7.1f} "
            f"req/s ({row['throughput_vs_baseline']:.2f}x)  p50 {row['p50_ms']:7.1f}  p90 {row['p90_ms']:7.1f}  "
            f"p99 {row['p99_ms']:7.1f} ms  {row['ok']} ok / {row['errors']} errors")
        if merged[row["model"]]["errors"]:
            log(f"  first error: {merged[row['model']]['errors'][0]}")
    other = cell[0]["other_cpu_pct"]
    note = f"; other processes used {other}% of the CPU meanwhile" if other is not None else ""
    log(f"        ours / baseline throughput: {cell[0]['throughput_ours_over_baseline']:.2f}x{note}")


def report(rows: list[dict[str, Any]], out: Path, data: dict[str, Any]) -> str:
    """One table row per system and cell, in the order they were timed (ours, extra archives, baseline, peers)."""
    cells = list(dict.fromkeys((row["workload"], row["concurrency"]) for row in rows))
    systems = list(dict.fromkeys(row["model"] for row in rows))
    by = {(row["workload"], row["concurrency"], row["model"]): row for row in rows}
    table_rows = []
    for workload, concurrency in cells:
        for system in systems:
            row = by[(workload, concurrency, system)]
            table_rows.append([workload, concurrency, label(system), f"{row['throughput_rps']:.1f}",
                               f"{row['throughput_vs_baseline']:.2f}x", f"{row['p50_ms']:.1f} / {row['p99_ms']:.1f}",
                               row["errors"], _or_dash(row["other_cpu_pct"])])
    table = markdown_table(["workload", "concurrency", "system", "req/s", "vs baseline", "p50 / p99 ms", "errors",
                            "other CPU %"], table_rows)
    checks = check_table(data)
    write_csv(out.with_suffix(".csv"), rows)
    write_json(out.with_suffix(".json"), {**data, "rows": rows})
    out.with_suffix(".md").write_text(table + "\n" + (f"\n{checks}\n" if checks else ""))
    labels = [f"{w} c={c}" for w, c in cells]
    panels = [(metric, {label(system): [by[(w, c, system)][key] for w, c in cells] for system in systems})
              for metric, key in (("throughput (req/s)", "throughput_rps"), ("p99 latency (ms)", "p99_ms"))]
    title = "MiniLM embeddings, same load: pt2-handlers vs eager baseline" + (", peers" if data.get("peers") else "")
    write_plot(out.with_suffix(".png"), title, labels, panels)
    return table + (f"\n\n{checks}" if checks else "")


def check_table(data: dict[str, Any]) -> str:
    """The peers' answer checks and start-up times (empty without peers)."""
    info = data.get("peers") or {}
    checks = info.get("checks") or {}
    if not checks:
        return ""
    rows = [[label(name), check["reference"], f"{check['min_cosine']:.8f}",
             "timed" if check["ok"] else f"REFUSED (< {peers.MIN_COSINE})",
             _or_dash((info.get(name) or {}).get("startup_seconds"))] for name, check in checks.items()]
    return markdown_table(["peer", "answers checked against", "min cosine", "row", "startup s"], rows)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def start_server(args: argparse.Namespace, work: Path, model_dir: Path) -> torchserve.Server:
    store = work / "model_store"
    archive.build(OURS, model_dir, args.config.resolve(), store)
    for name, config, _ in args.extra_archive:
        archive.build(name, model_dir, config, store)
    package_baseline(model_dir, store, baseline_yaml(args.config, work))
    if args.cold_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    started = time.monotonic()
    names = archive_names(args)
    config = torchserve.shifted_config(work, args.port_shift, extra=args.server_set)
    server = torchserve.start(config, store, [f"{m}={m}.mar" for m in names], work / "run", args.timeout,
                              every_worker=True)
    log(f"TorchServe READY with {len(names)} models ({', '.join(names)}) in {time.monotonic() - started:.0f}s")
    for name, workers in args.scale:
        started = time.monotonic()
        management.scale(server, name, workers, workers, wait=True, timeout=args.timeout)
        log(f"{name}: scaled to {workers} workers through the management API in {time.monotonic() - started:.0f}s")
    return server


def start_peers(args: argparse.Namespace, work: Path, model_dir: Path,
                tokenizer: Any) -> tuple[list[peers.InfinityPeer], list[Target], dict[str, Any]]:
    """Before TorchServe (a quiet machine for their start-up times, and a failure costs no compile): start the
    asked-for peers, check their answers on the texts the run checks and warms up with, and keep those that agree.
    Returns every started peer (to stop), the targets to time and what was found."""
    if not args.peers:
        return [], [], {}
    names = list(dict.fromkeys(args.peers))
    started, info = peers.start_peers(names, model_dir, work / "peers", args.peer_batch_size, args.peer_timeout)
    try:
        sample, warm, _ = untimed_texts(single_token_words(tokenizer), args)
        texts = sample + warm
        log(f"checking the peers' answers on {len(texts)} texts ({', '.join(args.workloads)})")
        reference, reference_name = peers.reference_embeddings(model_dir, texts)
        info["checks"] = peers.check_peers(started, texts, reference, reference_name)
    except BaseException:
        peers.stop_peers(started)
        raise
    refused = [peer for peer in started if not info["checks"][peer.name]["ok"]]
    peers.stop_peers(refused)
    timed = [peer_target(peer) for peer in started if peer not in refused]
    return started, timed, info


def show_log_tail(run_dir: Path, lines: int = 30) -> None:
    log_file = run_dir / "logs" / "model_log.log"
    if log_file.is_file():
        log(f"last {lines} lines of {log_file}:")
        print("\n".join(log_file.read_text(errors="replace").splitlines()[-lines:]), flush=True)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    import yaml

    model_dir = archive.default_model_dir()
    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    args.config = overridden_config(args.config, args.set, work)
    args.extra_archive = [(name, overridden_config(config, settings, work, name), settings)
                          for name, config, settings in args.extra_archive]
    header = run_header(args, {"work_dir": str(work), "model_yaml": yaml.safe_load(args.config.read_text()),
                               "baseline_yaml": yaml.safe_load(baseline_yaml(args.config, work).read_text()),
                               "extra_archive_yaml": {name: yaml.safe_load(config.read_text())
                                                      for name, config, _ in args.extra_archive}})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    started_peers: list[peers.InfinityPeer] = []
    try:
        started_peers, peer_targets, peer_info = start_peers(args, work, model_dir, tokenizer)
        server = start_server(args, work, model_dir)
        described = {name: describe_ours(server, name) for name in archive_names(args)[:-1]}
        for name, meta in described.items():
            print_describe(meta, name)
        rows, agreement = bench(server, args, tokenizer, peer_targets)
        after = describe_ours(server)
        runtime = (after.get("optimization") or {}).get("runtime")
        log(f"ours after the run: batches {after.get('batches')}, runtime {runtime}")
    except BaseException:
        show_log_tail(work / "run")
        raise
    finally:
        peers.stop_peers(started_peers)
        if (work / "run").is_dir():  # absent when packaging failed: nothing was started
            torchserve.stop(work / "run")
            log(f"stopped TorchServe; its logs stay in {work / 'run' / 'logs'}")
        # The archives and their unpacked copies (~150 MB); the keys of a stopped server are no use to anyone.
        for path in (work / "model_store", work / "run" / "tmp", work / "peers" / "infinity-onnx-model"):
            shutil.rmtree(path, ignore_errors=True)
        (work / "run" / "key_file.json").unlink(missing_ok=True)
    data = {**header, "agreement": agreement, "described": described, "describe_after": after}
    if peer_info:
        data["peers"] = peer_info
    table = report(rows, args.out, data)
    log("throughput and latency per cell (ours = pt2-handlers, model 'minilm'):")
    print(table, flush=True)


if __name__ == "__main__":
    main()
