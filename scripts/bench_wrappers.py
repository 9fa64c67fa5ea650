#!/usr/bin/env python3
"""What wraps every live forward, timed alone: the pieces of a lone request that are neither the model nor
TorchServe, each next to the way it was done before, in interleaved rounds of one run (issue 19, item 2).

    core share        handlers.cpu.core_share: batch() + forward() for a worker alone on its cores (a new file),
                      and beside 15 slots that dead workers left marked (each is probed, every forward)
    freezing flag     inductor's freezing flag around each call of a frozen rung (handlers.rungs): set and put
                      back directly, against torch's ``inductor_config.patch(freezing=True)``
    dynamo counts     the guard's check for compiles after READY (handlers.ladder.guard): the activity key twice,
                      against ``dynamo_counts()`` twice
    stance, inference mode   the guard's fixed costs, for scale

    .venv/bin/python scripts/bench_wrappers.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import DEFAULT_OUT, REPO, log, markdown_table, run_header, write_csv, write_plot

SLOTS_LEFT_MARKED = 15  # a file that many workers' processes used, each gone (a slot's mark outlives its owner)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per piece and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the pieces")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "wrappers", help="CSV/PNG/markdown path stem")
    return parser.parse_args()


def pieces(directory: Path) -> dict[str, Callable[[], None]]:
    """Each piece as a call that does it once, named ``what: how``."""
    from handlers.cpu import core_share

    alone = core_share.CoreShare(2, directory / "alone")
    stale = core_share.CoreShare(2, directory / "stale")
    for slot in range(SLOTS_LEFT_MARKED):  # marked as claimed, their owners gone: unlocked
        os.pwrite(stale._fd, core_share._CLAIMED, core_share._FIRST_SLOT + (slot + 1) * core_share._SLOT_BYTES)
    return {"core share: alone": _share(alone), f"core share: {SLOTS_LEFT_MARKED} dead slots": _share(stale),
            **_guard_pieces()}


def _share(cores: Any) -> Callable[[], None]:
    def once() -> None:
        with cores.batch(), cores.forward((1, 2)):
            pass
    return once


def _guard_pieces() -> dict[str, Callable[[], None]]:
    import torch
    from torch._inductor import config as inductor_config

    from handlers.rungs.dynamo_counts import activity, dynamo_counts

    def flag_direct() -> None:
        if not inductor_config.freezing:
            inductor_config.freezing = True
            inductor_config.freezing = False

    def flag_patch() -> None:
        with inductor_config.patch(freezing=True):
            pass

    def stance() -> None:
        with torch.compiler.set_stance("fail_on_recompile"):
            pass

    def inference_mode() -> None:
        with torch.inference_mode():
            pass

    return {"freezing flag: direct (now)": flag_direct, "freezing flag: config.patch (before)": flag_patch,
            "dynamo counts: activity key x2 (now)": lambda: (activity(), activity()),
            "dynamo counts: full x2 (before)": lambda: (dynamo_counts(), dynamo_counts()),
            "stance: fail_on_recompile": stance, "inference mode": inference_mode}


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    header = run_header(args)
    with tempfile.TemporaryDirectory(prefix="bench-wrappers-") as tmp:
        timed = pieces(Path(tmp))
        took: dict[str, list[float]] = {name: [] for name in timed}
        clock = time.perf_counter
        for round_ in range(args.rounds):
            for name, call in timed.items():
                for _ in range(args.calls // 10):
                    call()
                for _ in range(args.calls):
                    started = clock()
                    call()
                    took[name].append(clock() - started)
            log(f"round {round_ + 1}/{args.rounds} done")
    rows = [{"piece": name, "p50_us": round(statistics.median(values) * 1e6, 2),
             "mean_us": round(statistics.fmean(values) * 1e6, 2)} for name, values in took.items()]
    write_csv(args.out.with_suffix(".csv"), rows)
    write_plot(args.out.with_suffix(".png"), "what wraps a live forward, us per call", [r["piece"] for r in rows],
               [("us per call", {"p50": [r["p50_us"] for r in rows], "mean": [r["mean_us"] for r in rows]})])
    table = markdown_table(["piece", "p50 us", "mean us"], [(r["piece"], r["p50_us"], r["mean_us"]) for r in rows])
    args.out.with_suffix(".md").write_text(f"{header['command']}\n\n{table}\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
