"""The ipex rung: intel-extension-for-pytorch's ``optimize`` (CPU only), and the lazy probe for IPEX.

IPEX is imported only when a rung needs it, never at module import. Each IPEX release works with one torch
minor version only (IPEX 2.8 with torch 2.8.*), and a wheel built for another torch fails in more ways than
ImportError: IPEX 2.8 on torch 2.13 raises AttributeError from inside its own error handling. So the
versions are compared before importing, and every import failure becomes a reason string; the ladder
moves on with it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

import torch

from handlers.config import DType, RungName
from handlers.rungs.base import Forward, Rung

IPEX_MODULE = "intel_extension_for_pytorch"
IPEX_DISTRIBUTION = "intel-extension-for-pytorch"


@functools.cache
def probe_ipex() -> tuple[ModuleType | None, str | None]:
    """Return ``(module, None)`` when IPEX imports cleanly, else ``(None, reason)``. Probed once per process."""
    import torch

    if importlib.util.find_spec(IPEX_MODULE) is None:
        return None, f"{IPEX_MODULE} is not installed (the ipex profile: scripts/setup.sh --profile ipex)"
    mismatch = version_mismatch(_installed_version(), torch.__version__)
    if mismatch:
        return None, mismatch
    try:
        return importlib.import_module(IPEX_MODULE), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- any failure means: no IPEX here
        return None, f"{IPEX_MODULE} failed to import with torch {torch.__version__}: {type(exc).__name__}: {exc}"


def version_mismatch(ipex_version: str | None, torch_version: str) -> str | None:
    """Why this IPEX cannot work with this torch (their major.minor differ), or None."""
    if ipex_version is None:
        return None  # no metadata (e.g. a source checkout): let the import decide
    if _major_minor(ipex_version) == _major_minor(torch_version):
        return None
    wanted = ".".join(_major_minor(ipex_version))
    return (f"{IPEX_MODULE} {ipex_version} works only with torch {wanted}.*, this worker has torch "
            f"{torch_version} (version mismatch; not imported)")


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version(IPEX_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


class IpexRung(Rung):
    """IPEX's ``optimize`` of the model, in bf16 or fp32; no compile."""

    name = RungName.IPEX.value

    def __init__(self, device: torch.device):
        self.device = device

    def unavailable_reason(self) -> str | None:
        if self.device.type != "cpu":
            return f"IPEX runs on CPU only; this worker uses {self.device}"
        return probe_ipex()[1]

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        ipex, reason = probe_ipex()
        if ipex is None:
            raise RuntimeError(reason)
        # No channels_last: it suits convolutions, and these are transformers.
        return ipex.optimize(module.eval(), dtype=None if dtype is DType.FLOAT32 else dtype.torch, inplace=False)
