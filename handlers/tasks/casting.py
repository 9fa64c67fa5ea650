"""A model as the ladder optimizes it when requests carry floats: floating inputs cast to the precision the model's
weights are in (a bf16 copy takes bf16), floating outputs back to float32, so every rung answers in the dtype
clients and the quality gate read."""

from __future__ import annotations

from typing import Any

import torch


class CastsFloats(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> Any:
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        cast = {name: value.to(dtype) if value.is_floating_point() else value for name, value in inputs.items()}
        return _to_float32(self.model(**cast))


def _to_float32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, dict):
        return {key: _to_float32(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(_to_float32(value) for value in output)
    return output
