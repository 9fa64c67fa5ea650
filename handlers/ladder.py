"""The optimization ladder: try each rung at load time, keep the first one that proves itself.

A rung is accepted only after the warmup batches ran through it *inside* the guard (``torch.compile``
is lazy: graph and codegen failures surface on the first forward, not on the ``compile`` call) and its
outputs matched eager within the tolerance. Anything else records a reason and moves down. Eager is
the reference and the last resort.

``GuardedForward`` protects live traffic: an optimized forward that raises is re-run eagerly, and after
``max_failures`` such batches the guard demotes itself to eager for good.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from handlers.config import CompileSpec, DType, HandlerConfig, RungName, Tolerance
from handlers.ipex import probe_ipex

logger = logging.getLogger(__name__)

Forward = Callable[..., Any]
Batch = Mapping[str, torch.Tensor]


class AttemptStatus(str, enum.Enum):
    ACCEPTED = "accepted"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Attempt:
    rung: str
    status: AttemptStatus
    reason: str | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "status": self.status.value, "reason": self.reason, "seconds": self.seconds}


class ParityError(AssertionError):
    """An optimized rung's outputs differ from eager beyond the tolerance."""


class Rung(ABC):
    """One way to run the model. ``apply`` may be lazy; the ladder proves it with warmup + parity."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Why this rung cannot be tried here, or None when it can."""
        return None

    @abstractmethod
    def apply(self, module: torch.nn.Module) -> Forward: ...


class CompileRung(Rung):
    def __init__(self, name: str, spec: CompileSpec, skip_reason: str | None = None):
        self.name = name
        self.spec = spec
        self._skip_reason = skip_reason

    def unavailable_reason(self) -> str | None:
        if not self.spec.enabled:
            return "pt2.compile.enable is not true"
        return self._skip_reason

    def apply(self, module: torch.nn.Module) -> Forward:
        compiled = torch.compile(module, **self.spec.kwargs())
        if self.spec.mode in ("reduce-overhead", "max-autotune"):
            return _with_cudagraph_steps(compiled)
        return compiled


