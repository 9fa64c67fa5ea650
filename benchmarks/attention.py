"""One attention call, side by side: the handler's fused kernel as compiled graphs call it, the same kernel held to
its AVX-512 path, and PyTorch's SDPA, on MiniLM's heads (12 x 32) at the benchmark shapes.

    .venv/bin/python -m benchmarks.attention --out bench_results/attention

Why: on a CPU with AMX the kernel runs its two products on AMX tiles (handlers/cpu/fused_attention.cpp); this shows what
that buys per call against its AVX-512 path and SDPA, with bf16 values (the bf16 rungs) and float32 values (the int8
rung keeps some value projections in float32). The paths take turns, ``--rounds`` times, and each cell is the fastest
of its blocks (a busy machine only adds time). Where the CPU has no AMX, the first two are one path.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import DEFAULT_OUT, OtherCpu, log, markdown_table, run_header, write_csv, write_json, write_plot

HEADS, HEAD_SIZE = 12, 32  # MiniLM-L6
PATHS = ("fused (as called)", "fused, AVX-512 path", "sdpa")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--calls", type=int, default=10, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=15, help="blocks per path and shape, taking turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "attention")
    return parser.parse_args()


def heads(batch: int, length: int, dtype: Any, seed: int) -> Any:
    """[batch, heads, length, size] as a linear layer's output viewed per head (strided, as in the model)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(batch, length, HEADS * HEAD_SIZE, generator=generator).to(dtype)
    return flat.view(batch, length, HEADS, HEAD_SIZE).transpose(1, 2)


def main() -> None:
    args = parse_args()
    import torch

    from handlers.cpu import fused_attention

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-attention-") as build_dir:
        if problem := fused_attention.load(Path(build_dir)):
            raise SystemExit(f"the fused kernel cannot run here: {problem}")
    header = run_header(args, {"instructions": torch.ops.pt2_handlers.fused_attention_isa()})
    rows = []
    with torch.inference_mode(), OtherCpu() as other:
        for batch in args.batch_sizes:
            for length in args.seq_lengths:
                for values in ("bf16", "float32"):
                    best = fastest_calls(batch, length, values, args)
                    shape = f"b{batch}xL{length}"
                    rows += [{"shape": shape, "values": values, "path": path, "ms": round(ms, 4)}
                             for path, ms in best.items()]
                    log(f"{shape} {values} values: " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in best.items()))
    if other.percent is not None:
        log(f"other processes used {other.percent}% of the CPU meanwhile")
    report(rows, args, header)


def fastest_calls(batch: int, length: int, values: str, args: argparse.Namespace) -> dict[str, float]:
    """Each path's fastest ms per call at one shape, the paths taking turns ``args.rounds`` times (SDPA with bf16
    values only: it takes one dtype)."""
    import torch

    q, k = heads(batch, length, torch.bfloat16, 1), heads(batch, length, torch.bfloat16, 2)
    v = heads(batch, length, torch.bfloat16 if values == "bf16" else torch.float32, 3)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[-1, ..., length // 2:] = False  # one padded text, as a batch of mixed lengths has
    scale = HEAD_SIZE ** -0.5
    calls = {PATHS[0]: lambda: torch.ops.pt2_handlers.fused_attention(q, k, v, mask, scale),
             PATHS[1]: lambda: torch.ops.pt2_handlers.fused_attention_avx512(q, k, v, mask, scale)}
    if values == "bf16":
        calls[PATHS[2]] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                   scale=scale)
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.rounds):
        for path, call in calls.items():
            call()
            started = time.perf_counter()
            for _ in range(args.calls):
                call()
            best[path] = min(best[path], (time.perf_counter() - started) / args.calls * 1000)
    return best


def report(rows: list[dict[str, Any]], args: argparse.Namespace, header: dict[str, Any]) -> None:
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    series = list(dict.fromkeys(f"{row['path']}, {row['values']} values" for row in rows))
    cell = {(f"{row['path']}, {row['values']} values", row["shape"]): row["ms"] for row in rows}
    table = markdown_table(["path", *[f"{s} ms" for s in shapes]],
                           [[name, *[f"{cell[(name, s)]:.3f}" if (name, s) in cell else "-" for s in shapes]]
                            for name in series])
    write_csv(args.out.with_suffix(".csv"), rows)
    write_json(args.out.with_suffix(".json"), {**header, "rows": rows})
    args.out.with_suffix(".md").write_text(table + "\n")
    write_plot(args.out.with_suffix(".png"),
               f"one attention call, {HEADS} heads x {HEAD_SIZE} ({header['instructions']}, {args.threads} threads)",
               shapes, [("fastest ms per call", {name: [cell.get((name, s), 0.0) for s in shapes]
                                                 for name in series})])
    print(table)


if __name__ == "__main__":
    main()
