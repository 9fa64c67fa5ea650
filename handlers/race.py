"""Which proven forward is faster here: each timed on the warmup batches at load, interleaved.

The ladder races a precision that trades answers for speed (int8) against the next precision that keeps them,
on the same rung: whether int8 pays depends on the CPU (on AMX tiles bf16 matmuls can outrun int8's, whose
per-token quantization and float layers cost more than its faster matmuls save) and on the shapes served.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Timed calls per forward and batch. Each forward counts its fastest call: a busy machine (a neighbour compiling
# at load) only ever adds time, so the fastest call is the one least disturbed; a median of 5 was tipped by it.
ROUNDS = 5
# How much faster the challenger must be to serve: within noise, the precision with the better answers wins.
MIN_GAIN = 0.05


def forward_ms(forwards: Sequence[Any], batches: Sequence[Any], run: Callable[[Any, Any], Any],
               rounds: int = ROUNDS) -> list[float]:
    """Per forward: the sum over ``batches`` of its fastest call's milliseconds. The forwards take turns on each
    batch, so a slow spell of the machine hits them alike."""
    times: list[list[list[float]]] = [[[] for _ in batches] for _ in forwards]
    with torch.inference_mode():
        for _ in range(rounds):
            for index, batch in enumerate(batches):
                for forward, per_batch in zip(forwards, times, strict=True):
                    started = time.perf_counter()
                    run(forward, batch)
                    per_batch[index].append((time.perf_counter() - started) * 1000)
    return [round(sum(min(calls) for calls in per_batch), 3) for per_batch in times]


def pays(challenger_ms: float, rival_ms: float, min_gain: float = MIN_GAIN) -> bool:
    """Whether the challenger is at least ``min_gain`` faster than its rival."""
    return challenger_ms <= rival_ms * (1 - min_gain)
