"""OpenVINO's IR of a model kept beside the compile cache, so the next worker of the model skips export and conversion.

A worker that converts writes the IR (``model.xml`` + ``model.bin``) under a key of everything the conversion
depends on: the weights, the module's classes, the example's names, dtypes and ranks, and the torch and openvino
versions. OpenVINO's own compiled blobs live in ``BLOBS`` beside them (its ``CACHE_DIR``). Writing is whole or not at
all (a directory renamed into place), and reading or writing never fails a load: a missing or broken IR is converted
again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

logger = logging.getLogger(__name__)

DIRECTORY = "openvino"  # under the compile cache
BLOBS = "blobs"  # OpenVINO's CACHE_DIR, under DIRECTORY
MODEL = "model.xml"


def key(module: torch.nn.Module, example: Mapping[str, torch.Tensor], openvino_version: str,
        fixed: Mapping[str, tuple[int, ...]] = MappingProxyType({})) -> str:
    """What an IR of ``module`` converted on ``example`` (the axes ``fixed`` at its sizes) depends on, hashed."""
    digest = hashlib.sha256(repr((torch.__version__, openvino_version,
                                  sorted({type(child).__qualname__ for child in module.modules()}),
                                  [(name, str(tensor.dtype), tensor.dim(),
                                    [tensor.shape[axis] for axis in fixed.get(name, ())])
                                   for name, tensor in example.items()]))
                            .encode())
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


class IrStore:
    """The IR kept under ``key`` in ``directory`` (None: nothing is kept)."""

    def __init__(self, directory: Path | None, key: str):
        self.path = directory / key if directory is not None else None

    def read(self, openvino: Any) -> Any | None:
        """The kept IR, read; None where there is none or it cannot be read."""
        if self.path is None or not (self.path / MODEL).is_file():
            return None
        try:
            return openvino.Core().read_model(str(self.path / MODEL))
        except Exception as exc:  # noqa: BLE001 -- a broken IR is converted again
            logger.warning("openvino: the kept IR %s cannot be read (%s); converting again", self.path, exc)
            return None

    def write(self, openvino: Any, model: Any) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
            openvino.save_model(model, str(partial / MODEL), compress_to_fp16=False)
            try:
                os.rename(partial, self.path)
            except OSError:  # another worker kept it first
                shutil.rmtree(partial, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 -- the next worker converts again
            logger.warning("openvino: the IR cannot be kept in %s (%s); the next worker converts again", self.path,
                           exc)
