"""What the ladder records: each attempt (a rung at a precision) and how it went, and the result of the walk.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from handlers.config import DType
from handlers.ladder import plan
from handlers.ladder.gate import Quality
from handlers.rungs.dynamo_counts import DynamoCounts

Forward = Callable[..., Any]


class AttemptStatus(str, enum.Enum):
    ACCEPTED = "accepted"  # serves
    PASSED = "passed"  # a precision's screen: its eager answers passed the gate
    FAILED = "failed"
    SKIPPED = "skipped"
    SLOWER = "slower"  # passed the gate, but lost the race against another precision or rung


@dataclass(frozen=True)
class Attempt:
    rung: str
    status: AttemptStatus
    reason: str | None
    seconds: float
    dtype: str | None = None  # the precision it ran in
    quality: Quality | None = None
    screen: bool = False  # eager at a half precision, run before that precision's first real attempt
    dynamo: DynamoCounts | None = None  # a compile rung's warmup: graphs, graph breaks, frames given up
    forward_ms: float | None = None  # raced (int8 and its rival, two rungs): sum of the fastest ms per warmup batch

    def but(self, **changes: Any) -> Attempt:
        """This attempt with ``changes`` (a race's outcome, a screen's reason)."""
        return dataclasses.replace(self, **changes)

    def outcome(self) -> plan.Outcome:
        """How the plan reads this attempt."""
        if self.status in (AttemptStatus.ACCEPTED, AttemptStatus.PASSED):
            return plan.Outcome.ACCEPTED
        if self.status is AttemptStatus.SKIPPED:
            return plan.Outcome.SKIPPED
        if self.status is AttemptStatus.SLOWER:
            return plan.Outcome.SLOWER
        return plan.Outcome.GATE_FAILED if self.quality is not None else plan.Outcome.RAISED

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "dtype": self.dtype, "status": self.status.value, "reason": self.reason,
                "seconds": self.seconds, "quality": self.quality.to_json() if self.quality else None,
                "screen": self.screen, "dynamo": self.dynamo.to_json() if self.dynamo else None,
                "forward_ms": self.forward_ms}


class NotCompiled(RuntimeError):
    """A compile rung that ran, but not compiled: dynamo gave up on a frame, or it keeps recompiling."""

    def __init__(self, message: str, counts: DynamoCounts):
        super().__init__(message)
        self.counts = counts


@dataclass
class LadderResult:
    active: str
    forward: Forward
    dtype: DType
    attempts: list[Attempt] = field(default_factory=list)
    calibration: str | None = None  # int8 was tried: what it was calibrated on, what it was judged on
    weights_key: str | None = None  # the reference's weights hashed for the decisions' keys, where the walk did
    threads: tuple[int, ...] | None = None  # the thread counts ``forward`` was proven at; None: it runs at any
    # whether compile rungs guard the model's attributes, and why (handlers.rungs.module_guards)
    module_guards: str = ""
    # two rungs raced (openvino and compile): which served, against which, their times, by how much
    rung_race: dict[str, Any] | None = None


def summarize(exc: BaseException, limit: int = 300) -> str:
    """One line for describe/logs: dynamo errors run to pages; the first two lines say what broke
    (e.g. "BackendCompilerFailed: backend='x' raised:" then the backend's own error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
    text = f"{type(exc).__name__}: {' '.join(lines)}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shape_of(batch: Any) -> str:
    """The first tensor's shape, e.g. ``4x128``; a task's own batch type describes itself (``str``)."""
    if isinstance(batch, Mapping):
        return "x".join(str(d) for d in next(iter(batch.values())).shape)
    return str(batch)


def since(started: float) -> float:
    """Seconds since ``started`` (``time.perf_counter``), to the millisecond."""
    return round(time.perf_counter() - started, 3)
