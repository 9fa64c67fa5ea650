"""Which precisions a worker tries, fastest first: ``dtype`` from the model YAML, ``auto`` resolved from what the CPU
(or GPU) can do; and the range int8's weights take on this CPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from handlers.config import Choice, DType
from handlers.cpu import features as cpu
from handlers.precision.quantize import Int8Weights, int8_problem


def resolve_precisions(requested: Sequence[DType], device: torch.device,
                       features: Mapping[str, bool] | None = None) -> Choice:
    """The precisions to try, fastest first (a tuple of DType). ``auto``: bf16 then fp32 on a CPU with bf16
    instructions (``features``: the CPU's, by default asked of torch) or a GPU that has bf16 (fp16 then fp32 on
    one that has not), fp32 alone on other CPUs; never int8. A list: as configured, ``auto`` in it expanded so
    (``[int8, auto]``: int8, then what auto picks), less int8 where it cannot run (a GPU, or no torchao); the
    reason says which. On a CPU without int8 dot products int8 is tried with 7-bit weights (``int8_weights``)."""
    limits = None
    if features is None:
        features, limits = cpu.cpu_features(), cpu.kernel_isa_limits()
    auto = _auto_precisions(device, features)
    if limits is not None and device.type == "cpu":
        auto = Choice(auto.value, f"{auto.reason}; {limits}")
    if tuple(requested) == (DType.AUTO,):
        return auto
    expanded = tuple(dict.fromkeys(p for dtype in requested for p in (auto.value if dtype is DType.AUTO else (dtype,))))
    reason = "configured" + (f" ({auto.reason})" if DType.AUTO in requested else "")
    problem = int8_problem(device) if DType.INT8 in expanded else None
    if problem is None:
        return Choice(expanded, reason)
    kept = tuple(dtype for dtype in expanded if dtype is not DType.INT8)
    if not kept:
        return Choice((DType.FLOAT32,), f"configured int8 alone, but {problem}; fp32, the reference")
    return Choice(kept, f"{reason}, less int8: {problem}")

def int8_weights(features: Mapping[str, bool] | None = None) -> Int8Weights:
    """The range the int8 rung's weights take on this CPU (its usable ``features``): full where it has int8 dot
    products, 7 bits where oneDNN's int16 pair sums would saturate."""
    return Int8Weights.for_cpu(cpu.cpu_features() if features is None else features)

def _auto_precisions(device: torch.device, features: Mapping[str, bool]) -> Choice:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice((DType.BFLOAT16, DType.FLOAT32),
                          "auto: the GPU has bf16; fp32 where bf16 fails the gate or is no faster")
        return Choice((DType.FLOAT16, DType.FLOAT32),
                      "auto: the GPU has no bf16; fp16, fp32 where it fails the gate or is no faster")
    found = [name for name in cpu.BF16_CPU_FEATURES if features.get(name)]
    if found:
        return Choice((DType.BFLOAT16, DType.FLOAT32),
                      f"auto: the CPU has {'/'.join(found)}; fp32 where bf16 fails the gate or is no faster")
    return Choice((DType.FLOAT32,), f"auto: the CPU has none of {'/'.join(cpu.BF16_CPU_FEATURES)}, so bf16 would be "
                                   "emulated")
