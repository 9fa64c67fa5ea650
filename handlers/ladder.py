"""The optimization ladder: try each rung at load time, keep the first one that proves itself.

A rung is accepted only after the warmup batches ran through it *inside* the guard (``torch.compile``
is lazy: graph and codegen failures surface on the first forward, not on the ``compile`` call) and its
outputs passed the task's quality gate against **fp32 eager**, whatever dtype the rung serves in.
Anything else records a reason and moves down. fp32 eager is the reference and the last resort.

``GuardedForward`` protects live traffic: an optimized forward that raises is re-run eagerly, and after
``max_failures`` such batches the guard demotes itself to eager for good. After READY it also applies the
shape policy's stance: a shape that would need a new compile is served eagerly, refused, or compiled.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from handlers.config import CompileSpec, DType, HandlerConfig, RungName
from handlers.errors import InferenceError
from handlers.ipex import IPEX_BACKEND, probe_ipex
from handlers.shapes import AfterReady

logger = logging.getLogger(__name__)

Forward = Callable[..., Any]
Batch = Mapping[str, torch.Tensor]
Run = Callable[[Forward, Any], Any]  # runs one warmup batch through a forward


def call(forward: Forward, batch: Batch) -> Any:
    return forward(**batch)


class AttemptStatus(str, enum.Enum):
    ACCEPTED = "accepted"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Quality:
    """The gate's worst value over the warmup batches (higher is better) and the bar it had to clear."""

    metric: str
    value: float
    threshold: float

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": round(self.value, 6), "threshold": self.threshold}


@dataclass(frozen=True)
class Attempt:
    rung: str
    status: AttemptStatus
    reason: str | None
    seconds: float
    dtype: str | None = None
    quality: Quality | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "status": self.status.value, "reason": self.reason, "seconds": self.seconds,
                "dtype": self.dtype, "quality": self.quality.to_json() if self.quality else None}


class QualityError(AssertionError):
    """An optimized rung's answers are not those of fp32 eager (the gate's value is below its threshold)."""

    def __init__(self, message: str, quality: Quality | None = None):
        super().__init__(message)
        self.quality = quality


class QualityGate(ABC):
    """A task's acceptance metric on what the client receives, e.g. cosine per embedding row."""

    metric: str
    threshold: float

    @abstractmethod
    def measure(self, actual: Any, expected: Any) -> float:
        """Worst value over the batch (higher is better); QualityError if the outputs cannot be compared."""


class Rung(ABC):
    """One way to run the model. ``apply`` may be lazy; the ladder proves it with warmup + the quality gate."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Why this rung cannot be tried here, or None when it can."""
        return None

    @abstractmethod
    def apply(self, module: torch.nn.Module) -> Forward: ...

    def notes(self, device: torch.device) -> list[str]:
        """Things the configured rung cannot do on this device, for describe."""
        return []

    def warmup_context(self, batches: int) -> contextlib.AbstractContextManager:
        """Settings the warmup of ``batches`` batches runs under (for compile rungs: while graphs are traced)."""
        return contextlib.nullcontext()


