"""Each batch shape to the rung that is faster at it: a race of two rungs read per warmup batch.

Two rungs that both pass the gate need not be faster at every shape: on an Intel Xeon with AMX, OpenVINO ran MiniLM's
lone 16-token text and 8 texts of 64 tokens 10-22 % faster than the tuned compile, and 8 texts of 256 tokens 20 %
slower. A race sums its warmup batches, so the large ones decide it. ``split`` reads the race per batch instead:
the warmup shapes where the loser of the sum was at least the race's margin faster go to it (``Routed``), a live
batch taking the route of the warmup shape nearest its own (the first input's shape, compared on a log scale: rows x
tokens for text), the winner's where two are as near.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Shape = tuple[int, ...]


def shape_of(batch: Mapping[str, Any]) -> Shape | None:
    """What a batch's route is chosen by: its first input's shape (rows x tokens for text); None if not a tensor."""
    first = next(iter(batch.values()), None)
    return tuple(first.shape) if isinstance(first, torch.Tensor) else None


def shapes_of(batches: Sequence[Any]) -> list[Shape] | None:
    """Each warmup batch's shape, or None where a batch is not named tensors (no route can be chosen)."""
    shapes = [shape_of(batch) if isinstance(batch, Mapping) else None for batch in batches]
    return None if any(shape is None for shape in shapes) else shapes  # type: ignore[return-value]


def split(loser_ms: Sequence[float], winner_ms: Sequence[float], shapes: Sequence[Shape],
          min_gain: float) -> list[Shape] | None:
    """The warmup shapes the loser of a race serves: those where it was at least ``min_gain`` faster than the winner
    on every batch of that shape. None where there is none, or where it would serve every shape (then it would have
    won the race)."""
    faster: dict[Shape, bool] = {}
    for loser, winner, shape in zip(loser_ms, winner_ms, shapes, strict=True):
        faster[shape] = faster.get(shape, True) and loser <= winner * (1 - min_gain)
    served = [shape for shape, wins in faster.items() if wins]
    return served if served and len(served) < len(faster) else None


class Routed:
    """Batches whose shape is nearest one of ``small_shapes`` (the loser's) run ``loser``; the others, and those as
    near a shape of each, run ``winner``. ``shapes``: every warmup shape."""

    def __init__(self, loser: Any, winner: Any, loser_shapes: Sequence[Shape], shapes: Sequence[Shape],
                 switching_to: Mapping[str, Callable[[], Any]] | None = None):
        self.loser = loser
        self.winner = winner
        self.loser_shapes = frozenset(loser_shapes)
        self.shapes = sorted(set(shapes))
        # called when a batch goes to "loser" or "winner" after one went to the other (e.g. torch's OpenMP threads
        # ended before OpenVINO's run: they spin on the cores for a while after the compiled forward)
        self.switching_to = dict(switching_to or {})
        self._route: dict[Shape | None, str] = {}
        self._last: str | None = None

    def __call__(self, **inputs: torch.Tensor) -> Any:
        shape = shape_of(inputs)
        side = self._route.get(shape)
        if side is None:
            side = self._route[shape] = "loser" if self.nearest_is_losers(shape) else "winner"
        if side != self._last:
            if self._last is not None and side in self.switching_to:
                self.switching_to[side]()
            self._last = side
        return (self.loser if side == "loser" else self.winner)(**inputs)

    def nearest_is_losers(self, shape: Shape | None) -> bool:
        """Whether every warmup shape nearest ``shape`` is one the loser serves."""
        if shape is None:
            return False
        distances = {known: _distance(shape, known) for known in self.shapes}
        if not distances or math.isinf(min(distances.values())):
            return False
        nearest = min(distances.values())
        return all(known in self.loser_shapes for known, distance in distances.items()
                   if math.isclose(distance, nearest))

    def describe(self) -> list[str]:
        return ["x".join(map(str, shape)) for shape in sorted(self.loser_shapes)]


def _distance(shape: Shape, known: Shape) -> float:
    """How far two shapes are apart on a log scale (a batch of 8 is as far from 4 as from 16); infinite where their
    ranks differ."""
    if len(shape) != len(known):
        return math.inf
    return math.sqrt(sum((math.log2(max(a, 1)) - math.log2(max(b, 1))) ** 2 for a, b in zip(shape, known, strict=True)))
