"""What the ladder is given besides the rungs: the warmup that proves every attempt, the precisions to try, and the
place the load runs (the decisions kept there, the machine, the thread counts a forward may be given).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.config import DType
from handlers.ladder.decisions import DecisionStore
from handlers.ladder.gate import QualityGate
from handlers.precision.quantize import Int8Weights

Batch = Mapping[str, torch.Tensor]
Run = Callable[[Callable[..., Any], Any], Any]  # runs one warmup batch through a forward


def call(forward: Callable[..., Any], batch: Batch) -> Any:
    """The default ``Run``: the forward called with the batch's tensors as keyword arguments."""
    return forward(**batch)


@dataclass(frozen=True)
class Warmup:
    """What every attempt is proven on: the warmup ``batches`` (at least one), how one of them runs through a forward
    (``run``: generation runs a decode loop instead of one call), and the task's gate for each precision."""

    batches: Sequence[Any]
    gate: Callable[[DType], QualityGate]
    run: Run = call

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("the ladder needs at least one warmup batch to prove a rung")


@dataclass(frozen=True)
class Calibration:
    """What int8 is calibrated on (``batches``) and judged on besides the warmup batches (``held_out``, at the
    warmup shapes): different texts, so the gate measures int8 on what its calibration did not see. ``source`` and
    ``held_out_source`` say where each came from (describe)."""

    batches: Sequence[Any]
    held_out: Sequence[Any]
    source: str
    held_out_source: str = ""

    def describe(self, warmup_batches: int) -> str:
        """What int8 was calibrated on and what it was judged on."""
        held_out = len(self.held_out)
        judged = f" and {held_out} held-out batches of {self.held_out_source}" if held_out else ", nothing held out"
        return (f"calibrated on {self.source} ({len(self.batches)} batches); judged on the {warmup_batches} warmup "
                f"batches{judged}")


@dataclass(frozen=True)
class Precisions:
    """The precisions to try, fastest first (fp32 eager, the reference, ends every walk anyway).

    ``must_beat_fp32``: the half precisions ``auto`` picked (not the YAML): each serves on no rung unless its eager
    forward beats fp32 eager's on the warmup batches, as some CPUs' bf16 instructions run slower than their fp32 ones.
    int8 is calibrated on ``calibration`` and judged on its held-out batches too (without one: on the warmup batches,
    which then flatter it); its weights take ``int8_weights``' range (``Int8Weights.for_cpu``)."""

    order: Sequence[DType]
    must_beat_fp32: Collection[DType] = ()
    calibration: Calibration | None = None
    int8_weights: Int8Weights = Int8Weights.FULL

    @property
    def int8_calibration(self) -> Calibration | None:
        """int8's calibration where int8 is tried (the warmup batches where none was given); else None."""
        if DType.INT8 not in self.order:
            return None
        return self.calibration


@dataclass(frozen=True)
class Site:
    """Where this load runs. ``decisions``: the store of what earlier loads measured (int8's layers, the races), read
    back by the next load of the same model on the same batches; races only on the same ``machine``
    (``handlers.cpu.features.machine``), so workers of one model serve one precision whatever load each started
    under. ``thread_counts``: the counts a forward may be given later (``handlers.cpu.core_share``); an accepted
    compiled forward is proven at each, as dynamo compiles per intra-op thread count."""

    decisions: DecisionStore | None = None
    machine: str = ""
    thread_counts: Collection[int] = ()
