"""Load time of model YAMLs through the engine (no TorchServe), cold compile cache, this checkout against another.

Each load runs in its own process with an empty inductor cache, so every compile is cold, as on a new host. With
``--baseline DIR`` (a checkout of an older commit, e.g. ``git worktree add /tmp/before 584e164``) the same YAMLs
load with that checkout's ``handlers`` too, interleaved round by round, so the two are compared on the same
machine state. Prints progress, the ladder attempts of each load, and writes CSV + PNG.

    .venv/bin/python -m tests.tiny_models minilm-ner minilm-qa
    .venv/bin/python -m benchmarks.load --model minilm-ner=model_configs/minilm-token-classification.yaml \\
        --model minilm-qa=model_configs/minilm-question-answering.yaml --baseline /tmp/before --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REPO
from tests import tiny_models

# Runs in the child, with the checkout under test first on sys.path (PYTHONPATH, and its directory): prints one JSON
# line.
LOAD = """
import json, sys, time, yaml, torch
from pathlib import Path
from handlers.config import load_config
from handlers.serving.engine import Engine
raw = yaml.safe_load(Path(sys.argv[1]).read_text())
raw.setdefault("pt2_handlers", {})["model_dir"] = sys.argv[2]
engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), "bench-load")
engine.load()
optimization = engine.describe()["optimization"]
print("RESULT " + json.dumps({"load_seconds": engine.load_seconds, "active": optimization["active"],
                              "dtype": optimization["dtype"], "attempts": optimization["attempts"]}))
"""


def load_once(src: Path, config: Path, model_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-load-cache-") as cache:
        env = {**os.environ, "PYTHONPATH": str(src), "TORCHINDUCTOR_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run([sys.executable, "-c", LOAD, str(config), str(model_dir)], env=env, cwd=src,
                              capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"load of {config} with {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def attempts_text(attempts: list[dict[str, Any]]) -> str:
    return ", ".join(f"{a['rung']}{' (screen)' if a.get('screen') else ''} {a.get('dtype')} {a['status']} "
                     f"{a['seconds']:.1f}s" for a in attempts)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=YAML",
                        help="a tests/tiny_models.py model (or minilm) and its model YAML; repeat")
    parser.add_argument("--baseline", type=Path, help="another checkout whose handlers load the same YAMLs")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "load")
    args = parser.parse_args()
    header = harness.run_header(args)
    sources = {"this checkout": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rows = []
    for round_index in range(args.rounds):
        for spec in args.model:
            name, _, config = spec.partition("=")
            model_dir = tiny_models.minilm_dir() if name == "minilm" else tiny_models.build(name)
            for label, src in sources.items():
                harness.log(f"round {round_index + 1}/{args.rounds}: {name} with {label} ...")
                result = load_once(src, (REPO / config).resolve(), model_dir)
                harness.log(f"  READY in {result['load_seconds']:.1f}s on {result['active']} ({result['dtype']}): "
                       f"{attempts_text(result['attempts'])}")
                rows.append({"round": round_index + 1, "model": name, "code": label,
                             "load_seconds": result["load_seconds"], "active": result["active"],
                             "dtype": result["dtype"], "attempts": attempts_text(result["attempts"])})
    args.out.mkdir(parents=True, exist_ok=True)
    harness.write_json(args.out / "header.json", header)
    harness.write_csv(args.out / "load.csv", rows)
    names = list(dict.fromkeys(row["model"] for row in rows))
    series = {label: [min(r["load_seconds"] for r in rows if r["model"] == n and r["code"] == label) for n in names]
              for label in sources}
    harness.write_plot(args.out / "load.png", "cold load, empty compile cache (best of rounds)", names,
                  [("seconds to READY", series)])
    print(harness.markdown_table(["model", "code", "load s", "serves", "attempts"],
                            [[r["model"], r["code"], r["load_seconds"], f"{r['active']} ({r['dtype']})",
                              r["attempts"]] for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
