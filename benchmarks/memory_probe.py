"""Does the served module's memory stay flat? The soak's traffic without TorchServe, in one process.

Builds the module a worker serves (handlers.serving.engine.Engine with a model YAML, the ladder and all), then feeds it
batches like the soak's: 1 to 4 texts of 3 to 96 words (random lengths, so nearly every batch has a new
(rows, sequence) shape). It samples this process's VmRSS every ``--sample-every`` batches and prints one line per
sample, with how many distinct run shapes it has seen so far. With --out it writes a CSV.

  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python -m benchmarks.memory_probe --batches 3000
  ... --dtype float32                      # force a dtype over the YAML's
  ... --seq-multiple 1                     # every batch at its exact length (before the rounding: bf16 grows)
  ONEDNN_VERBOSE=1 ... --batches 50 | grep -c 'primitive,create'   # oneDNN primitives created

``--trace`` adds tracemalloc (Python-side allocations) to each line; it slows the run down.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import random
import time
from pathlib import Path

from benchmarks.harness import REPO

WORDS = ("serving compile graph kernel batch token model worker cache tensor queue latency python torch inference "
         "request answer embedding sentence vector cat dog tea train music weather river city garden").split()
DEFAULT_CONFIG = REPO / "model_configs" / "minilm-embeddings.yaml"


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_detail() -> str:
    """glibc malloc: bytes in use, free inside the heap (fragmentation), in mmapped chunks; and executable
    anonymous mappings (JIT code: oneDNN kernels)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    jit_kb = jit_maps = 0
    current_exec = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            current_exec = "x" in fields[1] and len(fields) == 5  # anonymous (no path) and executable
            jit_maps += current_exec
        elif current_exec and fields[0] == "Rss:":
            jit_kb += int(fields[1])
    mb = 2**20
    return (f"malloc in use {info.uordblks / mb:.0f} MB, free in heap {info.fordblks / mb:.0f} MB, "
            f"mmapped {info.hblkhd / mb:.0f} MB, exec anon maps {jit_maps} ({jit_kb / 1024:.0f} MB)")


def build_engine(config: Path, dtype: str | None, model_dir: Path | None, seq_multiple: int | None = None):
    """An Engine loaded from ``config``, serving ``model_dir`` (default: the embedded MiniLM); ``seq_multiple``
    over the shape policy's (1: each batch at its exact length, as before the rounding)."""
    from dataclasses import replace

    import torch
    import yaml

    from handlers.config import load_config
    from handlers.serving.engine import Engine

    raw = yaml.safe_load(config.read_text())
    settings = raw.setdefault("pt2_handlers", {})
    if dtype:
        settings["dtype"] = dtype
    if model_dir is None:
        from handlers.serving import archive

        model_dir = archive.default_model_dir()
    model_dir = model_dir.resolve()
    settings["model_dir"] = model_dir.name  # the archive's layout: the model directory inside the model root
    handler_config = load_config(raw)
    if seq_multiple is not None:
        shapes = replace(handler_config.settings.shapes, seq_multiple=seq_multiple)
        handler_config = replace(handler_config, settings=replace(handler_config.settings, shapes=shapes))
    engine = Engine(handler_config, model_dir.parent, torch.device("cpu"), "probe")
    engine.load()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None, help="over the YAML's")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--seq-multiple", type=int, default=None,
                        help="over the shape policy's (1: every batch at its exact length, as before the fix)")
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=50, help="batches before the first sample counts as the base")
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true", help="tracemalloc: Python allocations per sample")
    parser.add_argument("--heap", action="store_true", help="glibc malloc figures and JIT code mappings")
    parser.add_argument("--out", type=Path, default=None, help="CSV of the samples")
    args = parser.parse_args()

    started = time.monotonic()
    engine = build_engine(args.config, args.dtype, args.model_dir, args.seq_multiple)
    print(f"[probe] READY on {engine.active_rung} in {engine.dtype.value.value} after {time.monotonic() - started:.0f}s"
          f", shapes {engine.shapes.describe()}, RSS {rss_mb():.0f} MB", flush=True)
    if args.trace:
        import tracemalloc

        tracemalloc.start(1)
    rng = random.Random(args.seed)
    shapes: set[tuple[int, int]] = set()
    rows_out = []
    base = None
    started = time.monotonic()
    for index in range(1, args.batches + 1):
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 96))) for _ in range(rng.randint(1, 4))]
        encoded = engine.task.preprocess([engine.task.parse({"inputs": texts})])
        rows, seq = encoded.inputs["input_ids"].shape
        shapes.add(engine.shapes.serving_shape(rows, seq))
        engine.forward_batch(encoded.inputs)
        if index == args.warmup:
            base = rss_mb()
        if index % args.sample_every == 0 or index == args.batches:
            now = rss_mb()
            python = ""
            if args.trace:
                current, _ = tracemalloc.get_traced_memory()
                python = f", python {current / 2**20:.1f} MB"
            if args.heap:
                python += f", {heap_detail()}"
            row = {"batch": index, "seconds": round(time.monotonic() - started, 1), "rss_mb": round(now, 1),
                   "distinct_shapes": len(shapes)}
            rows_out.append(row)
            growth = f", {((now - base) / base):+.1%} since batch {args.warmup}" if base else ""
            print(f"[probe] batch {index}: RSS {now:.0f} MB{growth}, {len(shapes)} distinct run shapes, "
                  f"{index / (time.monotonic() - started):.1f} batches/s{python}", flush=True)
    print(f"[probe] after READY: {engine.runtime_counters()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            writer.writeheader()
            writer.writerows(rows_out)
        print(f"[probe] wrote {args.out}")


if __name__ == "__main__":
    main()
