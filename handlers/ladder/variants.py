"""The reference model in each precision the walk tries: a converted copy made once, dropped when it cannot serve.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from handlers.config import DType
from handlers.ladder.inputs import Calibration
from handlers.ladder.int8_layers import Int8Layers
from handlers.precision.quantize import in_precision, split_outliers, static_int8, stays_float


class ModelVariants:
    """The model in ``dtype``: the reference itself for fp32, a converted copy (made once) otherwise. int8 is
    calibrated on ``calibration``, takes the layers ``int8_layers`` measured, and runs its float layers in the
    precision ``int8_rest()`` names (asked when int8 is built: bf16 only where bf16's screen passed)."""

    def __init__(self, reference: torch.nn.Module, calibration: Calibration | None, int8_layers: Int8Layers,
                 int8_rest: Callable[[], torch.dtype]):
        self.reference = reference
        self.calibration = calibration
        self.int8_layers = int8_layers
        self.int8_rest = int8_rest
        self._models: dict[DType, torch.nn.Module] = {DType.FLOAT32: reference}

    def __getitem__(self, dtype: DType) -> torch.nn.Module:
        if dtype not in self._models:
            self._models[dtype] = self._int8() if dtype is DType.INT8 else in_precision(
                copy.deepcopy(self.reference), dtype)
        return self._models[dtype]

    def drop(self, dtype: DType) -> None:
        """Let go of the copy in ``dtype`` (it lost, or failed); the reference, which serves the fallback, stays."""
        if dtype is not DType.FLOAT32:
            self._models.pop(dtype, None)

    def _int8(self) -> torch.nn.Module:
        assert self.calibration is not None  # run_ladder gives one whenever int8 is tried
        rest = self.int8_rest()  # before the copy: bf16's screen may run first
        model, taken = copy.deepcopy(self.reference), set()
        if not self.int8_layers.by_rule:
            choice = self.int8_layers.choice()
            taken = {*choice.taken, *split_outliers(model, choice.split).values()}
        return static_int8(model, self.calibration.batches, rest,
                           keep_float=lambda name, layer: stays_float(name, layer) and name not in taken,
                           weights=self.int8_layers.weights)