class CompileRung(Rung):
    def __init__(self, name: str, spec: CompileSpec, skip_reason: str | None = None):
        self.name = name
        self.spec = spec
        self._skip_reason = skip_reason

    def unavailable_reason(self) -> str | None:
        if not self.spec.enabled:
            return "pt2.compile.enable is not true"
        if self._skip_reason is None and self.spec.backend == IPEX_BACKEND:
            return probe_ipex()[1]  # importing IPEX registers its backend
        return self._skip_reason

    def apply(self, module: torch.nn.Module) -> Forward:
        compiled = torch.compile(module, **self.spec.kwargs())
        if self.spec.uses_cuda_graphs and _device_of(module).type == "cuda":
            return _with_cudagraph_steps(compiled)
        return compiled

    def notes(self, device: torch.device) -> list[str]:
        """What the requested compile does not do here, said rather than pretended."""
        if self.spec.enabled and self.spec.uses_cuda_graphs and device.type != "cuda":
            return [f"mode {self.spec.mode}: no CUDA graphs on {device.type}; inductor compiles without them"]
        return []

    def warmup_context(self, batches: int) -> contextlib.AbstractContextManager:
        from torch._inductor import config as inductor_config  # imports dynamo: not before the cache dir is set

        stack = contextlib.ExitStack()
        # One graph per static warmup shape: past dynamo's recompile limit (8) the rest would run eagerly,
        # silently, both in the warmup and on live traffic.
        # Float attributes (dropout p, layer-norm eps) as constants from the start: dynamic tracing would make
        # them symbols, specialize them after all and trace the whole model a second time.
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=max(torch._dynamo.config.recompile_limit, batches), specialize_float=True))
        # No precompiled C++ headers: inductor keeps them under $TMPDIR, outside the compile cache, and builds
        # them again in every new process whose kernels are not in memory, even when every kernel is already
        # in the cache: +6 s on a new host or container with a warm cache volume. Cold compiles measured no
        # slower without them (bench_restart.py, README: Restarts).
        stack.enter_context(inductor_config.patch(cpp_cache_precompile_headers=False))
        if self.spec.one_graph:
            # Only while tracing: the guards it produces then admit batch size 1 to the same graph.
            stack.enter_context(fx_config.patch(backed_size_oblivious=True))
        return stack


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _with_cudagraph_steps(compiled: Forward) -> Forward:
    """CUDA-graph trees reuse output buffers across replays: mark each call as a new step and clone the
    outputs, so a batch never reads (or hands a client) buffers the next replay overwrites."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return _cloned(compiled(*args, **kwargs))

    return forward


def _cloned(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, Mapping):
        return {key: _cloned(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(_cloned(value) for value in output)
    return output


class IpexRung(Rung):
    name = RungName.IPEX.value

    def __init__(self, device: torch.device, dtype: DType):
        self.device = device
        self.dtype = dtype

    def unavailable_reason(self) -> str | None:
        if self.device.type != "cpu":
            return f"IPEX runs on CPU only; this worker uses {self.device}"
        return probe_ipex()[1]

    def apply(self, module: torch.nn.Module) -> Forward:
        ipex, reason = probe_ipex()
        if ipex is None:
            raise RuntimeError(reason)
        # No channels_last: it suits convolutions, and these are transformers.
        dtype = None if self.dtype is DType.FLOAT32 else self.dtype.torch
        return ipex.optimize(module.eval(), dtype=dtype, inplace=False)


class EagerRung(Rung):
    name = RungName.EAGER.value

    def apply(self, module: torch.nn.Module) -> Forward:
        return module


def build_ladder(config: HandlerConfig, device: torch.device, dtype: DType,
                 compile_unavailable: str | None = None, inductor_unavailable: str | None = None) -> list[Rung]:
    """The rungs named in ``pt2_handlers.ladder``, in order; eager is always last. ``compile_unavailable``
    skips the compile rungs with that reason (e.g. no writable compile cache); ``inductor_unavailable`` skips
    those that compile with inductor (e.g. no C++ compiler for a CPU worker)."""
    requested = config.served_compile
    rungs: list[Rung] = []

    def unavailable(spec: CompileSpec) -> str | None:
        return compile_unavailable or (inductor_unavailable if spec.backend == "inductor" else None)

    for name in config.settings.ladder:
        if name is RungName.COMPILE:
            rungs.append(CompileRung(name.value, requested, skip_reason=unavailable(requested)))
        elif name is RungName.SAFE_COMPILE:
            same = "identical to the compile rung" if requested.safer() == requested else None
            rungs.append(CompileRung(name.value, requested.safer(), skip_reason=unavailable(requested.safer()) or same))
        elif name is RungName.IPEX:
            rungs.append(IpexRung(device, dtype))
        else:
            rungs.append(EagerRung())
    return rungs


@dataclass
class LadderResult:
    active: str
    forward: Forward
    dtype: DType
    attempts: list[Attempt] = field(default_factory=list)


def run_ladder(
    reference: torch.nn.Module,
    serving: torch.nn.Module,
    dtype: DType,
    rungs: Sequence[Rung],
    warmup_batches: Sequence[Any],
    gate: QualityGate,
    run: Run = call,
) -> LadderResult:
    """Try each rung on ``serving`` (the model in ``dtype``); return the first that runs and whose answers
    pass ``gate`` against ``reference`` (the fp32 model run eagerly). If none does, serve the reference.
    ``run(forward, batch)`` runs one warmup batch (by default ``forward(**batch)``; generation runs a decode
    loop of steps instead)."""
    if not warmup_batches:
        raise ValueError("the ladder needs at least one warmup batch to prove a rung")
    with torch.inference_mode():
        references = [_detached(run(reference, batch)) for batch in warmup_batches]
    attempts: list[Attempt] = []
    for rung in rungs:
        if isinstance(rung, EagerRung) and serving is reference:
            break  # fp32 eager produced the references: nothing to prove
        attempt, forward = _try(rung, serving, dtype, warmup_batches, references, gate, run)
        attempts.append(attempt)
        if forward is not None:
            return LadderResult(active=rung.name, forward=forward, dtype=dtype, attempts=attempts)
    reason = None if serving is reference else f"no rung kept the answers in {dtype.value}; serving fp32 eager"
    attempts.append(Attempt(RungName.EAGER.value, AttemptStatus.ACCEPTED, reason, 0.0, DType.FLOAT32.value))
    return LadderResult(active=RungName.EAGER.value, forward=reference, dtype=DType.FLOAT32, attempts=attempts)


def _try(rung: Rung, module: torch.nn.Module, dtype: DType, batches: Sequence[Any], references: Sequence[Any],
         gate: QualityGate, run: Run) -> tuple[Attempt, Forward | None]:
    started = time.perf_counter()
    reason = rung.unavailable_reason()
    if reason is not None:
        logger.info("rung %s skipped: %s", rung.name, reason)
        return Attempt(rung.name, AttemptStatus.SKIPPED, reason, 0.0, dtype.value), None
    try:
        forward = rung.apply(module)
        with rung.warmup_context(len(batches)):
            quality = _prove(rung.name, forward, batches, references, gate, run)
    except Exception as exc:  # noqa: BLE001 -- any failure of an optimized rung means: next rung
        seconds = _since(started)
        logger.warning("rung %s (%s) failed after %.1fs; trying the next rung", rung.name, dtype.value, seconds,
                       exc_info=True)
        if isinstance(rung, CompileRung):
            torch._dynamo.reset()  # drop half-built graphs so the next rung starts clean
        quality = exc.quality if isinstance(exc, QualityError) else None
        return Attempt(rung.name, AttemptStatus.FAILED, summarize(exc), seconds, dtype.value, quality), None
    seconds = _since(started)
    logger.info("rung %s accepted: %d warmup batches ran in %s, %s %.6f >= %g, in %.1fs", rung.name, len(batches),
                dtype.value, quality.metric, quality.value, quality.threshold, seconds)
    return Attempt(rung.name, AttemptStatus.ACCEPTED, None, seconds, dtype.value, quality), forward


def _prove(name: str, forward: Forward, batches: Sequence[Any], references: Sequence[Any],
           gate: QualityGate, run: Run) -> Quality:
    worst = float("inf")
    for index, (batch, expected) in enumerate(zip(batches, references, strict=True)):
        started = time.perf_counter()
        with torch.inference_mode():
            worst = min(worst, gate.measure(run(forward, batch), expected))
        logger.info("rung %s warmup %d/%d (shape %s) ran in %.2fs", name, index + 1, len(batches), _shape(batch),
                    _since(started))
    quality = Quality(gate.metric, worst, gate.threshold)
    if not worst >= gate.threshold:  # also catches NaN
        raise QualityError(f"{gate.metric} {worst:.6f} is below the gate's {gate.threshold:g}", quality)
    return quality


def tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output, in order."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, Mapping):  # includes transformers' ModelOutput
        for value in output.values():
            yield from tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from tensors(value)


def _detached(output: Any) -> Any:
    return [t.detach().clone() for t in tensors(output)]


def summarize(exc: BaseException, limit: int = 300) -> str:
    """One line for describe/logs: dynamo errors run to pages; the first two lines say what broke
    (e.g. "BackendCompilerFailed: backend='x' raised:" then the backend's own error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
    text = f"{type(exc).__name__}: {' '.join(lines)}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


class ShapeNotWarmed(InferenceError):
    """After READY, a batch needed a new compile and the shape policy says ``after_ready: fail`` (500)."""


# The one message torch gives under set_stance("fail_on_recompile"); tests/test_ladder.py pins it to torch.
_RECOMPILE_REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def is_refused_recompile(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and str(exc).startswith(_RECOMPILE_REFUSED)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class GuardedForward:
    """Runs the accepted rung on live batches. A batch whose shape would need a new compile follows the
    shape policy's stance; a failing optimized forward is re-run eagerly, and N failures demote to eager."""

    def __init__(self, result: LadderResult, eager: Forward, max_failures: int,
                 after_ready: AfterReady = AfterReady.EAGER):
        self._optimized = result.forward
        self._eager = eager
        self.accepted = result.active
        self.active = result.active
        self.demoted = False
        self.max_failures = max_failures
        self.after_ready = after_ready
        self.failures = 0
        self.last_failure: str | None = None
        self.eager_batches = 0  # unseen shapes served eagerly (after_ready: eager)
        self.compiles = 0  # graphs compiled after READY (after_ready: compile)

    def __call__(self, **batch: torch.Tensor) -> Any:
        with torch.inference_mode():
            if self.demoted:
                return self._eager(**batch)
            graphs_before = compiled_graphs()
            try:
                with self._stance():
                    return self._optimized(**batch)
            except Exception as exc:  # noqa: BLE001 -- the client must get an answer; eager gives it
                if not is_refused_recompile(exc):
                    self._record_failure(exc)
                elif self.after_ready is AfterReady.FAIL:
                    raise ShapeNotWarmed(f"input shape {_shape(batch)} was not warmed and shapes.after_ready is "
                                         "fail; add it to pt2_handlers.shapes") from None
                else:
                    self.eager_batches += 1
                    logger.info("shape %s was not warmed: served eagerly without compiling", _shape(batch))
            finally:
                self.compiles += compiled_graphs() - graphs_before
            return self._eager(**batch)

    def _stance(self) -> Any:
        if self.after_ready is AfterReady.COMPILE:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("fail_on_recompile")

    def _record_failure(self, exc: Exception) -> None:
        self.failures += 1
        self.last_failure = summarize(exc)
        logger.warning(
            "optimized forward (%s) failed on a live batch (%d/%d); answering this batch eagerly",
            self.active, self.failures, self.max_failures, exc_info=True,
        )
        if self.failures >= self.max_failures:
            logger.error("rung %s failed %d live batches; demoting this worker to fp32 eager", self.active,
                         self.failures)
            self.active, self.demoted = RungName.EAGER.value, True

    def describe(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "runtime_failures": self.failures,
            "max_runtime_failures": self.max_failures,
            "last_failure": self.last_failure,
            "demoted": self.demoted,
            "after_ready": self.after_ready.value,
            "compiles_after_ready": self.compiles,
            "eager_batches": self.eager_batches,
        }


def _shape(batch: Any) -> str:
    """The first tensor's shape, e.g. ``4x128``; a task's own batch type describes itself (``str``)."""
    if isinstance(batch, Mapping):
        return "x".join(str(d) for d in next(iter(batch.values())).shape)
    return str(batch)
