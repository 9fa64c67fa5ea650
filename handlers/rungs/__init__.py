"""The ways to run a model, one per rung of the ladder: aot (the archive's AOTInductor package), openvino, compile
(as ``pt2.compile`` asks), safe_compile, ipex, eager.

``build_rungs`` turns the model YAML's ``pt2_handlers.ladder`` into the rungs the ladder tries, in order.
Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from handlers.config import OPENVINO_BACKEND, CompileSpec, HandlerConfig, RungName
from handlers.rungs.aot import AotRung
from handlers.rungs.base import EagerRung, Forward, Rung
from handlers.rungs.compile import CompileRung
from handlers.rungs.ipex import IpexRung
from handlers.rungs.openvino import OpenVinoRung

__all__ = ["AotRung", "CompileRung", "EagerRung", "Forward", "IpexRung", "OpenVinoRung", "Rung", "build_rungs"]

logger = logging.getLogger(__name__)

SERVED_BY_OPENVINO = (f"pt2.compile.backend: {OPENVINO_BACKEND} is served by the openvino rung, which converts the "
                      "exported module itself (dynamo's openvino backend is not used)")


def build_rungs(config: HandlerConfig, device: torch.device,
                 compile_unavailable: str | None = None, inductor_unavailable: str | None = None,
                 threads_follow: bool = False, cache_dir: str | None = None,
                 openvino_unavailable: str | None = None, aot_dir: Path | None = None) -> list[Rung]:
    """The rungs named in ``pt2_handlers.ladder``, in order; eager is always last. ``compile_unavailable``
    skips the compile rungs with that reason (e.g. no writable compile cache); ``inductor_unavailable`` skips
    those that compile with inductor (e.g. no C++ compiler for a CPU worker). ``threads_follow``: the compiled
    kernels take the thread count each call runs at (the worker shares its cores: handlers.cpu.core_share).
    ``cache_dir``: the compile cache, beside which the openvino rung keeps its IR; ``openvino_unavailable`` skips that
    rung and the aot rung with the reason (e.g. a task that runs no single forward of an exported module).
    ``pt2.compile.backend: openvino`` is served by the openvino rung: in the compile rung's place where the ladder
    does not list openvino, else the compile rung is skipped with the reason. ``pt2.export.aot_compile`` puts the
    aot rung first, serving the packages in ``aot_dir`` (the archive's) where they fit the host."""
    requested = replace(config.served_compile, threads_follow=threads_follow)
    by_openvino = config.compile.enabled and config.compile.backend == OPENVINO_BACKEND
    if by_openvino:
        logger.info(SERVED_BY_OPENVINO)
    rungs: list[Rung] = []

    def unavailable(spec: CompileSpec) -> str | None:
        return compile_unavailable or (inductor_unavailable if spec.backend == "inductor" else None)

    for name in ladder_of(config):
        if name is RungName.AOT:
            off = None if config.aot_compile else "pt2.export.aot_compile is off: the archive carries no AOT package"
            rungs.append(AotRung(device, aot_dir, skip_reason=off or openvino_unavailable))
        elif name is RungName.OPENVINO:
            rungs.append(OpenVinoRung(device, cache_dir, skip_reason=openvino_unavailable))
        elif name is RungName.COMPILE:
            rungs.append(CompileRung(name.value, requested,
                                     skip_reason=SERVED_BY_OPENVINO if by_openvino else unavailable(requested)))
        elif name is RungName.SAFE_COMPILE:
            same = "identical to the compile rung" if requested.safer() == requested else None
            rungs.append(CompileRung(name.value, requested.safer(), skip_reason=unavailable(requested.safer()) or same))
        elif name is RungName.IPEX:
            rungs.append(IpexRung(device))
        else:
            rungs.append(EagerRung())
    return rungs


def ladder_of(config: HandlerConfig) -> tuple[RungName, ...]:
    """``pt2_handlers.ladder`` as the worker walks it: the aot rung first where ``pt2.export.aot_compile`` asks and
    the ladder leaves it out; the openvino rung in the compile rung's place where ``pt2.compile.backend`` is openvino
    and the ladder leaves it out."""
    ladder = config.settings.ladder
    if config.aot_compile and RungName.AOT not in ladder:
        ladder = (RungName.AOT, *ladder)
    if config.compile.enabled and config.compile.backend == OPENVINO_BACKEND and RungName.OPENVINO not in ladder:
        ladder = tuple(RungName.OPENVINO if name is RungName.COMPILE else name for name in ladder)
    return ladder
