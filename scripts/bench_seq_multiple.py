#!/usr/bin/env python3
"""What rounding dynamic sequence lengths up to a multiple (handlers/config/shapes.py: 16) costs per forward.

Builds the served module once (memory_probe.build_engine: the YAML's ladder, dtype and policy), then times
``Engine.forward_batch`` on batches of exactly ``rows`` x ``length`` tokens, run at the exact length
(``seq_multiple`` 1, as before the rounding) and padded up to each ``--multiples``. The variants run interleaved,
call by call, in one process, so their ratios are fair on a busy machine; absolute times are not.

* fixed shapes (``--shapes``): the first call at each shape is timed alone, exact first (it includes creating
  the matmul kernels for a shape never seen before); steady state is the median of ``--iters`` later calls.
  The defaults include the worst case, a length one past a multiple (17, 33, 49, 65, 129).
* ``--mixed N``: N random shapes drawn like scripts/soak.py's traffic (1-4 rows, 5-100 tokens), all run once
  untimed, then ``--iters`` timed passes; the total time per variant, relative to exact.

  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python scripts/bench_seq_multiple.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS.parent)]

import memory_probe  # noqa: E402

DEFAULT_SHAPES = ("1x17", "1x49", "4x17", "4x33", "2x65", "4x100", "4x129", "4x200", "4x64")


def batch_of(engine, rows: int, length: int) -> dict:
    """``rows`` texts tokenized to exactly ``length`` tokens (no padding: every position real)."""
    encoded = engine._task.tokenize([" ".join(["serving"] * length)] * rows, max_length=length)
    assert encoded["input_ids"].shape == (rows, length), encoded["input_ids"].shape
    return encoded


def timed(engine, policy, batch) -> float:
    engine.shapes = policy
    started = time.perf_counter()
    engine.forward_batch(batch)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=memory_probe.DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None)
    parser.add_argument("--multiples", type=int, nargs="+", default=[16])
    parser.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES), help="rows x length, e.g. 4x33")
    parser.add_argument("--mixed", type=int, default=0, help="also this many random soak-like shapes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.monotonic()
    engine = memory_probe.build_engine(args.config, args.dtype, None)
    print(f"[bench] READY on {engine.active_rung} in {engine.dtype.value.value} after "
          f"{time.monotonic() - started:.0f}s", flush=True)
    policies = [replace(engine.shapes, seq_multiple=m) for m in [1, *args.multiples]]
    names = [f"x{p.seq_multiple}" if p.seq_multiple > 1 else "exact" for p in policies]

    def interleaved(batches: list[dict], iters: int) -> list[list[float]]:
        """Per variant, per batch, ``iters`` times; the variant order rotates every call."""
        times: list[list[float]] = [[] for _ in policies]
        for index in range(iters):
            for batch in batches:
                order = list(range(len(policies)))
                shift = index % len(order)
                for slot in order[shift:] + order[:shift]:
                    times[slot].append(timed(engine, policies[slot], batch))
        return times

    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
        print(f"\n| shape | runs at ({', '.join(names[1:])}) | first call ms ({' / '.join(names)}) | median ms "
              f"({' / '.join(names)}) | {' | '.join(f'{n} / exact' for n in names[1:])} |")
        print("|---" * (4 + len(names) - 1) + "|")
        ratios: list[list[float]] = [[] for _ in policies[1:]]
        for shape in shapes:
            batch = batch_of(engine, *shape)
            first = [timed(engine, policy, batch) for policy in policies]
            medians = [statistics.median(values) for values in interleaved([batch], args.iters)]
            for slot, median in enumerate(medians[1:]):
                ratios[slot].append(median / medians[0])
            print(f"| {shape[0]}x{shape[1]} | {', '.join(str(p.serving_shape(*shape)[1]) for p in policies[1:])} | "
                  f"{' / '.join(f'{ms:.1f}' for ms in first)} | {' / '.join(f'{ms:.2f}' for ms in medians)} | "
                  f"{' | '.join(f'{m / medians[0]:.3f}' for m in medians[1:])} |", flush=True)
        for name, values in zip(names[1:], ratios, strict=True):
            print(f"geometric mean {name} / exact over {len(shapes)} shapes: {statistics.geometric_mean(values):.3f}"
                  f" ({args.iters} interleaved calls each)")
    if args.mixed:
        rng = random.Random(args.seed)
        batches = [batch_of(engine, rng.randint(1, 4), rng.randint(5, 100)) for _ in range(args.mixed)]
        interleaved(batches, 1)  # every shape once, untimed: kernels created
        totals = [sum(values) for values in interleaved(batches, args.iters)]
        print(f"\nmixed: {args.mixed} soak-like shapes x {args.iters} passes, total ms "
              f"{' / '.join(f'{name} {total:.0f}' for name, total in zip(names, totals, strict=True))}; "
              + ", ".join(f"{name} / exact {total / totals[0]:.3f}" for name, total in zip(names[1:], totals[1:],
                                                                                           strict=True)))


if __name__ == "__main__":
    main()
