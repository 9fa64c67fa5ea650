"""The quality gate: how a task measures an attempt's answers against fp32 eager's, and what the measure read.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Quality:
    """The gate's worst value over the batches it judged (higher is better) and the bar it had to clear; for int8,
    also the worst over the held-out batches alone (``value`` is the worst of all)."""

    metric: str
    value: float
    threshold: float
    held_out: float | None = None

    def to_json(self) -> dict[str, Any]:
        held_out = {} if self.held_out is None else {"held_out": round(self.held_out, 6)}
        return {"metric": self.metric, "value": round(self.value, 6), "threshold": self.threshold, **held_out}


class QualityError(AssertionError):
    """An optimized rung's answers are not those of fp32 eager (the gate's value is below its threshold)."""

    def __init__(self, message: str, quality: Quality | None = None):
        super().__init__(message)
        self.quality = quality


class QualityGate(ABC):
    """A task's acceptance metric on what the client receives, e.g. cosine per embedding row."""

    metric: str
    threshold: float

    @abstractmethod
    def measure(self, actual: Any, expected: Any) -> float:
        """Worst value over the batch (higher is better); QualityError if the outputs cannot be compared."""


def tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output, in order."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, Mapping):  # includes transformers' ModelOutput
        for value in output.values():
            yield from tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from tensors(value)


def detached(output: Any) -> list[torch.Tensor]:
    """A copy of every tensor in ``output``: fp32 eager's answers, kept while other forwards run."""
    return [t.detach().clone() for t in tensors(output)]
