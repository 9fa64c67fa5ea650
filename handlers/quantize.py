"""The model in a precision: a float dtype, or int8 linear layers (torchao), made for the ladder to prove.

int8 is torchao's dynamic-activation / int8-weight scheme: weights quantized per output channel once, each
activation row (token) quantized on the fly, int8 x int8 -> int32 matmuls; the rest of the model stays in
float32. Under ``torch.compile`` on x86, inductor fuses each activation's quantization into one C++ kernel before
an int8 matmul (``aten._int_mm``, VNNI or AMX tiles) and the rescaling into one after; with freezing, the matmul
and the rescaling become one oneDNN int8 linear. Per-token scales keep MiniLM embeddings at cosine 0.992 vs
fp32. PT2E's x86 quantizer (static, per-tensor scales) is faster but loses the gate unless the FFN output
linears stay in float (docs/ladder.md: Why not PT2E).

torchao is imported only when int8 is asked for, never at module import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from types import ModuleType

import torch

from handlers.config import DType

TORCHAO = "torchao"
# CPU features with int8 dot products (u8 x s8 -> s32 in one instruction). Without them an int8 matmul is
# three AVX2 instructions per 32 products, no faster than fp32 FMAs: int8 would cost gate risk for nothing.
INT8_CPU_FEATURES = ("amx_int8", "avx512_vnni", "avx_vnni")


@functools.cache
def probe_torchao() -> tuple[ModuleType | None, str | None]:
    """``(torchao.quantization, None)`` when torchao imports with this torch, else ``(None, reason)``."""
    if importlib.util.find_spec(TORCHAO) is None:
        return None, f"{TORCHAO} is not installed (pip install torchao beside torch {torch.__version__})"
    try:
        with _quiet_torchao():
            return importlib.import_module(f"{TORCHAO}.quantization"), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- any failure means: no int8 here
        return None, f"{TORCHAO} failed to import with torch {torch.__version__}: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    """torchao logs (WARNING) each optional CUDA extension a CPU-only torch cannot load, and torch a deprecation
    for each enum torchao registers as it goes: noise to a server log, at import and at the first quantize."""
    noisy = [logging.getLogger(name) for name in (TORCHAO, "torch.utils._pytree")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(noisy, levels, strict=True):
            logger.setLevel(level)


def int8_problem(device: torch.device, features: Mapping[str, bool]) -> str | None:
    """Why int8 is not tried on ``device`` (a CPU with ``features``), or None when it is."""
    if device.type == "cpu" and not any(features.get(name) for name in INT8_CPU_FEATURES):
        return (f"the CPU has none of {'/'.join(INT8_CPU_FEATURES)}: int8 matmuls would run through AVX2 "
                "multiply-adds, no faster than float32, whose int16 pair sums saturate")
    return probe_torchao()[1]


def in_precision(module: torch.nn.Module, dtype: DType, rest: torch.dtype = torch.float32) -> torch.nn.Module:
    """``module`` (float32, changed in place) in ``dtype``. int8 quantizes the weights and activations of every
    ``nn.Linear``; what it leaves alone (norms, GELU, attention) runs in ``rest``. The ladder keeps float32 there:
    bf16 there measured 14 % faster at 8x128 tokens and 7 % slower at 1x16, at a lower cosine
    (scripts/bench_model.py compile-dynamic-int8-bf16)."""
    module = module.to(rest if dtype is DType.INT8 else dtype.torch)
    if dtype is not DType.INT8:
        return module
    quantization, reason = probe_torchao()
    if quantization is None:
        raise RuntimeError(reason)
    config = quantization.Int8DynamicActivationInt8WeightConfig()
    with _quiet_torchao():
        quantization.quantize_(module, config)
    return module
