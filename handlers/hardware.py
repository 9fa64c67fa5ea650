"""What this worker's hardware can do, asked at load time (never at import): the dtype that ``auto``
resolves to, and how many threads each worker may use without oversubscribing the cores."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from handlers.config import DType

# CPU features under which bf16 matmuls run in hardware (oneDNN uses AMX tiles or AVX512-BF16 dot products).
BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Choice:
    """A resolved setting and why it was chosen (shown in describe)."""

    value: object
    reason: str


def cpu_features() -> dict[str, bool]:
    """The CPU capabilities torch detected (a private API, so any failure means: none known)."""
    try:
        capability = torch._C._cpu._get_cpu_capability()
    except Exception:  # noqa: BLE001 -- an older or newer torch without it: fall back to fp32
        return {}
    return {name: bool(capability.get(name)) for name in BF16_CPU_FEATURES}


def resolve_dtype(requested: DType, device: torch.device) -> Choice:
    """``auto``: bf16 on a CPU with bf16 instructions, fp32 on other CPUs; bf16 (else fp16) on a GPU."""
    if requested is not DType.AUTO:
        return Choice(requested, "configured")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice(DType.BFLOAT16, "auto: the GPU supports bf16")
        return Choice(DType.FLOAT16, "auto: the GPU has no bf16; fp16")
    found = [name for name, present in cpu_features().items() if present]
    if found:
        return Choice(DType.BFLOAT16, f"auto: the CPU has {'/'.join(found)}")
    return Choice(DType.FLOAT32, f"auto: the CPU has none of {'/'.join(BF16_CPU_FEATURES)}, so bf16 would be emulated")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_threads(requested: int | None, workers: int, device: torch.device) -> Choice:
    """Intra-op threads for this worker: the cores shared among the model's workers, at least one."""
    if requested is not None:
        return Choice(requested, "configured")
    cores = available_cores()
    if device.type != "cpu":
        return Choice(min(cores, 4), "auto: a GPU worker needs few CPU threads")
    threads = max(1, cores // max(1, workers))
    return Choice(threads, f"auto: {cores} cores / {workers} worker(s) (minWorkers)")