def _with_cudagraph_steps(compiled: Forward) -> Forward:
    """CUDA-graph trees reuse output buffers; a step marker per call keeps each batch's outputs its own."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return forward


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


def build_ladder(config: HandlerConfig, device: torch.device) -> list[Rung]:
    """The rungs named in ``pt2_handlers.ladder``, in order; eager is always last."""
    requested = config.compile
    rungs: list[Rung] = []
    for name in config.settings.ladder:
        if name is RungName.COMPILE:
            rungs.append(CompileRung(name.value, requested))
        elif name is RungName.SAFE_COMPILE:
            same = "identical to the compile rung" if requested.safer() == requested else None
            rungs.append(CompileRung(name.value, requested.safer(), skip_reason=same))
        elif name is RungName.IPEX:
            rungs.append(IpexRung(device, config.settings.dtype))
        else:
            rungs.append(EagerRung())
    return rungs


@dataclass
class LadderResult:
    active: str
    forward: Forward
    attempts: list[Attempt] = field(default_factory=list)


def run_ladder(
    module: torch.nn.Module,
    rungs: Sequence[Rung],
    warmup_batches: Sequence[Batch],
    tolerance: Tolerance,
) -> LadderResult:
    """Try each rung on the warmup batches; return the first that runs and matches eager."""
    if not warmup_batches:
        raise ValueError("the ladder needs at least one warmup batch to prove a rung")
    with torch.inference_mode():
        references = [_detached(module(**batch)) for batch in warmup_batches]
    attempts: list[Attempt] = []
    for rung in rungs:
        started = time.perf_counter()
        reason = rung.unavailable_reason()
        if reason is not None:
            attempts.append(Attempt(rung.name, AttemptStatus.SKIPPED, reason, 0.0))
            logger.info("rung %s skipped: %s", rung.name, reason)
            continue
        try:
            forward = rung.apply(module)
            if not isinstance(rung, EagerRung):  # eager produced the references: nothing to prove
                _prove(rung.name, forward, warmup_batches, references, tolerance)
        except Exception as exc:  # noqa: BLE001 -- any failure of an optimized rung means: next rung
            seconds = _since(started)
            attempts.append(Attempt(rung.name, AttemptStatus.FAILED, summarize(exc), seconds))
            logger.warning("rung %s failed after %.1fs; trying the next rung", rung.name, seconds, exc_info=True)
            if isinstance(rung, CompileRung):
                torch._dynamo.reset()  # drop half-built graphs so the next rung starts clean
            continue
        seconds = _since(started)
        attempts.append(Attempt(rung.name, AttemptStatus.ACCEPTED, None, seconds))
        logger.info("rung %s accepted: %d warmup batches ran and matched eager in %.1fs", rung.name,
                    len(warmup_batches), seconds)
        return LadderResult(active=rung.name, forward=forward, attempts=attempts)
    # Reached only when the ladder has no eager rung (build_ladder always adds one).
    attempts.append(Attempt(RungName.EAGER.value, AttemptStatus.ACCEPTED, "no other rung was accepted", 0.0))
    return LadderResult(active=RungName.EAGER.value, forward=module, attempts=attempts)


def _prove(name: str, forward: Forward, batches: Sequence[Batch], references: Sequence[Any], tol: Tolerance) -> None:
    for index, (batch, expected) in enumerate(zip(batches, references, strict=True)):
        started = time.perf_counter()
        with torch.inference_mode():
            actual = forward(**batch)
            compare_outputs(actual, expected, tol)
        shape = "x".join(str(d) for d in next(iter(batch.values())).shape)
        logger.info("rung %s warmup %d/%d (shape %s) ok in %.2fs", name, index + 1, len(batches), shape,
                    _since(started))


def compare_outputs(actual: Any, expected: Any, tol: Tolerance) -> None:
    """Raise ParityError unless every tensor in ``actual`` is close to its twin in ``expected``."""
    got, want = list(_tensors(actual)), list(_tensors(expected))
    if len(got) != len(want):
        raise ParityError(f"output structure differs: {len(got)} tensors vs eager's {len(want)}")
    for position, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape:
            raise ParityError(f"output {position} has shape {tuple(a.shape)}, eager {tuple(b.shape)}")
        a32, b32 = a.detach().float().cpu(), b.float().cpu()
        if not torch.allclose(a32, b32, atol=tol.atol, rtol=tol.rtol, equal_nan=True):
            worst = (a32 - b32).abs().nan_to_num(float("inf")).max().item()
            raise ParityError(
                f"output {position} differs from eager by up to {worst:.3g} (atol={tol.atol:g}, rtol={tol.rtol:g})"
            )


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, Mapping):  # includes transformers' ModelOutput
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (list, tuple)):
        for value in output:
            yield from _tensors(value)


def _detached(output: Any) -> Any:
    return [t.detach().clone() for t in _tensors(output)]


def summarize(exc: BaseException, limit: int = 300) -> str:
    """One line for describe/logs: dynamo errors run to pages; the first two lines say what broke
    (e.g. "BackendCompilerFailed: backend='x' raised:" then the backend's own error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
    text = f"{type(exc).__name__}: {' '.join(lines)}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


class GuardedForward:
    """Runs the accepted rung on live batches; re-runs a failing batch eagerly, demotes after N failures."""

    def __init__(self, result: LadderResult, eager: Forward, max_failures: int):
        self._optimized = result.forward
        self._eager = eager
        self.accepted = result.active
        self.active = result.active
        self.max_failures = max_failures
        self.failures = 0
        self.last_failure: str | None = None

    @property
    def demoted(self) -> bool:
        return self.active != self.accepted

    def __call__(self, **batch: torch.Tensor) -> Any:
        with torch.inference_mode():
            if self.active == RungName.EAGER.value:
                return self._eager(**batch)
            try:
                return self._optimized(**batch)
            except Exception as exc:  # noqa: BLE001 -- the client must get an answer; eager gives it
                self._record_failure(exc)
            return self._eager(**batch)

    def _record_failure(self, exc: Exception) -> None:
        self.failures += 1
        self.last_failure = summarize(exc)
        logger.warning(
            "optimized forward (%s) failed on a live batch (%d/%d); answering this batch eagerly",
            self.active, self.failures, self.max_failures, exc_info=True,
        )
        if self.failures >= self.max_failures:
            logger.error("rung %s failed %d live batches; demoting this worker to eager", self.active, self.failures)
            self.active = RungName.EAGER.value

    def describe(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "runtime_failures": self.failures,
            "max_runtime_failures": self.max_failures,
            "last_failure": self.last_failure,
            "demoted": self.demoted,
        }
