"""Proving an attempt: a rung applied to the model in a precision, its warmup run inside the guard, its answers
judged by the task's gate against fp32 eager's; for a compile rung, a second warmup pass that compiles nothing new.

An attempt is accepted only after the warmup batches ran through it *inside* the guard (``torch.compile`` is lazy:
graph and codegen failures surface on the first forward) and its answers passed the gate. int8, calibrated on data,
is also judged on held-out batches that calibration never saw. Anything else records a reason.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch

from handlers.config import DType
from handlers.ladder.attempts import Attempt, AttemptStatus, Forward, NotCompiled, shape_of, since, summarize
from handlers.ladder.gate import Quality, QualityError, QualityGate, detached
from handlers.ladder.inputs import Calibration, Run, Warmup
from handlers.rungs import Rung
from handlers.rungs.dynamo_counts import DynamoCounts, dynamo_counts, steady_state_problem

logger = logging.getLogger(__name__)

HeldOut = tuple[Sequence[Any], Sequence[Any]]  # batches, and fp32 eager's answers to them


class Proof:
    """What every attempt is judged on: the warmup batches and fp32 eager's answers to them (``references``), the
    gate per precision; for int8, also its held-out batches, whose eager answers are computed on first use."""

    def __init__(self, reference: torch.nn.Module, warmup: Warmup, references: Sequence[Any],
                 calibration: Calibration | None):
        self.reference = reference
        self.warmup = warmup
        self.batches = warmup.batches
        self.run: Run = warmup.run
        self.references = references
        self.calibration = calibration
        self._held_out: HeldOut | None = None

    def gate(self, dtype: DType) -> QualityGate:
        return self.warmup.gate(dtype)

    def held_out(self, dtype: DType) -> HeldOut | None:
        """int8's held-out batches and fp32 eager's answers to them (computed once); None for other precisions."""
        if dtype is not DType.INT8 or self.calibration is None or not self.calibration.held_out:
            return None
        if self._held_out is None:
            with torch.inference_mode():
                answers = [detached(self.run(self.reference, batch)) for batch in self.calibration.held_out]
            self._held_out = (self.calibration.held_out, answers)
        return self._held_out

    def attempt(self, rung: Rung, module: torch.nn.Module, dtype: DType) -> tuple[Attempt, Forward | None]:
        """``rung`` applied to ``module`` (in ``dtype``), its warmup run and judged: the attempt, and the forward where
        it was accepted."""
        started = time.perf_counter()
        reason = rung.unavailable_reason()
        if reason is not None:
            logger.info("rung %s skipped: %s", rung.name, reason)
            return Attempt(rung.name, AttemptStatus.SKIPPED, reason, 0.0, dtype.value), None
        name, gate, counts = f"{rung.name} ({dtype.value})", self.gate(dtype), None
        try:
            forward = rung.apply(module, dtype)
            with rung.warmup_context(len(self.batches)):
                before = dynamo_counts() if rung.compiles else None
                quality = prove(name, forward, self.batches, self.references, gate, self.run)
                if before is not None:
                    counts = check_steady_state(forward, self.batches, self.run, before)
                held_out = self.held_out(dtype)
                if held_out is not None:  # at the warmup shapes: nothing new to compile
                    quality = judge_held_out(name, forward, *held_out, gate, self.run, quality)
        except Exception as exc:  # noqa: BLE001 -- any failure of an optimized rung means: next attempt
            seconds = since(started)
            logger.warning("rung %s (%s) failed after %.1fs: %s", rung.name, dtype.value, seconds, summarize(exc),
                           exc_info=not isinstance(exc, (QualityError, NotCompiled)))
            if rung.compiles:
                torch._dynamo.reset()  # drop half-built graphs so the next attempt starts clean
            quality = exc.quality if isinstance(exc, QualityError) else None
            counts = exc.counts if isinstance(exc, NotCompiled) else counts
            return Attempt(rung.name, AttemptStatus.FAILED, summarize(exc), seconds, dtype.value, quality,
                           dynamo=counts), None
        seconds = since(started)
        logger.info("rung %s accepted: %d warmup batches ran in %s, %s %.6f >= %g, in %.1fs", rung.name,
                    len(self.batches), dtype.value, quality.metric, quality.value, quality.threshold, seconds)
        return Attempt(rung.name, AttemptStatus.ACCEPTED, None, seconds, dtype.value, quality, dynamo=counts), forward

    def at_thread_counts(self, rung: Rung, forward: Forward, dtype: DType, counts: Collection[int]) -> tuple[int, ...]:
        """The thread counts the accepted compiled ``forward`` is proven at: the process's count now, and each other
        count in ``counts`` where the warmup, the gate and the steady state pass there too. Dynamo guards the intra-op
        thread count with the rest of torch's global state, so a compiled forward called at another count compiles
        again; after READY the shape policy's stance would serve that call eagerly instead; an inductor compile on
        shared cores leaves that guard out (``handlers.rungs.thread_guard``), and serves every count with the same
        graphs."""
        now = torch.get_num_threads()
        proven = [now]
        others = sorted(set(counts) - {now}, reverse=True)
        for count in others:
            started = time.perf_counter()
            name = f"{rung.name} ({dtype.value}) at {count} thread(s)"
            torch.set_num_threads(count)
            try:
                with rung.warmup_context(len(self.batches) * (1 + len(others))):  # graphs per shape and count
                    before = dynamo_counts()
                    quality = prove(name, forward, self.batches, self.references, self.gate(dtype), self.run)
                # The steady state was checked at the first count (the same frames and guards but this one); here
                # dynamo must only have given up on nothing.
                compiled = dynamo_counts() - before
                if compiled.frames_given_up:
                    raise NotCompiled(f"dynamo gave up on {compiled.frames_given_up} frame(s)", compiled)
            except Exception as exc:  # noqa: BLE001 -- no dynamo reset: the graphs proven so far must stay
                logger.warning("rung %s failed after %.1fs, so it runs at %s thread(s) only: %s", name,
                               since(started), "/".join(map(str, sorted(proven))), summarize(exc))
                continue
            finally:
                torch.set_num_threads(now)
            proven.append(count)
            # One set of graphs where the compile follows the count; else graphs of its own.
            graphs = (f"{compiled.graphs} graph(s) compiled for it" if compiled.graphs
                      else f"on the graphs compiled at {now} thread(s)")
            logger.info("rung %s proven too, %s: %s %.6f, in %.1fs", name, graphs, quality.metric, quality.value,
                        since(started))
        return tuple(sorted(proven))


def check_steady_state(forward: Forward, batches: Sequence[Any], run: Run, before: DynamoCounts) -> DynamoCounts:
    """Run the warmup again: a compiled forward must compile nothing new, and dynamo must have given up on no
    frame in either pass. The counts of the first pass; NotCompiled (carrying them) otherwise."""
    first = dynamo_counts() - before
    with torch.inference_mode():
        for batch in batches:
            run(forward, batch)
    problem = steady_state_problem(first, dynamo_counts() - before - first, shapes=len(batches))
    if problem is not None:
        raise NotCompiled(problem, first)
    if first.graph_breaks:
        logger.warning("compiled with %d graph break(s): eager Python runs between %d graphs", first.graph_breaks,
                       first.graphs)
    return first


def judge_held_out(name: str, forward: Forward, batches: Sequence[Any], references: Sequence[Any],
                   gate: QualityGate, run: Run, warmup: Quality) -> Quality:
    """The gate on the held-out batches too: ``warmup``'s quality with the held-out worst added, if that passes."""
    try:
        held_out = prove(f"{name} held out", forward, batches, references, gate, run)
    except QualityError as exc:
        assert exc.quality is not None
        quality = Quality(gate.metric, min(warmup.value, exc.quality.value), gate.threshold, exc.quality.value)
        raise QualityError(f"{exc} on held-out batches (calibration never saw them; the warmup batches read "
                           f"{warmup.value:.6f})", quality) from None
    return Quality(gate.metric, min(warmup.value, held_out.value), gate.threshold, held_out.value)


def prove(name: str, forward: Forward, batches: Sequence[Any], references: Sequence[Any], gate: QualityGate,
          run: Run) -> Quality:
    """The gate's worst value over ``batches`` run through ``forward``; QualityError below the threshold."""
    worst = float("inf")
    for index, (batch, expected) in enumerate(zip(batches, references, strict=True)):
        started = time.perf_counter()
        with torch.inference_mode():
            worst = min(worst, gate.measure(run(forward, batch), expected))
        logger.info("rung %s warmup %d/%d (shape %s) ran in %.2fs", name, index + 1, len(batches), shape_of(batch),
                    since(started))
    quality = Quality(gate.metric, worst, gate.threshold)
    if not worst >= gate.threshold:  # also catches NaN
        raise QualityError(f"{gate.metric} {worst:.6f} is below the gate's {gate.threshold:g}", quality)
    return quality
