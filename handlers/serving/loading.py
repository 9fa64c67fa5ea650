"""One load, step by step: the model the archive carries, the task around it, the warmup batches, the rungs and
the attention their graphs run, the ladder, and the length groups of the forward it serves.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from handlers.config import Attention, Choice, DType, HandlerConfig, ModuleGuards, Pick
from handlers.config.shapes import ShapePolicy
from handlers.cpu import features, fused_attention
from handlers.cpu.worker_cores import WorkerCores
from handlers.errors import ConfigError
from handlers.ladder import AttemptStatus, LadderResult, Precisions, Site, Warmup, run_ladder
from handlers.ladder.decisions import DIRECTORY, DecisionStore, fingerprint
from handlers.ladder.guard import GuardedForward
from handlers.ladder.inputs import Calibration
from handlers.models.files import SAVE_PRETRAINED, ModelFiles
from handlers.precision import choice
from handlers.rungs import AotRung, CompileRung, Rung, aot_fingerprint, build_rungs, compile_cache
from handlers.rungs.compile_cache import CacheDir
from handlers.serving import compile_artifacts, length_groups
from handlers.serving.length_groups import LengthGrouping
from handlers.tasks import Task, check_task
from handlers.tasks.base import TaskSettings

logger = logging.getLogger(__name__)


@dataclass
class Loaded:
    """What a load made: the task, the accepted forward behind its guard, the shapes it serves, and how it got there
    (for describe)."""

    task: Task
    guard: GuardedForward
    shapes: ShapePolicy
    result: LadderResult
    dtype: Choice  # the precision served, and why
    attention: fused_attention.Outcome
    cache_use: dict[str, dict[str, int]]  # what the compile caches served at load
    int8_weights: str | None = None  # int8 was tried: the range its weights took on this CPU, and why
    notes: list[str] = field(default_factory=list)
    lengths: LengthGrouping | None = None  # rows of mixed lengths run in groups by it (tasks of one row per text)
    artifacts: dict[str, Any] | None = None  # the archive's compile artifacts, loaded or why not (None: it has none)


class Loader:
    """The load of one model on ``device``, in the precisions ``precisions`` names, on ``cores``; what it measures is
    kept beside the compile ``cache`` for the next worker."""

    def __init__(self, config: HandlerConfig, model_root: Path, device: torch.device, model_name: str,
                 cache: CacheDir, precisions: Choice, cores: WorkerCores, files: ModelFiles = SAVE_PRETRAINED):
        self.config = config
        self.settings = config.settings
        self.model_root = Path(model_root)
        self.device = device
        self.model_name = model_name
        self.cache = cache
        self.precisions: tuple[DType, ...] = precisions.value
        self.precisions_reason = precisions.reason
        self.cores = cores
        self.files = files

    def load(self) -> Loaded:
        # Before anything compiles: the compile cache the archive carries, where the host fits it.
        artifacts = compile_artifacts.load(self.model_root, self.cache.path, self.device)
        task_class = check_task(self.settings.task, import_dir=self.model_root)
        _check_gate_keys(task_class, self.settings.quality_gate)
        # fp32 first: it is the reference every rung is judged against, and the eager fallback.
        task, model = task_class.load(TaskSettings(self.settings, self.model_root, self.files, self.model_name),
                                      self.device)
        shapes = task.fit_shapes(self.settings.shapes)
        reference = task.build_module(model)
        batches = [self.on_device(batch) if isinstance(batch, Mapping) else batch
                   for batch in task.warmup_batches(shapes.warmup_shapes())]
        rungs = self._rungs(task_class)
        attention = self._attention(model, task_class, rungs)
        cache_before = compile_cache.use_counters()
        int8_weights = choice.int8_weights()
        result = run_ladder(reference, rungs, self._warmup(task_class, task, batches),
                            self._precisions(task, shapes, batches, int8_weights),
                            # races kept per machine and attention kernel: a changed kernel races again
                            Site(self._decisions(), repr((self._machine(), attention.identity)),
                                 self.cores.thread_counts()),
                            module_guards_optional=self.settings.module_guards is ModuleGuards.AUTO,
                            race_rungs=self.settings.pick is Pick.FASTEST)
        cache_use = compile_cache.use_since(cache_before)
        logger.info("compile cache %s: %s", self.cache.path, ", ".join(
            f"{cache} {use['hit']} hit / {use['miss']} missed / {use['bypass']} bypassed"
            for cache, use in cache_use.items()))
        served = next(rung for rung in rungs if rung.name == result.active)  # eager is always among them
        shapes = shapes.for_served(kernels_per_shape=served.keeps_kernels_per_shape(result.dtype))
        loaded = Loaded(task, GuardedForward(result, reference, self.settings.max_runtime_failures,
                                             shapes.after_ready),
                        shapes, result, Choice(result.dtype, self._why_served(result)), attention, cache_use,
                        int8_weights.describe() if DType.INT8 in self.precisions else None,
                        [note for rung in rungs for note in rung.notes(self.device)], artifacts=artifacts)
        if task.row_outputs and shapes.length_groups:
            loaded.lengths = self._length_groups(result, reference, batches, shapes)
        return loaded

    def on_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.device) for name, tensor in batch.items()}

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _rungs(self, task_class: type[Task]) -> list[Rung]:
        no_cache = None if self.cache.path else f"no writable compile cache: {self.cache.warning}"
        one_forward = None if task_class.runs_one_forward else (
            f"{task_class.facts().name} runs a decode loop over its cache; it stays on the compile rungs")
        return build_rungs(self.config, self.device, compile_unavailable=no_cache,
                           inductor_unavailable=features.cpp_compiler_problem(self.device),
                           threads_follow=self.cores.share is not None, cache_dir=self.cache.path,
                           openvino_unavailable=one_forward, aot_dir=self.model_root / aot_fingerprint.DIRECTORY)

    def _attention(self, model: torch.nn.Module, task_class: type[Task],
                   rungs: Sequence[Rung]) -> fused_attention.Outcome:
        if rungs and isinstance(rungs[0], AotRung) and rungs[0].fits:
            # The package serves where it passes; building the kernel (~10 s on a new host) would cost most of the
            # start it saves. A compile rung reached after it traces SDPA.
            attention = fused_attention.Outcome(False, "the archive's AOT package fits this host and runs SDPA; a "
                                                       "compile rung reached after it traces SDPA too")
            logger.info("attention in compiled graphs: %s", attention.summary())
            return attention
        attention = fused_attention.use_in_compiled_graphs(
            model, self.device, Path(self.cache.path) / fused_attention.DIRECTORY if self.cache.path else None,
            wanted=self.settings.attention is Attention.AUTO, causal=task_class.facts().causal_attention,
            backends={rung.spec.backend for rung in rungs
                      if isinstance(rung, CompileRung) and rung.unavailable_reason() is None})
        logger.info("attention in compiled graphs: %s", attention.summary())
        return attention

    def _warmup(self, task_class: type[Task], task: Task, batches: list[Any]) -> Warmup:
        return Warmup(batches, lambda dtype: task_class.quality_gate(dtype, self.settings.quality_gate), task.prove)

    def _precisions(self, task: Task, shapes: ShapePolicy, batches: list[Any], int8_weights: Any) -> Precisions:
        int8 = self._int8_calibration(task, shapes, batches) if DType.INT8 in self.precisions else None
        return Precisions(self.precisions, must_beat_fp32=_picked_by_auto(self.precisions, self.settings.dtype),
                          calibration=int8, int8_weights=int8_weights)

    def _int8_calibration(self, task: Task, shapes: ShapePolicy, warmup: list[Any]) -> Calibration:
        """What int8 is calibrated on and judged on besides the warmup (``Task.calibration``), on the device."""
        found = task.calibration(shapes.warmup_shapes(), warmup)
        return Calibration([self.on_device(batch) for batch in found.batches],
                           [self.on_device(batch) for batch in found.held_out], found.source, found.held_out_source)

    def _decisions(self) -> DecisionStore | None:
        return DecisionStore(Path(self.cache.path) / DIRECTORY) if self.cache.path else None

    def _machine(self) -> str:
        return features.machine(self.device, self.cores.threads.value)

    def _length_groups(self, result: LadderResult, reference: torch.nn.Module, batches: list[Any],
                       shapes: ShapePolicy) -> LengthGrouping:
        # Kept beside the compile cache for the next worker of this forward on this machine, as the races are.
        kept, key = self._decisions(), None
        if kept is not None:
            served = (result.active, result.dtype.value, repr(self.config.served_compile), shapes.describe(),
                      self._machine())
            weights_key = result.weights_key or fingerprint(tensors=reference.state_dict().items())
            key = length_groups.kept_key(batches, served, weights_key)
        return LengthGrouping.measured(result.forward, batches, self.synchronize, kept, key)

    def _why_served(self, result: LadderResult) -> str:
        """The plan's reason, and why each precision tried before the served one does not serve: it failed the
        quality gate, or (int8) it passed but was not faster here."""
        precisions, served = self.precisions, result.dtype
        passed = {attempt.dtype for attempt in result.attempts if attempt.status is AttemptStatus.SLOWER}
        turned_down = precisions[: precisions.index(served)] if served in precisions else precisions
        failed = [p.value for p in turned_down if p.value not in passed]
        slower = [p.value for p in turned_down if p.value in passed]
        why = ([f"{' and '.join(failed)} failed the quality gate"] if failed else []) + (
            [f"{' and '.join(slower)} passed the gate but was not faster here"] if slower else [])
        return f"{self.precisions_reason}; {'; '.join(why)} (see attempts)" if why else self.precisions_reason


def _check_gate_keys(task_class: type[Task], thresholds: Mapping[str, float]) -> None:
    """A task of one's own reads the gate keys its class declares: the YAML's others are a mistake, told at load."""
    keys = task_class.facts().gate_keys
    unknown = sorted(key for key in thresholds if key not in keys)
    if unknown:
        raise ConfigError(f"pt2_handlers.quality_gate: unknown key(s) {', '.join(unknown)} for the task "
                          f"{task_class.facts().name}; allowed: {', '.join(keys)}")


def _picked_by_auto(precisions: Sequence[DType], configured: Sequence[DType]) -> tuple[DType, ...]:
    """The half precisions that ``auto`` added, not the YAML: auto promises the fastest precision that keeps the
    answers, so each must beat fp32 here (a Xeon whose AMX the hypervisor hides runs bf16 1.5x slower than fp32).
    A precision named in the YAML is tried as asked."""
    if DType.AUTO not in configured:
        return ()
    return tuple(p for p in precisions if p in (DType.BFLOAT16, DType.FLOAT16) and p not in configured)
