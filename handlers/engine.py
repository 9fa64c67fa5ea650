"""The serving core, free of TorchServe: config -> model -> ladder -> READY, then batches in, answers out.

Lifecycle is explicit (``State``): requests before READY or after a failed load get ModelNotReady (503).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from handlers.config import HandlerConfig, WarmupSpec
from handlers.errors import ConfigError, InferenceError, InvalidInput, ModelNotReady
from handlers.ladder import Attempt, GuardedForward, build_ladder, run_ladder, summarize
from handlers.modeling import load_pretrained, resolve_max_length
from handlers.tasks import Task, check_task

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class Engine:
    """One model: ``load()`` once, then ``predict(bodies)`` per batch, ``describe()`` any time."""

    def __init__(self, config: HandlerConfig, model_root: Path, device: torch.device, model_name: str):
        self.config = config
        self.model_root = Path(model_root)
        self.device = device
        self.model_name = model_name
        self.state = State.LOADING
        self.failure: str | None = None
        self.load_seconds: float | None = None
        self.attempts: list[Attempt] = []
        self.batches = 0
        self.max_batch_requests = 0
        self._task: Task | None = None
        self._guard: GuardedForward | None = None

    def load(self) -> None:
        started = time.perf_counter()
        for warning in self.config.warnings:
            logger.warning("config: %s", warning)
        try:
            self._load()
        except Exception as exc:
            self.state, self.failure = State.FAILED, summarize(exc)
            logger.error("model %s failed to load: %s", self.model_name, self.failure)
            raise
        self.load_seconds = round(time.perf_counter() - started, 3)
        self.state = State.READY
        logger.info("model %s READY on rung %s after %.1fs", self.model_name, self.active_rung, self.load_seconds)

    def _load(self) -> None:
        settings = self.config.settings
        task_class = check_task(settings.task)
        model_dir = self.model_root / settings.model_dir
        model, tokenizer = load_pretrained(model_dir, task_class.model_class, settings.dtype.torch, self.device)
        max_length = resolve_max_length(model_dir, model, tokenizer, settings.max_length)
        _check_warmup(settings.warmup, max_length)
        self._task = task_class(tokenizer, max_length, settings.max_inputs_per_request, self.model_name)
        module = self._task.build_module(model)
        batches = [self._on_device(batch) for batch in self._task.warmup_batches(settings.warmup.shapes())]
        result = run_ladder(module, build_ladder(self.config, self.device), batches, settings.tolerance)
        self.attempts = result.attempts
        self._guard = GuardedForward(result, module, settings.max_runtime_failures)

    @property
    def active_rung(self) -> str | None:
        return self._guard.active if self._guard else None

    @property
    def runtime_failures(self) -> int:
        return self._guard.failures if self._guard else 0

    def predict(self, bodies: Sequence[Any]) -> list[Any]:
        """One answer per body, in order: a JSON-able result, or the HandlerError for that body alone."""
        if self.state is not State.READY or self._task is None or self._guard is None:
            raise ModelNotReady(f"model {self.model_name} is {self.state.value}, not ready")
        answers: list[Any] = [None] * len(bodies)
        parsed: dict[int, Any] = {}
        for index, body in enumerate(bodies):
            try:
                parsed[index] = self._task.parse(body)
            except InvalidInput as exc:
                answers[index] = exc
        if parsed:
            requests = list(parsed.values())
            inputs = self._task.preprocess(requests)
            try:
                outputs = self._guard(**self._on_device(inputs))
            except Exception as exc:
                logger.exception("eager forward failed too on a batch of %d requests", len(requests))
                raise InferenceError("inference failed for this batch") from exc
            results = self._task.postprocess(outputs, inputs, requests)
            if len(results) != len(requests):
                raise InferenceError(f"task returned {len(results)} answers for {len(requests)} requests")
            for index, result in zip(parsed, results, strict=True):
                answers[index] = result
        self.batches += 1
        self.max_batch_requests = max(self.max_batch_requests, len(bodies))
        return answers

    def _on_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.device) for name, tensor in batch.items()}

    def describe(self) -> dict[str, Any]:
        settings = self.config.settings
        optimization = {
            "active": self.active_rung,
            "attempts": [attempt.to_json() for attempt in self.attempts],
            "device": str(self.device),
            "dtype": settings.dtype.value,
            "torch": torch.__version__,
            "requested_compile": self.config.compile.describe() if self.config.compile.enabled else None,
            "runtime": self._guard.describe() if self._guard else None,
        }
        return {
            "state": self.state.value,
            "failure": self.failure,
            "task": settings.task,
            "load_seconds": self.load_seconds,
            "optimization": optimization,
            "batches": {"count": self.batches, "max_requests": self.max_batch_requests},
            "config_warnings": list(self.config.warnings),
        }


def _check_warmup(warmup: WarmupSpec, max_length: int) -> None:
    too_long = [length for length in warmup.seq_lengths if length > max_length]
    if too_long:
        raise ConfigError(f"pt2_handlers.warmup.seq_lengths {too_long} exceed max_length {max_length}")
