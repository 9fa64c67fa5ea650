"""The serving core, free of TorchServe: config -> model -> ladder -> READY, then batches in, answers out.

Lifecycle is explicit (``State``): requests before READY or after a failed load get ModelNotReady (503).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from handlers.config import Attention, Choice, DType, HandlerConfig, ModuleGuards
from handlers.config.shapes import ShapePolicy, concat_rows, gather_rows, pad_batch, split_rows, take_rows
from handlers.cpu import features, fused_attention, idle_cores, openmp_pause
from handlers.cpu import threads as cpu_threads
from handlers.errors import HandlerError, InferenceError, ModelLoadError, ModelNotReady, native_panic
from handlers.ladder import Attempt, AttemptStatus, Calibration, LadderResult, run_ladder, summarize
from handlers.ladder import decisions as memory
from handlers.ladder.guard import GuardedForward
from handlers.models.pretrained import load_pretrained, resolve_max_length
from handlers.precision import choice
from handlers.rungs import CompileRung, build_ladder, compile_cache
from handlers.rungs.compile_cache import CacheDir
from handlers.serving import length_groups
from handlers.tasks import Task, calibration, check_task, open_inference
from handlers.tasks.base import Emit, decode_body

logger = logging.getLogger(__name__)


class State(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class BatchStats:
    """What one batch cost, for metrics: milliseconds per stage, and how much of what ran was padding."""

    requests: int = 0
    milliseconds: dict[str, float] = field(default_factory=dict)  # parse, preprocess, forward, postprocess
    real_tokens: int = 0  # tokens of the requests' texts, in the rows forward_batch ran
    run_tokens: int = 0  # rows x sequence as run, after padding to the batch and to a shape bucket
    threads: int = 0  # the forward's intra-op threads (handlers.cpu.core_share)

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.real_tokens / self.run_tokens if self.run_tokens else 0.0


class Engine:
    """One model: ``load()`` once, then ``predict(bodies)`` per batch, ``describe()`` any time."""

    def __init__(self, config: HandlerConfig, model_root: Path, device: torch.device, model_name: str,
                 cache: CacheDir | None = None, model_version: str | None = None):
        """``cache``: the compile cache already prepared by the caller (the TorchServe adapter does so before
        the config is validated); None prepares the configured one at load."""
        self.config = config
        self.model_root = Path(model_root)
        self.device = device
        self.model_name = model_name
        self.model_version = model_version
        self.cache = cache
        self.state = State.LOADING
        self.failure: str | None = None
        self.load_seconds: float | None = None
        self.load_waited_s: float = 0.0  # of load_seconds: waiting for other workers on these cores to load
        self.load_waited_for: tuple[str, ...] = ()  # the models those workers loaded
        self.attempts: list[Attempt] = []
        # whether compiles guard the model's attributes (handlers.rungs.module_guards)
        self.module_guards: str | None = None
        self.int8_calibration: str | None = None  # int8 was tried: what it was calibrated on and judged on
        self.int8_weights: str | None = None  # int8 was tried: the range its weights took on this CPU, and why
        self.cache_use: dict[str, dict[str, int]] | None = None  # what the compile caches served at load
        self.notes: list[str] = []
        self.attention: fused_attention.Outcome | None = None  # which attention the compiled graphs run
        self.batches = 0
        self.max_batch_requests = 0
        self.last_batch = BatchStats()
        self.precisions = choice.resolve_precisions(config.settings.dtype, device)  # to try, fastest first
        float32_only = check_task(config.settings.task).facts().float32_only
        if float32_only and self.precisions.value != (DType.FLOAT32,):
            self.precisions = Choice((DType.FLOAT32,), f"{config.settings.task} serves float32: "
                                                                f"{float32_only}")
        self.dtype = Choice(self.precisions.value[0], "not loaded yet")  # the precision served
        self.threads = cpu_threads.resolve_threads(config.settings.threads, config.workers, device)  # at load
        self.load_threads = self.threads.value  # fewer while other workers serve on shared cores
        self.cores = cpu_threads.core_share(config.settings.threads, device)  # None: every forward at self.threads
        self._runs_at: tuple[int, ...] | None = None  # the thread counts the served forward was proven at; None: any
        # fewer threads for a small forward after idle virtual cores (only where cores are shared forward by forward)
        self.idle_cores = idle_cores.for_cpu(features.linux_cpu_flags()) if self.cores is not None else None
        self._forward_ended: float | None = None  # time.monotonic() when this engine's last forward ended
        # on shared cores, a forward that followed another worker's ends its OpenMP threads (handlers.cpu.openmp_pause)
        self.openmp_pause = openmp_pause.OpenMPPause() if self.cores is not None else None
        self.openmp_pauses = 0  # forwards after which it did
        self.shapes: ShapePolicy = config.settings.shapes
        self._task: Task | None = None
        self._guard: GuardedForward | None = None
        self.length_cost: length_groups.CostModel | None = None  # rows of mixed lengths run in groups by it
        self._look_again: length_groups.LookAgain | None = None  # without one at load: a sibling's, kept since
        self._no_length_cost: length_groups.NoCostModel | None = None  # why there is none, for describe

    def load(self) -> None:
        started = time.perf_counter()
        for warning in self.config.warnings:
            logger.warning("config: %s", warning)
        try:
            with self._turn_to_load():
                self._load()
        except Exception as exc:
            self.state, self.failure = State.FAILED, summarize(exc)
            logger.error("model %s failed to load: %s", self.model_name, self.failure)
            raise
        self.load_seconds = round(time.perf_counter() - started, 3)
        self.state = State.READY
        logger.info("model %s READY on rung %s after %.1fs", self.model_name, self.active_rung, self.load_seconds)

    @contextmanager
    def _turn_to_load(self) -> Iterator[None]:
        """Workers on the cores this one shares load one after another, whatever model they load
        (``CoreShare.loading``), each on every core: it measures on cores the others leave quiet, at the count it runs
        at alone, and the next worker of a model loads from what the first kept. Measured on CPU D, cold: the int8
        archive with ``minWorkers: 2``, both READY after 108-110 s loading beside each other, after 80 and 98 s in
        turn; on CPU A (an AMD EPYC) the default and the int8 archive started together, READY after 116 and 185 s,
        in turn after 44 and 147 s.
        Beside workers that already serve clients, it loads on its share of the cores and leaves them the rest, so
        their clients keep being served while it loads."""
        if self.cores is None:
            yield
            return
        wait_s = self.config.startup_timeout / 2
        with self.cores.loading(self.model_name, wait_s) as turn:
            self.load_waited_s, self.load_waited_for = turn.waited_s, turn.waited_for
            if turn.alone and self.threads.value != self.cores.cores:
                self.threads = Choice(self.cores.cores, (
                    f"auto: {self.cores.cores} usable cores (CPU affinity and limit); workers on them load in "
                    "turn, each on all of them, and share them forward by forward once READY (per_forward)"))
            models = ", ".join("this model" if name == self.model_name else name for name in turn.waited_for)
            if not turn.alone:
                logger.warning("load: another worker still loads on these cores after %.0fs (half of startupTimeout; "
                               "waited for: %s); loading beside it", turn.waited_s, models or "model unknown")
            elif turn.waited_s > 0:  # any wait: an operator reading the log sees why this load took longer
                logger.info("load: waited %.1fs for the loads of other workers on these cores (%s): workers on them "
                            "load one at a time%s", turn.waited_s, models or "model unknown",
                            "; this one loads from what that worker kept" if self.model_name in turn.waited_for
                            else "")
            # Measurements and what it keeps stay under the count it serves at alone (self.threads): a sibling's
            # are found, and a race ranks its rungs alike on fewer cores.
            self.load_threads = min(turn.threads, self.threads.value)
            shared = turn.serving and self.load_threads < self.cores.cores
            if shared:
                logger.info("load: %d other worker(s) serve on these %d cores: this one loads on %d of them (and "
                            "compiles kernels in as many processes) and leaves their forwards the rest until READY",
                            turn.serving, self.cores.cores, self.load_threads)
            elif turn.serving:
                logger.info("load: %d other worker(s) on these %d cores are READY but idle: this one loads on "
                            "every core, and their forwards take an equal share until READY", turn.serving,
                            self.cores.cores)
            with _compile_processes(self.load_threads) if shared else nullcontext():
                yield
            if self.openmp_pause is not None:  # within the turn: no sibling loads meanwhile
                self.openmp_pause.measure(self.cores.cores)
        self.cores.serves()

    def _load(self) -> None:
        settings = self.config.settings
        if self.cache is None:
            self.cache = compile_cache.prepare(settings.compile_cache)
        torch.set_num_threads(self.load_threads)
        task_class = check_task(settings.task)
        model_dir = (self.model_root / settings.model_dir).resolve()
        if not model_dir.is_relative_to(self.model_root.resolve()):  # "../x" or a link out of the archive
            raise ModelLoadError(f"pt2_handlers.model_dir {settings.model_dir!r} leads outside the model archive "
                                 f"({self.model_root}); name a directory inside it, e.g. model")
        # fp32 first: it is the reference every rung is judged against, and the eager fallback.
        model, tokenizer = load_pretrained(model_dir, task_class.model_class, torch.float32, self.device)
        max_length = resolve_max_length(model_dir, model, tokenizer, settings.max_length)
        self.shapes = settings.shapes.fitted(max_length)
        self._task = task_class(tokenizer, max_length, settings.max_inputs_per_request, self.model_name,
                                settings.too_long, model_dir=model_dir)
        reference = self._task.build_module(model)
        batches = [self._on_device(batch) if isinstance(batch, Mapping) else batch
                   for batch in self._task.warmup_batches(self.shapes.warmup_shapes())]
        no_cache = None if self.cache.path else f"no writable compile cache: {self.cache.warning}"
        rungs = build_ladder(self.config, self.device, compile_unavailable=no_cache,
                             inductor_unavailable=features.cpp_compiler_problem(self.device),
                             threads_follow=self.cores is not None)
        self.notes = [note for rung in rungs for note in rung.notes(self.device)]
        self.attention = fused_attention.use_in_compiled_graphs(
            model, self.device, Path(self.cache.path) / fused_attention.DIRECTORY if self.cache.path else None,
            wanted=settings.attention is Attention.AUTO, causal=task_class.facts().causal_attention,
            backends={rung.spec.backend for rung in rungs
                      if isinstance(rung, CompileRung) and rung.unavailable_reason() is None})
        logger.info("attention in compiled graphs: %s", self.attention.summary())
        cache_before = compile_cache.use_counters()
        precisions: tuple[DType, ...] = self.precisions.value
        int8_weights = choice.int8_weights()
        result = run_ladder(reference, precisions, rungs, batches,
                            lambda dtype: task_class.quality_gate(dtype, settings.quality_gate), run=self._task.prove,
                            calibration=self._int8_calibration(batches) if DType.INT8 in precisions else None,
                            half_must_pay=_picked_by_auto(precisions, settings.dtype),
                            memory=memory.Memory(Path(self.cache.path) / memory.DIRECTORY) if self.cache.path else None,
                            # races kept per machine and attention kernel: a changed kernel races again
                            machine=repr((features.machine(self.device, self.threads.value), self.attention.identity)),
                            thread_counts=self._thread_counts(), int8_weights=int8_weights,
                            module_guards_optional=settings.module_guards is ModuleGuards.AUTO)
        self.cache_use = compile_cache.use_since(cache_before)
        logger.info("compile cache %s: %s", self.cache.path, ", ".join(
            f"{cache} {use['hit']} hit / {use['miss']} missed / {use['bypass']} bypassed"
            for cache, use in self.cache_use.items()))
        self.attempts = result.attempts
        self.module_guards = result.module_guards
        self.int8_calibration = result.calibration
        self.int8_weights = int8_weights.describe() if DType.INT8 in precisions else None
        self.dtype = Choice(result.dtype, _why_served(result, precisions, self.precisions.reason))
        served = next(rung for rung in rungs if rung.name == result.active)  # eager is always among them
        self.shapes = self.shapes.for_served(kernels_per_shape=served.keeps_kernels_per_shape(result.dtype))
        self._guard = GuardedForward(result, reference, settings.max_runtime_failures, self.shapes.after_ready)
        self._runs_at = result.threads
        if self._task.row_outputs and self.shapes.length_groups:
            self._measure_length_cost(result, reference, batches)

    def _measure_length_cost(self, result: LadderResult, reference: torch.nn.Module, batches: list[Any]) -> None:
        # Kept beside the compile cache for the next worker of this forward on this machine, as the races are.
        kept = memory.Memory(Path(self.cache.path) / memory.DIRECTORY) if self.cache.path else None
        key = None
        if kept is not None:
            served = (result.active, result.dtype.value, repr(self.config.served_compile), self.shapes.describe(),
                      features.machine(self.device, self.threads.value))
            weights_key = result.weights_key or memory.fingerprint(tensors=reference.state_dict().items())
            key = length_groups.kept_key(batches, served, weights_key)
        measured = length_groups.measure(result.forward, batches, synchronize=self._synchronize, kept=kept, key=key)
        if isinstance(measured, length_groups.CostModel):
            self.length_cost = measured
            logger.info("length groups: %s", measured.describe())
            return
        self._no_length_cost = measured
        if kept is not None and key is not None:
            self._look_again = length_groups.LookAgain(kept, key)

    def _length_cost_now(self) -> length_groups.CostModel | None:
        """The cost model; a worker that had none at load looks for one a sibling kept since."""
        if self.length_cost is None and self._look_again is not None:
            self.length_cost = self._look_again()
            if self.length_cost is not None:
                self._look_again, self._no_length_cost = None, None
                logger.info("length groups: the model another worker of this forward kept since: %s",
                            self.length_cost.describe())
        return self.length_cost

    @property
    def active_rung(self) -> str | None:
        return self._guard.active if self._guard else None

    @property
    def runtime_failures(self) -> int:
        return self._guard.failures if self._guard else 0

    def runtime_counters(self) -> dict[str, Any]:
        """The serving rung and what happened after READY so far (for per-batch metrics)."""
        guard = self._guard
        return {"active": self.active_rung or "none", "runtime_failures": guard.failures if guard else 0,
                "compiles_after_ready": guard.compiles if guard else 0,
                "eager_batches": guard.eager_batches if guard else 0,
                "frames_given_up": guard.frames_given_up if guard else 0}

    def predict(self, bodies: Sequence[Any], emit: Emit | None = None) -> list[Any]:
        """One answer per body, in order: a JSON-able result, or the HandlerError for that body alone.
        ``emit`` receives streamed chunks keyed by body index, for the requests that asked to stream. An Open
        Inference (KServe v2) body is read as the task body it maps to, and answered in the protocol's shape."""
        if self.state is not State.READY or self._task is None or self._guard is None:
            raise ModelNotReady(f"model {self.model_name} is {self.state.value}, not ready")
        with self.cores.batch() if self.cores else nullcontext():
            return self._predict(bodies, emit)

    def _predict(self, bodies: Sequence[Any], emit: Emit | None) -> list[Any]:
        assert self._task is not None
        answers: list[Any] = [None] * len(bodies)
        self.last_batch = stats = BatchStats(requests=len(bodies))
        clock = _StageClock(stats.milliseconds)
        v2: dict[int, tuple[open_inference.InferRequest, Any] | None] = {}  # body index -> request, task body
        parsed = self._parse(bodies, answers, v2)
        clock.lap("parse")
        encoded = self._preprocess(parsed, answers)
        clock.lap("preprocess")
        if parsed:
            requests = list(parsed.values())
            body_of = list(parsed)  # request index -> body index
            stream = None if emit is None else (
                lambda chunks: emit({body_of[request]: chunk for request, chunk in chunks.items()}))
            try:
                with self._threads_for_forward(self._forward_tokens(encoded)) as threads:
                    stats.threads = threads
                    clock.lap("cores")
                    outputs = self._task.run(self, encoded, stream)
                    self._synchronize()  # a GPU runs it asynchronously: its time is the forward's, not postprocess's
            except InferenceError:
                raise
            except Exception as exc:
                logger.exception("eager forward failed too on a batch of %d requests", len(requests))
                raise InferenceError("inference failed for this batch") from exc
            clock.lap("forward")
            results = self._task.postprocess(outputs, encoded, requests)
            clock.lap("postprocess")
            if len(results) != len(requests):
                raise InferenceError(f"task returned {len(results)} answers for {len(requests)} requests")
            for index, result in zip(parsed, results, strict=True):
                answers[index] = result
        for index, pending in v2.items():
            answers[index] = self._open_inference_answer(answers[index], pending)
        self.batches += 1
        self.max_batch_requests = max(self.max_batch_requests, len(bodies))
        return answers

    def _parse(self, bodies: Sequence[Any], answers: list[Any],
               v2: dict[int, tuple[open_inference.InferRequest, Any] | None]) -> dict[int, Any]:
        """Each body read on its own (body index -> request); a failure becomes that body's answer. v2 bodies are
        noted in ``v2`` (None where the v2 body itself is invalid)."""
        parsed: dict[int, Any] = {}
        for index, body in enumerate(bodies):
            try:
                body = decode_body(body)
                if open_inference.is_request(body):
                    v2[index] = None
                    request = open_inference.parse_request(body)
                    body = self._task.from_open_inference(request.texts, request.parameters)
                    v2[index] = (request, body)
                parsed[index] = self._task.parse(body)
            except HandlerError as exc:
                answers[index] = exc
            except BaseException as exc:  # a bug reading one request must not fail its neighbours
                if not isinstance(exc, Exception) and not native_panic(exc):
                    raise
                answers[index] = self._request_failed(exc, "parse")
        return parsed

    def _open_inference_answer(self, answer: Any, pending: tuple[open_inference.InferRequest, Any] | None) -> Any:
        """A v2 request's answer as the protocol's response, or its error as ``{"error": ...}``."""
        if pending is not None and not isinstance(answer, HandlerError):
            request, body = pending
            try:
                answer = open_inference.response(request, self._task.to_open_inference(answer, body),
                                                 self.model_name, self.model_version)
            except HandlerError as exc:
                answer = exc
            except Exception as exc:  # a bug formatting one answer must not fail its neighbours
                answer = self._request_failed(exc, "format")
        return open_inference.OpenInferenceError(answer) if isinstance(answer, HandlerError) else answer

    def _preprocess(self, parsed: dict[int, Any], answers: list[Any]) -> Any:
        """The parsed requests collated into one batch. If collating fails, each request is tried alone: the ones
        that fail get their own error (and leave ``parsed``), the rest are collated without them."""
        if not parsed:
            return None
        try:
            return self._task.preprocess(list(parsed.values()))
        except BaseException as exc:  # noqa: BLE001 - isolated below, request by request
            if not isinstance(exc, Exception) and not native_panic(exc):
                raise
            logger.warning("preprocess failed on a batch of %d requests; retrying each alone", len(parsed))
        for index, request in list(parsed.items()):
            try:
                self._task.preprocess([request])
            except BaseException as exc:  # noqa: BLE001
                if not isinstance(exc, Exception) and not native_panic(exc):
                    raise
                answers[index] = exc if isinstance(exc, HandlerError) else self._request_failed(exc, "preprocess")
                del parsed[index]
        return self._task.preprocess(list(parsed.values())) if parsed else None

    @staticmethod
    def _request_failed(exc: BaseException, stage: str) -> InferenceError:
        logger.error("%s failed on one request: %s", stage, summarize(exc), exc_info=exc)
        return InferenceError(f"the server failed to {stage} this request ({type(exc).__name__}); it is logged")

    def _forward_tokens(self, encoded: Any) -> int | None:
        """The batch's tokens as it arrives (rows x length), where the idle rule asks and its task runs one forward
        of them; else None."""
        assert self._task is not None
        ids = encoded.inputs.get("input_ids") if self.idle_cores and self._task.runs_one_forward else None
        return None if ids is None else int(ids.numel())

    @contextmanager
    def _threads_for_forward(self, tokens: int | None = None) -> Iterator[int]:
        """The intra-op threads this batch's forward runs on, held until it ends: its share of the cores the
        machine's workers share (``handlers.cpu.core_share``), fewer for a small batch after idle virtual cores
        (``handlers.cpu.idle_cores``), else the count it loaded with."""
        if self.cores is None:
            yield self.threads.value
            return
        runs_at: Collection[int] | None = self._runs_at
        if self.idle_cores is not None:
            idle = None if self._forward_ended is None else time.monotonic() - self._forward_ended
            runs_at = self.idle_cores.counts(runs_at, tokens, idle)
        threads, after_another = 1, False
        try:
            with self.cores.forward(runs_at) as grant:
                threads, after_another = grant.threads, grant.after_another
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                yield threads
        finally:
            self._forward_ended = time.monotonic()
            if self.openmp_pause is not None and self.openmp_pause.pays and threads > 1 and after_another:
                self.openmp_pauses += self.openmp_pause()

    def _thread_counts(self) -> tuple[int, ...]:
        """The thread counts a forward may be given: the count it loads with, and with shared cores every core
        (alone) and half of them (beside another worker's forward)."""
        if self.cores is None:
            return (self.threads.value,)
        return tuple(sorted({self.threads.value, self.cores.cores, max(1, self.cores.cores // 2)}))

    def forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Run the batch at the shape policy's shapes: chunks of at most the largest batch bucket, each padded
        up to its bucket, outputs sliced back to the real rows. Where the task answers one row per text, the rows
        run in groups of similar length, each trimmed to its longest, where the cost model says that is cheaper
        (``handlers.serving.length_groups``); the outputs come back in the batch's order."""
        assert self._guard is not None and self._task is not None
        outputs = []
        mask = inputs.get("attention_mask")
        rows, seq = next(iter(inputs.values())).shape[:2]
        self.last_batch.real_tokens += int(mask.sum()) if mask is not None else rows * seq
        cost = self._length_cost_now()
        groups = None if cost is None or mask is None else length_groups.row_groups(
            mask, self.shapes.max_batch, lambda rows, seq: cost.ms(*self.shapes.serving_shape(rows, seq)))
        chunks = split_rows(inputs, self.shapes.max_batch) if groups is None else length_groups.take_groups(
            inputs, mask, groups)
        for chunk in chunks:
            rows, seq = next(iter(chunk.values())).shape[:2]
            shape = self.shapes.serving_shape(rows, seq)
            self.last_batch.run_tokens += shape[0] * shape[1]
            padded = pad_batch(chunk, shape, self._task.pad_values)
            outputs.append(take_rows(self._guard(**self._on_device(padded)), rows))
        joined = concat_rows(outputs)
        if groups is None:
            return joined
        order = torch.tensor([row for group in groups for row in group])
        return gather_rows(joined, torch.empty_like(order).scatter_(0, order, torch.arange(len(order))))

    def forward_step(self, **inputs: Any) -> Any:
        """One guarded call at exactly these shapes (a task's loop pads them to a warmed bucket itself)."""
        assert self._guard is not None
        return self._guard(**inputs)

    def _int8_calibration(self, warmup: list[dict[str, torch.Tensor]]) -> Calibration:
        """What int8 is calibrated on and judged on besides the warmup: the archive's file, or the warmup batches
        and a vocabulary sample."""
        relative = self.config.settings.int8_calibration
        shapes = self.shapes.warmup_shapes()
        if relative is None:
            found = calibration.held_out_sample(self._task, shapes, warmup)
        else:
            found = calibration.from_texts(self._task, shapes, calibration.read_texts(self.model_root, relative),
                                           relative)
        return replace(found, batches=[self._on_device(batch) for batch in found.batches],
                       held_out=[self._on_device(batch) for batch in found.held_out])

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _on_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.device) for name, tensor in batch.items()}

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths under the model's URL its task answers besides the URL itself (``Task.paths``)."""
        return self._task.paths if self._task is not None else ()

    def describe(self) -> dict[str, Any]:
        settings = self.config.settings
        optimization = {
            "active": self.active_rung,
            "attempts": [attempt.to_json() for attempt in self.attempts],
            "device": str(self.device),
            "dtype": self.dtype.value.value,
            "dtype_reason": self.dtype.reason,
            "int8_calibration": self.int8_calibration,
            "int8_weights": self.int8_weights,
            "precisions": {"tried_in_order": [p.value for p in self.precisions.value],
                           "reason": self.precisions.reason},
            "threads": self._describe_threads(),
            "torch": torch.__version__,
            "requested_compile": self.config.served_compile.describe() if self.config.compile.enabled else None,
            "module_guards": self.module_guards,
            "notes": self.notes,
            "attention": self.attention.describe() if self.attention else None,
            "shapes": self.shapes.describe(),
            "length_groups": self._describe_length_groups(),
            "compile_cache": {**self.cache.describe(), "use_at_load": self.cache_use} if self.cache else None,
            "runtime": self._guard.describe() if self._guard else None,
        }
        return {
            "state": self.state.value,
            "failure": self.failure,
            "task": settings.task,
            "inputs": self._task.describe_inputs() if self._task else None,
            "outputs": self._task.describe_outputs() if self._task else None,
            "load_seconds": self.load_seconds,
            "load_waited_s": self.load_waited_s,
            "load_waited_for": list(self.load_waited_for),
            "optimization": optimization,
            "batches": {"count": self.batches, "max_requests": self.max_batch_requests},
            "config_warnings": list(self.config.warnings),
        }

    def _describe_length_groups(self) -> dict[str, Any] | None:
        """The fitted cost model; else why there is none (every batch runs as one), where the task groups rows."""
        if self.length_cost is not None:
            return self.length_cost.describe()
        if self._no_length_cost is None:
            return None
        said = self._no_length_cost.describe()
        if self._look_again is not None:
            said["looks_again_every_s"] = self._look_again.every_s  # for the model another worker of it keeps
        return said

    def _describe_threads(self) -> dict[str, Any]:
        threads: dict[str, Any] = {"intra_op": self.threads.value, "reason": self.threads.reason,
                                   "at_load": self.load_threads}
        if self.cores is not None:
            runs_at = "/".join(map(str, self._runs_at or ()))
            proven = f", of the counts its compiled forward was proven at ({runs_at})" if self._runs_at else ""
            threads["per_forward"] = (
                f"shared with the other workers on these {self.cores.cores} cores: all of them alone, an equal share "
                f"while other workers hold batches or held them at once in the last {self.cores.remember_s:g}s"
                + proven + ("" if self.idle_cores is None else f"; {self.idle_cores.describe()}"))
        if self.openmp_pause is not None:
            threads["openmp_after_forward"] = (
                f"threads ended after a forward on more than one that followed another worker's on these cores "
                f"({self.openmp_pauses} so far): workers that take requests in turn; alone, left to spin"
                + ("" if self.openmp_pause.restart_ms is None else
                   f"; restarting them cost {self.openmp_pause.restart_ms:g} ms (90th percentile, measured at load)")
                if self.openmp_pause.pays else f"threads left to spin: {self.openmp_pause.why_not}")
        return threads


def _compile_processes(count: int) -> Any:
    """Inductor compiles kernels in a pool of processes, one per core (``compile_threads``): on a share of the cores
    beside busy workers, in ``count`` (1: in this process). Measured on CPU D, a model compiled cold beside a busy
    int8 worker (4 clients): they got 97 req/s, p99 117-141 ms, against 84-86 req/s, p99 167-169 with two processes;
    the load took 3 s longer. Not part of the compile cache's key."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(compile_threads=count)


def _picked_by_auto(precisions: Sequence[DType], configured: Sequence[DType]) -> tuple[DType, ...]:
    """The half precisions that ``auto`` added, not the YAML: auto promises the fastest precision that keeps the
    answers, so each must beat fp32 here (a Xeon whose AMX the hypervisor hides runs bf16 1.5x slower than fp32).
    A precision named in the YAML is tried as asked."""
    if DType.AUTO not in configured:
        return ()
    return tuple(p for p in precisions if p in (DType.BFLOAT16, DType.FLOAT16) and p not in configured)


def _why_served(result: LadderResult, precisions: Sequence[DType], reason: str) -> str:
    """The plan's reason, and why each precision tried before the served one does not serve: it failed the
    quality gate, or (int8) it passed but was not faster here."""
    served = result.dtype
    passed = {attempt.dtype for attempt in result.attempts if attempt.status is AttemptStatus.SLOWER}
    turned_down = precisions[: precisions.index(served)] if served in precisions else precisions
    failed = [p.value for p in turned_down if p.value not in passed]
    slower = [p.value for p in turned_down if p.value in passed]
    why = ([f"{' and '.join(failed)} failed the quality gate"] if failed else []) + (
        [f"{' and '.join(slower)} passed the gate but was not faster here"] if slower else [])
    return f"{reason}; {'; '.join(why)} (see attempts)" if why else reason


class _StageClock:
    """Milliseconds since the previous lap, recorded under each stage's name."""

    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.into[stage] = round((now - self.last) * 1000, 3)
        self.last = now
