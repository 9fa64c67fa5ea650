"""The aot rung: the AOTInductor package the archive carries for a precision (``pt2.export.aot_compile``), loaded only
where its fingerprint fits this host (``aot_fingerprint``), then proven like every rung: its warmup and the gate.

A package is compiled once, when the archive is built, so a worker on a new host is READY without tracing or
generating code. Where no package fits (another torch, another CPU, a changed file) the rung is skipped with the
reason, before any of the package's code is loaded, and the ladder compiles at load as it does without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from handlers.config import DType, RungName
from handlers.rungs import aot_fingerprint
from handlers.rungs.aot_fingerprint import Fingerprint, UnreadableIndex
from handlers.rungs.base import Forward, Rung
from handlers.rungs.exporting import structure

logger = logging.getLogger(__name__)

NOT_PACKAGED = ("the archive carries no AOT package: build it with pt2.export.aot_compile: true "
                "(python -m handlers package)")


class AotRung(Rung):
    """The package for the precision asked, where one fits this host; it holds its own weights."""

    name = RungName.AOT.value
    takes_float32 = True  # the module only tells how the outputs nest: the package holds its weights
    own_precision = True  # proven by its own warmup and gate, here and when it was built: no eager screen first

    def __init__(self, device: torch.device, directory: Path | None, skip_reason: str | None = None):
        self.device = device
        self.directory = directory
        self._skip_reason = skip_reason
        self._example: Mapping[str, torch.Tensor] | None = None
        # The packages that fit this host, by precision, and why each other does not: read from the index alone.
        self._fits: dict[DType, Fingerprint] = {}
        self._misfits: list[str] = []
        if not skip_reason and directory is not None:
            self._read_index(directory)

    def _read_index(self, directory: Path) -> None:
        try:
            packages = aot_fingerprint.read_index(directory)
        except UnreadableIndex as exc:
            self._misfits.append(str(exc))
            packages = None
        for package in packages or ():
            reason = aot_fingerprint.misfit(package, self.device)
            if reason is None:
                self._fits[DType(package.precision)] = package
            else:
                self._misfits.append(f"{package.precision} package: {reason}")
        for reason in self._misfits:
            logger.warning("aot: %s; the ladder goes on without it", reason)

    @property
    def fits(self) -> bool:
        """Whether a package fits this host (it is still to be proven)."""
        return bool(self._fits) and not self._skip_reason

    def prepare(self, batches: Sequence[Any]) -> None:
        named = [batch for batch in batches if isinstance(batch, Mapping) and batch]
        self._example = min(named, key=lambda batch: sum(t.numel() for t in batch.values())) if named else None

    def unavailable_reason(self) -> str | None:
        if self._skip_reason:
            return self._skip_reason
        if self._fits and self._example is None:
            return "the aot rung runs a package on named tensors; this task's warmup batches have none"
        if self._fits:
            return None
        return "; ".join(self._misfits) or NOT_PACKAGED

    def runs_in(self, dtype: DType) -> bool:
        # With no package that fits, every precision "runs", so that the walk records the skip and its reason.
        return dtype in self._fits or not self._fits

    def follows_threads(self) -> bool:
        return True  # built with inductor's cpp.dynamic_threads: its kernels run at the count each call is given

    def identity(self) -> object:
        return ("aot", sorted(package.sha256 for package in self._fits.values()))

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        package = self._fits[dtype]
        assert self.directory is not None and self._example is not None
        path = self.directory / package.file
        started = time.perf_counter()
        found = aot_fingerprint.sha256_of(path) if path.is_file() else "missing"
        if found != package.sha256:
            raise AotPackageChanged(f"{path.name} is not the package that was proven: its sha256 is {found[:16]}, "
                                    f"the index says {package.sha256[:16]}; not loaded")
        hashed = time.perf_counter()
        loaded = load_package(path)
        logger.info("aot: %s (%s, built with torch %s for %s kernels) checked in %.1fs, loaded in %.1fs", path.name,
                    dtype.value, package.torch, package.vector_isa, hashed - started, time.perf_counter() - hashed)
        return AotForward(loaded, package.inputs, structure(module, self._example))


def load_package(path: Path) -> Any:
    """The package, loaded without ``aoti_load_package``'s comparison of the device: it builds inductor's
    instruction-set probes with the C++ compiler (~7 s on a new host) only to log a warning, where the fingerprint
    was checked already."""
    try:
        from torch._inductor.package.package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (ImportError, AttributeError, TypeError):  # another torch's layout: its own loader
        return torch._inductor.aoti_load_package(str(path))
    return AOTICompiledModel(loader)


class AotPackageChanged(RuntimeError):
    """A package whose bytes are not those its fingerprint was taken of (corrupted, truncated, replaced)."""


class AotForward:
    """A loaded package called like the module: keyword tensors in, the module's output structure out."""

    def __init__(self, loaded: Any, inputs: Sequence[str], outputs: pytree.TreeSpec):
        self.loaded = loaded
        self.inputs = tuple(inputs)  # in the order the program takes them
        self.outputs = outputs

    def __call__(self, **inputs: torch.Tensor) -> Any:
        flat = self.loaded(*(inputs[name] for name in self.inputs))
        return pytree.tree_unflatten(list(flat), self.outputs)
