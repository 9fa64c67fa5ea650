"""The AOTInductor packages an archive carries (``pt2.export.aot_compile``), built by ``python -m handlers package``.

The model is loaded as a worker loads it (the task, its module, its warmup batches at the shape policy's shapes),
exported once per precision with ``torch.export`` (batch and sequence axes dynamic, outputs flat) and compiled with
AOTInductor. Each package is loaded back and proven against fp32 eager on the warmup batches, with the task's gate,
before it is kept; one that fails is left out, with the reason. The packages go to ``aot/`` in the archive with an
index of their fingerprints (``handlers.rungs.aot_fingerprint``), which the worker's aot rung reads before loading
any of them.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.config import DType, HandlerConfig
from handlers.ladder.gate import QualityError, detached
from handlers.ladder.proof import prove
from handlers.models.files import ModelFiles
from handlers.precision import choice
from handlers.precision.quantize import in_precision
from handlers.rungs import aot_fingerprint
from handlers.rungs.aot import AotForward
from handlers.rungs.aot_fingerprint import Fingerprint
from handlers.rungs.exporting import example_batch, export, fixed_axes, structure
from handlers.tasks import check_task
from handlers.tasks.base import TaskSettings

# Inductor's settings for every package: kernels that run at the thread count each call is given (a worker's count
# is known only on its host).
INDUCTOR_CONFIGS = {"cpp.dynamic_threads": True}


@dataclass(frozen=True)
class Built:
    """What packaging made: the packages kept, and each precision left out with the reason."""

    packages: tuple[Fingerprint, ...]
    left_out: tuple[str, ...]


def build(root: Path, config: HandlerConfig, files: ModelFiles, name: str) -> Built:
    """The packages of the model in ``root`` (the archive's staging directory), written to ``root/aot`` with their
    index: one per float precision ``dtype`` allows on this host, each proven first."""
    started = time.perf_counter()
    device = torch.device("cpu")
    settings = config.settings
    task_class = check_task(settings.task, import_dir=root)
    if not task_class.runs_one_forward:
        raise SystemExit(f"refusing to build AOT packages: {task_class.facts().name} runs a decode loop over its "
                         "cache, not one forward of an exported module; it stays on the compile rungs (drop "
                         "pt2.export.aot_compile; pt2_handlers.compile_artifacts carries its compiled graphs)")
    task, model = task_class.load(TaskSettings(settings, root, files, name), device)
    shapes = task.fit_shapes(settings.shapes)
    reference = task.build_module(model)
    batches = list(task.warmup_batches(shapes.warmup_shapes()))
    example = example_batch(batches)
    if example is None:
        raise SystemExit(f"refusing to build AOT packages: the task {settings.task} runs no forward of named tensors "
                         "(its warmup batches have none)")
    with torch.inference_mode():
        references = [detached(task.prove(reference, batch)) for batch in batches]
    _say(f"model loaded, {len(batches)} warmup batches run in fp32 eager in {time.perf_counter() - started:.1f}s")
    wanted = choice.resolve_precisions(settings.dtype, device).value
    fixed = fixed_axes(batches)
    directory = root / aot_fingerprint.DIRECTORY
    directory.mkdir(exist_ok=True)
    packages, left_out = [], []
    for dtype in wanted:
        if dtype is DType.INT8:
            left_out.append("int8: not packaged ahead of time; where the ladder reaches int8, it is built at load")
            _say(left_out[-1])
            continue
        try:
            packages.append(_package(directory, reference, dtype, example, fixed, batches, references,
                                     task_class.quality_gate(dtype, settings.quality_gate), task.prove))
        except QualityError as exc:
            left_out.append(f"{dtype.value}: failed the gate: {exc}")
            _say(left_out[-1])
    aot_fingerprint.write_index(directory, packages)
    total = sum(package.size_bytes for package in packages) / 1e6
    _say(f"{len(packages)} package(s), {total:.1f} MB, in {time.perf_counter() - started:.1f}s")
    return Built(tuple(packages), tuple(left_out))


def _package(directory: Path, reference: torch.nn.Module, dtype: DType, example: dict[str, torch.Tensor],
             fixed: dict[str, tuple[int, ...]], batches: list[Any], references: list[Any], gate: Any,
             run: Any) -> Fingerprint:
    """One precision's package, written to ``directory``, proven on the warmup batches; QualityError where it fails
    the gate (its file is then removed)."""
    started = time.perf_counter()
    module = reference if dtype is DType.FLOAT32 else in_precision(copy.deepcopy(reference), dtype)
    program = export(module, example, fixed, flat_outputs=True)
    exported = time.perf_counter()
    _say(f"{dtype.value}: exported in {exported - started:.1f}s; compiling with AOTInductor ...")
    path = directory / f"{dtype.value}.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=INDUCTOR_CONFIGS)
    compiled = time.perf_counter()
    forward = AotForward(torch._inductor.aoti_load_package(str(path)), list(example), structure(module, example))
    try:
        quality = prove(f"aot ({dtype.value})", forward, batches, references, gate, run)
    except QualityError:
        path.unlink()
        raise
    size = path.stat().st_size
    _say(f"{dtype.value}: compiled in {compiled - exported:.1f}s, proven on {len(batches)} warmup batches "
         f"({quality.metric} {quality.value:.6f} >= {quality.threshold:g}), {size / 1e6:.1f} MB")
    return Fingerprint(
        precision=dtype.value, file=path.name, sha256=aot_fingerprint.sha256_of(path), torch=torch.__version__,
        device=aot_fingerprint.device_name(torch.device("cpu")),
        cpu_features=tuple(sorted(aot_fingerprint.cpu_features())), vector_isa=aot_fingerprint.vector_isa(),
        inputs=tuple(example), gate={"metric": quality.metric, "value": quality.value, "threshold": quality.threshold},
        built_s=round(time.perf_counter() - started, 1), size_bytes=size)


def _say(line: str) -> None:
    print(f"[package] aot: {line}", flush=True)
