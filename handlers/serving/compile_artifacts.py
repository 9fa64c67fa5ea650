"""The compile cache an archive carries (``pt2_handlers.compile_artifacts``): what a load on the packaging host compiled
and measured, so a worker on a new host skips inductor's code generation and OpenVINO's conversion.

Packaging loads the model as a worker does, the whole ladder, in a process of its own whose compile cache
starts empty, and keeps in the archive's ``compile_artifacts/``:

    torch.bin   torch's cache artifacts (``torch.compiler.save_cache_artifacts``): FX graphs, AOT autograd entries,
                inductor's kernels, in torch's portable form
    cache/      this package's own entries of that compile cache: the OpenVINO IR and OpenVINO's compiled blobs, the
                fused attention kernel, what the load measured (races, length groups)
    index.json  the packaging host: torch version, device, the instruction sets its kernels could use; the sha256 of
                torch.bin

Packaging builds them (``handlers.serving.compile_artifacts_build``). A worker (``load``) whose host fits
(``handlers.rungs.aot_fingerprint.host_misfit``: code built for instructions its CPU lacks never loads) hands torch.bin
to ``torch.compiler.load_cache_artifacts`` and copies ``cache/`` into its compile cache where absent, before its
ladder. Elsewhere nothing is loaded and describe says why. Never fails a load.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from handlers.cpu import fused_attention
from handlers.ladder.decisions import DIRECTORY as DECISIONS
from handlers.rungs import aot_fingerprint, openvino_ir

logger = logging.getLogger(__name__)

DIRECTORY = "compile_artifacts"  # in the archive
TORCH_FILE = "torch.bin"
OURS = "cache"  # this package's entries of the compile cache, as they lie there
INDEX = "index.json"
FORMAT = 1
KEPT = (openvino_ir.DIRECTORY, fused_attention.DIRECTORY, DECISIONS)


def load(model_root: Path, cache_dir: str | None, device: torch.device) -> dict[str, Any] | None:
    """The archive's compile artifacts loaded into this worker's compile cache where the host fits; what happened,
    for describe (None: the archive carries none)."""
    root = model_root / DIRECTORY
    if not (root / INDEX).is_file():
        return None
    started = time.perf_counter()
    try:
        index = json.loads((root / INDEX).read_text())
        if index.get("format") != FORMAT:
            return _left_out(f"{root / INDEX} is format {index.get('format')!r}, this version reads {FORMAT}")
        misfit = aot_fingerprint.host_misfit(index["torch"], index["device"], index["cpu_features"],
                                             index["vector_isa"], device)
        if misfit:
            return _left_out(misfit)
        if cache_dir is None:
            return _left_out("no writable compile cache to load them into")
        if aot_fingerprint.sha256_of(root / TORCH_FILE) != index["sha256"]:
            return _left_out(f"{TORCH_FILE} is not the file that was built (its sha256 differs from the index's)")
        data = (root / TORCH_FILE).read_bytes()
        if data:
            torch.compiler.load_cache_artifacts(data)
        copied = _copy_ours(root / OURS, Path(cache_dir))
    except Exception as exc:  # noqa: BLE001 -- artifacts only save time: nothing about them may fail a load
        return _left_out(f"they cannot be loaded: {type(exc).__name__}: {exc}")
    seconds = round(time.perf_counter() - started, 2)
    logger.info("compile artifacts from the archive loaded in %.2fs: torch's (%.1f MB), and %s", seconds,
                len(data) / 1e6, ", ".join(copied) or "nothing else")
    return {"loaded": True, "seconds": seconds, "torch_bytes": len(data), "copied": copied,
            "built_on": index["vector_isa"], "served_at_packaging": index.get("served")}


def _copy_ours(source: Path, cache: Path) -> list[str]:
    """This package's cache entries, copied where the worker's cache lacks them (a warm cache keeps its own)."""
    copied = []
    for kept in KEPT:
        if not (source / kept).is_dir():
            continue
        for path in (source / kept).rglob("*"):
            target = cache / path.relative_to(source)
            if path.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        copied.append(kept)
    return copied


def _left_out(reason: str) -> dict[str, Any]:
    logger.warning("compile artifacts from the archive left out: %s; the ladder compiles as without them", reason)
    return {"loaded": False, "reason": reason}
