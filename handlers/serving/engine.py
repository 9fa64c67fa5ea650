"""The serving core, free of TorchServe: config -> model -> ladder -> READY, then batches in, answers out.

``Engine`` keeps the lifecycle (``State``: requests before READY or after a failed load get ModelNotReady, 503) and
the order of the steps; each step is its own part: the load (``loading``), the worker's cores
(``handlers.cpu.worker_cores``), the request path (``requests``), the batch through the served forward
(``batching``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from handlers.config import Choice, DType, HandlerConfig
from handlers.config.shapes import ShapePolicy
from handlers.cpu.worker_cores import WorkerCores
from handlers.errors import InferenceError, ModelNotReady
from handlers.ladder import Attempt, summarize
from handlers.ladder.guard import GuardedForward
from handlers.models.files import SAVE_PRETRAINED, ModelFiles
from handlers.precision import choice
from handlers.rungs import compile_cache
from handlers.rungs.compile_cache import CacheDir
from handlers.serving.batching import BatchForward, BatchStats
from handlers.serving.length_groups import LengthGrouping
from handlers.serving.loading import Loaded, Loader
from handlers.serving.requests import Requests, V2Pending
from handlers.tasks import Task, check_task
from handlers.tasks.base import Emit

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class Engine:
    """One model: ``load()`` once, then ``predict(bodies)`` per batch, ``describe()`` any time."""

    def __init__(self, config: HandlerConfig, model_root: Path, device: torch.device, model_name: str,
                 cache: CacheDir | None = None, model_version: str | None = None, files: ModelFiles = SAVE_PRETRAINED):
        """``cache``: the compile cache already prepared by the caller (the TorchServe adapter does so before
        the config is validated); None prepares the configured one at load. ``files``: the archive's
        ``--model-file`` and ``--serialized-file`` (none: a save_pretrained directory)."""
        self.config = config
        self.model_root = Path(model_root)
        self.device = device
        self.model_name = model_name
        self.model_version = model_version
        self.cache = cache
        self.files = files
        self.state = State.LOADING
        self.failure: str | None = None
        self.load_seconds: float | None = None
        self.batches = 0
        self.max_batch_requests = 0
        self.last_batch = BatchStats()
        self.precisions = _precisions(config, device, self.model_root)  # to try, fastest first
        self.cpu = WorkerCores(config.settings.threads, config.workers, device)
        self.loaded: Loaded | None = None
        self._requests: Requests | None = None

    def load(self) -> None:
        started = time.perf_counter()
        for warning in self.config.warnings:
            logger.warning("config: %s", warning)
        try:
            with self.cpu.loading(self.model_name, self.config.startup_timeout / 2):
                if self.cache is None:
                    self.cache = compile_cache.prepare(self.config.settings.compile_cache)
                self.loaded = Loader(self.config, self.model_root, self.device, self.model_name, self.cache,
                                     self.precisions, self.cpu, self.files).load()
            self.cpu.runs_at = self.loaded.result.threads
            self._requests = Requests(self.loaded.task, self.model_name, self.model_version)
        except Exception as exc:
            self.state, self.failure = State.FAILED, summarize(exc)
            logger.error("model %s failed to load: %s", self.model_name, self.failure)
            raise
        self.load_seconds = round(time.perf_counter() - started, 3)
        self.state = State.READY
        logger.info("model %s READY on rung %s after %.1fs", self.model_name, self.active_rung, self.load_seconds)

    def predict(self, bodies: Sequence[Any], emit: Emit | None = None) -> list[Any]:
        """One answer per body, in order: a JSON-able result, or the HandlerError for that body alone.
        ``emit`` receives streamed chunks keyed by body index, for the requests that asked to stream. An Open
        Inference (KServe v2) body is read as the task body it maps to, and answered in the protocol's shape."""
        if self.state is not State.READY or self._requests is None:
            raise ModelNotReady(f"model {self.model_name} is {self.state.value}, not ready")
        with self.cpu.batch():
            return self._predict(bodies, emit)

    def _predict(self, bodies: Sequence[Any], emit: Emit | None) -> list[Any]:
        requests, task = self._requests, self.task
        assert requests is not None and task is not None
        answers: list[Any] = [None] * len(bodies)
        self.last_batch = stats = BatchStats(requests=len(bodies))
        clock = _StageClock(stats.milliseconds)
        v2: V2Pending = {}
        parsed = requests.parse(bodies, answers, v2)
        clock.lap("parse")
        encoded = requests.preprocess(parsed, answers)
        clock.lap("preprocess")
        if parsed:
            body_of = list(parsed)  # request index -> body index
            stream = None if emit is None else (
                lambda chunks: emit({body_of[request]: chunk for request, chunk in chunks.items()}))
            try:
                with self.cpu.forward(self._forward_tokens(encoded)) as threads:
                    stats.threads = threads
                    clock.lap("cores")
                    outputs = task.run(self._batch_forward(stats), encoded, stream)
                    self._synchronize()  # a GPU runs it asynchronously: its time is the forward's, not postprocess's
            except InferenceError:
                raise
            except Exception as exc:
                logger.exception("eager forward failed too on a batch of %d requests", len(parsed))
                raise InferenceError("inference failed for this batch") from exc
            clock.lap("forward")
            results = task.postprocess(outputs, encoded, list(parsed.values()))
            clock.lap("postprocess")
            if len(results) != len(parsed):
                raise InferenceError(f"task returned {len(results)} answers for {len(parsed)} requests")
            for index, result in zip(parsed, results, strict=True):
                answers[index] = result
        requests.in_protocol(answers, v2)
        self.batches += 1
        self.max_batch_requests = max(self.max_batch_requests, len(bodies))
        return answers

    def _batch_forward(self, stats: BatchStats) -> BatchForward:
        """The served forward as this batch's task runs it, counting its tokens into ``stats``."""
        loaded = self.loaded
        assert loaded is not None
        return BatchForward(loaded.guard, loaded.shapes, loaded.task.pad_values, self._on_device, loaded.lengths,
                            stats, loaded.task.pads_sequence)

    def forward_batch(self, inputs: Any) -> Any:
        """A batch of model inputs through the served forward, as a task runs it (``BatchForward.forward_batch``)."""
        return self._batch_forward(self.last_batch).forward_batch(inputs)

    def forward_step(self, **inputs: Any) -> Any:
        """One guarded call at exactly these shapes (a task's loop pads them to a warmed bucket itself)."""
        assert self.guard is not None
        return self.guard(**inputs)

    def _forward_tokens(self, encoded: Any) -> int | None:
        """The batch's tokens as it arrives (rows x length), where the idle rule asks and its task runs one forward
        of them; else None."""
        task = self.task
        ids = encoded.inputs.get("input_ids") if self.cpu.idle_cores and task and task.runs_one_forward else None
        return None if ids is None else int(ids.numel())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _on_device(self, batch: Any) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.device) for name, tensor in batch.items()}

    @property
    def task(self) -> Task | None:
        return self.loaded.task if self.loaded else None

    @property
    def guard(self) -> GuardedForward | None:
        return self.loaded.guard if self.loaded else None

    @property
    def shapes(self) -> ShapePolicy:
        """The shapes the served forward sees (before the load: the YAML's policy)."""
        return self.loaded.shapes if self.loaded else self.config.settings.shapes

    @property
    def lengths(self) -> LengthGrouping | None:
        return self.loaded.lengths if self.loaded else None

    @property
    def dtype(self) -> Choice:
        """The precision served, and why."""
        return self.loaded.dtype if self.loaded else Choice(self.precisions.value[0], "not loaded yet")

    @property
    def attempts(self) -> list[Attempt]:
        return self.loaded.result.attempts if self.loaded else []

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths under the model's URL its task answers besides the URL itself (``Task.paths``)."""
        return self.task.paths if self.task is not None else ()

    @property
    def active_rung(self) -> str | None:
        return self.guard.active if self.guard else None

    @property
    def runtime_failures(self) -> int:
        return self.guard.failures if self.guard else 0

    def runtime_counters(self) -> dict[str, Any]:
        """The serving rung and what happened after READY so far (for per-batch metrics)."""
        guard = self.guard
        return {"active": self.active_rung or "none", "runtime_failures": guard.failures if guard else 0,
                "compiles_after_ready": guard.compiles if guard else 0,
                "eager_batches": guard.eager_batches if guard else 0,
                "frames_given_up": guard.frames_given_up if guard else 0}

    def describe(self) -> dict[str, Any]:
        settings, loaded = self.config.settings, self.loaded
        optimization = {
            "active": self.active_rung,
            "attempts": [attempt.to_json() for attempt in self.attempts],
            "device": str(self.device),
            "dtype": self.dtype.value.value,
            "dtype_reason": self.dtype.reason,
            "int8_calibration": loaded.result.calibration if loaded else None,
            "int8_weights": loaded.int8_weights if loaded else None,
            "precisions": {"tried_in_order": [p.value for p in self.precisions.value],
                           "reason": self.precisions.reason},
            "threads": self.cpu.describe(),
            "torch": torch.__version__,
            "requested_compile": self.config.served_compile.describe() if self.config.compile.enabled else None,
            "module_guards": loaded.result.module_guards if loaded else None,
            "rung_race": loaded.result.rung_race if loaded else None,
            "notes": loaded.notes if loaded else [],
            "attention": loaded.attention.describe() if loaded else None,
            "shapes": self.shapes.describe(),
            "length_groups": self.lengths.describe() if self.lengths else None,
            "compile_cache": ({**self.cache.describe(), "use_at_load": loaded.cache_use if loaded else None,
                               "archive_artifacts": loaded.artifacts if loaded else None} if self.cache else None),
            "runtime": self.guard.describe() if self.guard else None,
        }
        return {
            "state": self.state.value,
            "failure": self.failure,
            "task": settings.task,
            "model": self.files.describe(),
            "inputs": self.task.describe_inputs() if self.task else None,
            "outputs": self.task.describe_outputs() if self.task else None,
            "load_seconds": self.load_seconds,
            "load_waited_s": self.cpu.waited_s,
            "load_waited_for": list(self.cpu.waited_for),
            "optimization": optimization,
            "batches": {"count": self.batches, "max_requests": self.max_batch_requests},
            "config_warnings": list(self.config.warnings),
        }


def _precisions(config: HandlerConfig, device: torch.device, model_root: Path) -> Choice:
    """The precisions to try, fastest first: the YAML's ``dtype`` on this hardware; float32 alone for a task that
    serves nothing else."""
    precisions = choice.resolve_precisions(config.settings.dtype, device)
    float32_only = check_task(config.settings.task, import_dir=model_root).facts().float32_only
    if float32_only and precisions.value != (DType.FLOAT32,):
        return Choice((DType.FLOAT32,), f"{config.settings.task} serves float32: {float32_only}")
    return precisions


class _StageClock:
    """Milliseconds since the previous lap, recorded under each stage's name."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.into[stage] = round((now - self.last) * 1000, 3)
        self.last = now
