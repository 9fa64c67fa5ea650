"""What an AOTInductor package in the archive was built for, and whether this host fits it: decided from a JSON index
before any of the package's code is loaded.

AOTInductor's own check is thin: a package records the CPU it was built for, but loading it elsewhere only logs a
warning, and code built for instructions the CPU lacks dies of an illegal instruction (the worker, then every worker
TorchServe restarts). So the archive carries an index beside its packages (``aot/index.json``): per package its
precision, its file's sha256, the torch version and device it was built with, and the CPU's instruction sets its
kernels could use. A host fits a package when it runs the same torch version on the same kind of device and its kernels
may use every instruction set the build host's could (a superset: a package built on an AVX-512 CPU never runs on an
AVX2 one, nor one built with AMX on a CPU without it), and the file is the one that was proven.

Pure Python + torch; no TorchServe import.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from handlers.cpu.features import ATEN_VECTOR_ISAS_BELOW_AVX512

DIRECTORY = "aot"  # in the archive, beside the eager weights
INDEX = "index.json"
FORMAT = 1  # of the index; a reader refuses another


@dataclass(frozen=True)
class Fingerprint:
    """One package: what it was built for and what the gate measured when it was built."""

    precision: str
    file: str  # relative to the index's directory
    sha256: str
    torch: str
    device: str  # "cpu", or "cuda <architecture>"
    cpu_features: tuple[str, ...]  # the instruction sets the build host's kernels could use
    vector_isa: str  # inductor's vector instruction set for the generated kernels (for describe)
    inputs: tuple[str, ...]  # the program's positional inputs, by name
    gate: Mapping[str, Any] = field(default_factory=dict)  # metric, value, threshold on the warmup batches
    built_s: float = 0.0
    size_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_features": list(self.cpu_features), "inputs": list(self.inputs),
                "gate": dict(self.gate)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Fingerprint:
        return cls(**{**raw, "cpu_features": tuple(raw["cpu_features"]), "inputs": tuple(raw["inputs"])})


class UnreadableIndex(ValueError):
    """The index cannot be read as one this version wrote."""


def read_index(directory: Path) -> list[Fingerprint] | None:
    """The packages ``directory/index.json`` lists; None where there is none; UnreadableIndex where it is unreadable."""
    path = directory / INDEX
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != FORMAT:
            raise UnreadableIndex(f"{path} is format {raw.get('format')!r}, this version reads {FORMAT}")
        return [Fingerprint.from_json(entry) for entry in raw["packages"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, UnreadableIndex):
            raise
        raise UnreadableIndex(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None


def write_index(directory: Path, packages: list[Fingerprint]) -> Path:
    path = directory / INDEX
    path.write_text(json.dumps({"format": FORMAT, "packages": [p.to_json() for p in packages]}, indent=2) + "\n",
                    encoding="utf-8")
    return path


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}"
    return device.type


def cpu_features(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The CPU's instruction sets this process's kernels may use: those torch detects, less the AVX-512 and AMX ones
    where torch dispatches below AVX-512 (``ATEN_CPU_CAPABILITY``: inductor's generated code follows it)."""
    try:
        found = torch._C._cpu._get_cpu_capability()
    except Exception:  # noqa: BLE001 -- a torch without this private API (2.8) tells nothing
        return frozenset()
    names = {name for name, value in found.items() if value is True}
    capability = environ.get("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability()).upper()
    if capability in ATEN_VECTOR_ISAS_BELOW_AVX512:
        names = {name for name in names if not name.startswith(("avx512", "amx", "avx10"))}
    return frozenset(names)


def vector_isa() -> str:
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa()) or "none"


def misfit(package: Fingerprint, device: torch.device) -> str | None:
    """Why ``package`` must not run on this host, or None where it fits (its file's bytes are checked on load)."""
    return host_misfit(package.torch, package.device, package.cpu_features, package.vector_isa, device)


def host_misfit(built_torch: str, built_device: str, built_features: Sequence[str], built_isa: str,
                device: torch.device) -> str | None:
    """Why code built with ``built_torch`` for ``built_device``, on a CPU whose kernels could use ``built_features``,
    must not run on this host; None where it may."""
    if built_torch != torch.__version__:
        return f"built with torch {built_torch}, this worker runs {torch.__version__}"
    here = device_name(device)
    if built_device != here:
        return f"built for {built_device}, this worker runs on {here}"
    if device.type == "cpu":
        missing = sorted(set(built_features) - cpu_features())
        if missing:
            return (f"built on a CPU whose kernels could use {', '.join(missing)}, which this CPU's may not "
                    f"(built for {built_isa} kernels)")
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
