"""Packaging's side of the compile cache an archive carries (``handlers.serving.compile_artifacts``): a worker's load
of the staged archive, in a process of its own on an empty compile cache, and what it compiled kept in the archive.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from handlers.config import HandlerConfig, load_config_file
from handlers.models.files import ModelFiles
from handlers.rungs import aot_fingerprint
from handlers.serving.compile_artifacts import DIRECTORY, FORMAT, INDEX, KEPT, OURS, TORCH_FILE


def build(staging: Path, config_path: Path, files: ModelFiles, name: str) -> dict[str, Any]:
    """Run a worker's load of the staged archive in a process of its own on an empty compile cache, and keep what it
    compiled in ``staging/compile_artifacts``. Prints progress; SystemExit where the load fails."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pt2-artifacts-cache-") as cache:
        command = [sys.executable, "-m", "handlers.serving.compile_artifacts_build", str(staging), str(config_path),
                   name, files.model_file or "", files.serialized_file or ""]
        print("[package] compile artifacts: loading the model as a worker does, from an empty compile cache ...",
              flush=True)
        # A temp dir of its own, so it finds no other worker on these cores (their lock files live under TMPDIR): it
        # compiles as a worker that has the cores to itself, whose compile its graphs' cache keys then match.
        private_tmp = Path(cache) / "tmp"
        private_tmp.mkdir()
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(staging), "TMPDIR": str(private_tmp)}
        done = subprocess.run(command, env=env, cwd=staging, check=False)
        if done.returncode != 0:
            raise SystemExit(f"refusing to build an archive: the load that makes its compile artifacts failed (exit "
                             f"{done.returncode}; its log is above)")
        out = staging / DIRECTORY
        shutil.rmtree(private_tmp, ignore_errors=True)
        for kept in KEPT:
            if (Path(cache) / kept).is_dir():
                shutil.copytree(Path(cache) / kept, out / OURS / kept)
    index = json.loads((out / INDEX).read_text())
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    print(f"[package] compile artifacts: {size / 1e6:.1f} MB (torch's {index['torch_bytes'] / 1e6:.1f} MB) in "
          f"{time.perf_counter() - started:.1f}s; the load served {index['served']}", flush=True)
    return index


def _build_here(staging: Path, config: HandlerConfig, files: ModelFiles, name: str) -> None:
    """In the packaging subprocess: the load, then torch's artifacts and the index."""
    from handlers.serving.engine import Engine

    logging.basicConfig(level=logging.INFO, format="[package]   %(message)s")
    # The ladder as a worker runs it where no AOT package fits: what it compiles is what the fallback needs.
    engine = Engine(replace(config, aot_compile=False), staging, torch.device("cpu"), name, files=files)
    engine.load()
    saved = torch.compiler.save_cache_artifacts()
    data = saved[0] if saved else b""
    out = staging / DIRECTORY
    out.mkdir(exist_ok=True)
    (out / TORCH_FILE).write_bytes(data)
    (out / INDEX).write_text(json.dumps({
        "format": FORMAT, "torch": torch.__version__, "device": aot_fingerprint.device_name(torch.device("cpu")),
        "cpu_features": sorted(aot_fingerprint.cpu_features()), "vector_isa": aot_fingerprint.vector_isa(),
        "sha256": aot_fingerprint.sha256_of(out / TORCH_FILE), "torch_bytes": len(data),
        "served": f"{engine.active_rung} ({engine.dtype.value.value})"}, indent=2) + "\n")


if __name__ == "__main__":
    _staging, _config, _name, _model_file, _serialized = sys.argv[1:6]
    _build_here(Path(_staging), load_config_file(Path(_config)), ModelFiles(_model_file or None, _serialized or None),
                _name)
