"""The ways to run a model, one per rung of the ladder: compile (as ``pt2.compile`` asks), safe_compile, ipex, eager.

``build_rungs`` turns the model YAML's ``pt2_handlers.ladder`` into the rungs the ladder tries, in order.
Pure torch; no TorchServe import.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from handlers.config import CompileSpec, HandlerConfig, RungName
from handlers.rungs.base import EagerRung, Forward, Rung
from handlers.rungs.compile import CompileRung
from handlers.rungs.ipex import IpexRung

__all__ = ["CompileRung", "EagerRung", "Forward", "IpexRung", "Rung", "build_rungs"]


def build_rungs(config: HandlerConfig, device: torch.device,
                 compile_unavailable: str | None = None, inductor_unavailable: str | None = None,
                 threads_follow: bool = False) -> list[Rung]:
    """The rungs named in ``pt2_handlers.ladder``, in order; eager is always last. ``compile_unavailable``
    skips the compile rungs with that reason (e.g. no writable compile cache); ``inductor_unavailable`` skips
    those that compile with inductor (e.g. no C++ compiler for a CPU worker). ``threads_follow``: the compiled
    kernels take the thread count each call runs at (the worker shares its cores: handlers.cpu.core_share)."""
    requested = replace(config.served_compile, threads_follow=threads_follow)
    rungs: list[Rung] = []

    def unavailable(spec: CompileSpec) -> str | None:
        return compile_unavailable or (inductor_unavailable if spec.backend == "inductor" else None)

    for name in config.settings.ladder:
        if name is RungName.COMPILE:
            rungs.append(CompileRung(name.value, requested, skip_reason=unavailable(requested)))
        elif name is RungName.SAFE_COMPILE:
            same = "identical to the compile rung" if requested.safer() == requested else None
            rungs.append(CompileRung(name.value, requested.safer(), skip_reason=unavailable(requested.safer()) or same))
        elif name is RungName.IPEX:
            rungs.append(IpexRung(device))
        else:
            rungs.append(EagerRung())
    return rungs
