"""Small batches to the rung that is faster on them: a race of two rungs read per warmup batch.

Two rungs that both pass the gate need not be faster at every shape: on an Intel Xeon with AMX, OpenVINO ran MiniLM's
lone 16-token text 16 % faster than the tuned compile, and 8 texts of 128 tokens 25 % slower. A race sums its warmup
batches, so the large ones decide it. ``split`` reads the race per batch instead: where the rung that lost the sum is
faster on the smallest batches, batches up to the largest of those (in elements of the first input: rows x tokens for
text) go to it, the rest to the winner (``Routed``).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def size_of(batch: Mapping[str, torch.Tensor]) -> int:
    """What a batch's route is chosen by: its first input's elements (rows x tokens for text)."""
    first = next(iter(batch.values()), None)
    return int(first.numel()) if isinstance(first, torch.Tensor) else 0


def split(loser_ms: Sequence[float], winner_ms: Sequence[float], sizes: Sequence[int], min_gain: float) -> int | None:
    """The largest batch size up to which the loser of a race serves: the smallest sizes, in order, at each of which
    it is at least ``min_gain`` faster than the winner on every batch of that size. None where it is not at the
    smallest size."""
    up_to = None
    for size in sorted(set(sizes)):
        batches = [(loser, winner) for loser, winner, each in zip(loser_ms, winner_ms, sizes, strict=True)
                   if each == size]
        if not all(loser <= winner * (1 - min_gain) for loser, winner in batches):
            break
        up_to = size
    return up_to


def sizes_of(batches: Sequence[Any]) -> list[int] | None:
    """Each warmup batch's size, or None where a batch is not named tensors (no route can be chosen)."""
    if not all(isinstance(batch, Mapping) for batch in batches):
        return None
    return [size_of(batch) for batch in batches]


class Routed:
    """Batches of at most ``up_to`` elements (``size_of``) run ``small``, the others ``large``."""

    def __init__(self, small: Any, large: Any, up_to: int):
        self.small = small
        self.large = large
        self.up_to = up_to

    def __call__(self, **inputs: torch.Tensor) -> Any:
        return (self.small if size_of(inputs) <= self.up_to else self.large)(**inputs)
