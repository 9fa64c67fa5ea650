"""Live traffic through the accepted rung: ``GuardedForward``.

An optimized forward that raises is re-run eagerly, and after ``max_failures`` such batches the guard demotes
itself to eager for good. After READY it also applies the shape policy's stance: a shape that would need a new
compile is served eagerly, refused, or compiled. Frames dynamo gives up on (they run eagerly without an error)
are counted, so describe and the metrics show them. Pure torch; no TorchServe import.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from handlers.config import RungName
from handlers.config.shapes import AfterReady
from handlers.errors import InferenceError
from handlers.ladder import LadderResult, shape_of, summarize
from handlers.rungs import Forward
from handlers.rungs.dynamo_counts import DynamoCounts, activity, dynamo_counts

logger = logging.getLogger(__name__)


class ShapeNotWarmed(InferenceError):
    """After READY, a batch needed a new compile and the shape policy says ``after_ready: fail`` (500)."""


# The one message torch gives under set_stance("fail_on_recompile"); tests/test_ladder.py pins it to torch.
_RECOMPILE_REFUSED = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def is_refused_recompile(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and str(exc).startswith(_RECOMPILE_REFUSED)


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
        self.frames_given_up = 0  # frames dynamo gave up on after READY: they ran eagerly, without an error
        # Dynamo's counts as of the activity key beside them: read in full only when the key moved (a compile, here
        # or elsewhere in the process), not twice around every batch
        self._counts_at: tuple[tuple[int, int], DynamoCounts] | None = None

    def __call__(self, **batch: torch.Tensor) -> Any:
        with torch.inference_mode():
            if self.demoted:
                return self._eager(**batch)
            before = self._counts_before()
            try:
                with self._stance():
                    return self._optimized(**batch)
            except Exception as exc:  # noqa: BLE001 -- the client must get an answer; eager gives it
                if not is_refused_recompile(exc):
                    self._record_failure(exc)
                elif self.after_ready is AfterReady.FAIL:
                    raise ShapeNotWarmed(f"input shape {shape_of(batch)} was not warmed and shapes.after_ready is "
                                         "fail; add it to pt2_handlers.shapes") from None
                else:
                    self.eager_batches += 1
                    logger.info("shape %s was not warmed: served eagerly without compiling", shape_of(batch))
            finally:
                if activity() != before[0]:
                    self._count(dynamo_counts() - before[1])
            return self._eager(**batch)

    def _counts_before(self) -> tuple[tuple[int, int], DynamoCounts]:
        key = activity()
        if self._counts_at is None or self._counts_at[0] != key:
            self._counts_at = (key, dynamo_counts())
        return self._counts_at

    def _count(self, since: DynamoCounts) -> None:
        self.compiles += since.graphs
        if since.frames_given_up:
            self.frames_given_up += since.frames_given_up
            logger.warning("dynamo gave up on %d frame(s) after READY; they ran eagerly: %s", since.frames_given_up,
                           "; ".join(since.given_up_why) or "see above")

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
            "frames_given_up": self.frames_given_up,
        }
