"""The optimization ladder: try rungs at precisions at load time, keep the first attempt that proves itself.

The order of attempts is ``handlers.ladder.plan`` (rungs x precisions); this module runs them. An attempt is accepted
only after the warmup batches ran through it *inside* the guard (``torch.compile`` is lazy: graph and codegen
failures surface on the first forward) and its outputs passed the task's quality gate against **fp32 eager**.
int8, calibrated on data (``Calibration``), is also judged on held-out batches that calibration never saw.
A compile rung must also be compiled for real: a second warmup pass compiles nothing new, and dynamo gave up on
no frame (``handlers.rungs.dynamo_counts``). Anything else records a reason and moves on. fp32 eager is the reference
and the last resort.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import copy
import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from handlers.config import DType
from handlers.ladder import plan, race
from handlers.ladder.decisions import Memory, batch_tensors, fingerprint
from handlers.precision import sensitivity
from handlers.precision.quantize import Int8Weights, in_precision, split_outliers, static_int8, stays_float
from handlers.rungs import CompileRung, EagerRung, Forward, Rung, module_guards
from handlers.rungs.dynamo_counts import DynamoCounts, dynamo_counts, steady_state_problem

logger = logging.getLogger(__name__)

Batch = Mapping[str, torch.Tensor]
Run = Callable[[Forward, Any], Any]  # runs one warmup batch through a forward
# Precisions that trade answers for speed: each serves only where it is faster than the next precision that
# keeps the answers, on the same rung (handlers.ladder.race).
MUST_PAY = (DType.INT8,)
# Timed calls per forward when a half precision's screen races fp32 eager: eager calls, no compile, so 3 suffice
# to find each one's fastest; the load pays ~3 eager passes of the warmup in each precision.
SCREEN_ROUNDS = 3
Kept = TypeVar("Kept")  # a decision an earlier load kept (handlers.ladder.decisions)


def call(forward: Forward, batch: Batch) -> Any:
    return forward(**batch)


class AttemptStatus(str, enum.Enum):
    ACCEPTED = "accepted"  # serves
    PASSED = "passed"  # a precision's screen: its eager answers passed the gate
    FAILED = "failed"
    SKIPPED = "skipped"
    SLOWER = "slower"  # passed the gate, but lost the race against another precision on the same rung


@dataclass(frozen=True)
class Quality:
    """The gate's worst value over the batches it judged (higher is better) and the bar it had to clear; for int8,
    also the worst over the held-out batches alone (``value`` is the worst of all)."""

    metric: str
    value: float
    threshold: float
    held_out: float | None = None

    def to_json(self) -> dict[str, Any]:
        held_out = {} if self.held_out is None else {"held_out": round(self.held_out, 6)}
        return {"metric": self.metric, "value": round(self.value, 6), "threshold": self.threshold, **held_out}


@dataclass(frozen=True)
class Calibration:
    """What int8 is calibrated on (``batches``) and judged on besides the warmup batches (``held_out``, at the
    warmup shapes): different texts, so the gate measures int8 on what its calibration did not see. ``source`` and
    ``held_out_source`` say where each came from (describe)."""

    batches: Sequence[Any]
    held_out: Sequence[Any]
    source: str
    held_out_source: str = ""


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
    forward_ms: float | None = None  # raced (int8 and its rival): sum of the fastest ms per warmup batch

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "dtype": self.dtype, "status": self.status.value, "reason": self.reason,
                "seconds": self.seconds, "quality": self.quality.to_json() if self.quality else None,
                "screen": self.screen, "dynamo": self.dynamo.to_json() if self.dynamo else None,
                "forward_ms": self.forward_ms}


class QualityError(AssertionError):
    """An optimized rung's answers are not those of fp32 eager (the gate's value is below its threshold)."""

    def __init__(self, message: str, quality: Quality | None = None):
        super().__init__(message)
        self.quality = quality


class NotCompiled(RuntimeError):
    """A compile rung that ran, but not compiled: dynamo gave up on a frame, or it keeps recompiling."""

    def __init__(self, message: str, counts: DynamoCounts):
        super().__init__(message)
        self.counts = counts


class QualityGate(ABC):
    """A task's acceptance metric on what the client receives, e.g. cosine per embedding row."""

    metric: str
    threshold: float

    @abstractmethod
    def measure(self, actual: Any, expected: Any) -> float:
        """Worst value over the batch (higher is better); QualityError if the outputs cannot be compared."""


@dataclass
class LadderResult:
    active: str
    forward: Forward
    dtype: DType
    attempts: list[Attempt] = field(default_factory=list)
    calibration: str | None = None  # int8 was tried: what it was calibrated on, what it was judged on
    weights_key: str | None = None  # the reference's weights hashed for the memory's keys, where the walk did
    threads: tuple[int, ...] | None = None  # the thread counts ``forward`` was proven at; None: it runs at any
    # whether compile rungs guard the model's attributes, and why (handlers.rungs.module_guards)
    module_guards: str = ""


def run_ladder(
    reference: torch.nn.Module,
    precisions: Sequence[DType],
    rungs: Sequence[Rung],
    warmup_batches: Sequence[Any],
    gate: Callable[[DType], QualityGate],
    run: Run = call,
    calibration: Calibration | None = None,
    half_must_pay: Collection[DType] = (),
    memory: Memory | None = None,
    machine: str = "",
    thread_counts: Collection[int] = (),
    int8_weights: Int8Weights = Int8Weights.FULL,
    module_guards_optional: bool = True,
) -> LadderResult:
    """Walk ``rungs`` x ``precisions`` (fastest first) in ``handlers.ladder.plan``'s order; return the first attempt
    that runs and whose answers pass ``gate(precision)`` against ``reference`` (the fp32 model run eagerly).
    If none does, serve the reference. An accepted int8 attempt serves only if it is faster on the warmup batches
    than the same rung at the next precision that passes (``MUST_PAY``). int8 is calibrated on ``calibration``
    and judged on its held-out batches too; without one, on the warmup batches (which then flatter it); its weights
    take ``int8_weights``' range (``Int8Weights.for_cpu``).
    ``run(forward, batch)`` runs one warmup batch (by default ``forward(**batch)``; generation runs a decode loop
    instead). A half precision in ``half_must_pay`` (what ``auto`` picked, not what the YAML names) is tried on no
    rung unless its screen's eager forward is faster than fp32 eager's on the warmup batches: some CPUs have bf16
    instructions that run slower than their fp32 ones. int8's float layers run in bf16 only where bf16's screen
    passed. Which of them int8 takes too is measured. What a load measures (int8's layers, the races) is kept in
    ``memory`` and read back by the next load of the same model on the same batches, races on the same ``machine``
    (``handlers.cpu.features.machine``): workers of one model serve one precision, whatever load each started under.
    An accepted compiled forward is proven again at each of ``thread_counts`` it may be given later
    (``handlers.cpu.core_share``): dynamo compiles per intra-op thread count. Unless ``module_guards_optional`` is
    False, compile rungs leave out the guards on the model's attributes where the reference forwards left them as they
    were (``handlers.rungs.module_guards``)."""
    if not warmup_batches:
        raise ValueError("the ladder needs at least one warmup batch to prove a rung")
    with torch.inference_mode():
        references, changed = module_guards.run_watching_state(
            reference, warmup_batches, lambda module, batch: _detached(run(module, batch)))
    rungs, guards_kept = _module_guards(rungs, changed, module_guards_optional)
    if DType.INT8 not in precisions:
        calibration = None
    elif calibration is None:
        calibration = Calibration(warmup_batches, (), "the warmup batches")
    ladder = _Walk(reference, rungs, warmup_batches, references, gate, run,
                   int8_rest=torch.bfloat16 if DType.BFLOAT16 in precisions else torch.float32,
                   calibration=calibration, half_must_pay=half_must_pay, memory=memory, machine=machine,
                   int8_weights=int8_weights)
    step = plan.walk([rung.name for rung in rungs], [p.value for p in precisions], ladder.attempt,
                     runs_in=lambda rung, precision: ladder.rungs[rung].runs_in(DType(precision)),
                     must_pay=[p.value for p in MUST_PAY], faster=ladder.faster, settled=ladder.settled)
    if step.is_reference:
        planned = DType.FLOAT32 in precisions
        reason = None if planned else (f"no rung kept the answers in {' or '.join(p.value for p in precisions)}; "
                                       "serving fp32 eager")
        ladder.attempts.append(Attempt(plan.EAGER, AttemptStatus.ACCEPTED, reason, 0.0, DType.FLOAT32.value))
        return LadderResult(plan.EAGER, reference, DType.FLOAT32, ladder.attempts, ladder.calibration_said,
                            ladder.weights_key, module_guards=guards_kept or "not compiled: eager serves")
    rung, dtype = ladder.rungs[step.rung], DType(step.precision)
    threads = None if rung.follows_threads() else (torch.get_num_threads(),)
    if isinstance(rung, CompileRung):
        threads = _at_thread_counts(rung, ladder.forwards[step], dtype, thread_counts, warmup_batches, references,
                                    gate(dtype), run)
    return LadderResult(step.rung, ladder.forwards[step], dtype, ladder.attempts, ladder.calibration_said,
                        ladder.weights_key, threads, _module_guards_said(rung, dtype, guards_kept, len(warmup_batches)))


def _module_guards(rungs: Sequence[Rung], changed: Sequence[str], optional: bool) -> tuple[list[Rung], str | None]:
    """The rungs, their compiles without the guards on the model's attributes if they are ``optional`` and none
    ``changed``; else the rungs as they were and why, for describe."""
    if not optional:
        return list(rungs), "kept: pt2_handlers.module_guards is keep"
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        logger.info("compiles keep dynamo's guards on the model's attributes: its eager forwards changed %s", shown)
        return list(rungs), f"kept: the model's eager forwards changed {shown}"
    unsupported = module_guards.unsupported_reason()
    if unsupported:
        return list(rungs), f"kept: {unsupported}"
    return [rung.without_module_guards() if isinstance(rung, CompileRung) else rung for rung in rungs], None


def _module_guards_said(rung: Rung, dtype: DType, kept: str | None, forwards: int) -> str:
    """What describe says about the served forward's guards on the model's attributes."""
    if kept is not None:
        return kept
    if not isinstance(rung, CompileRung):
        return f"not compiled: {rung.name} serves"
    left_out = rung.module_guard_filter(dtype)
    if left_out is None:
        return "kept: the compile does not freeze the weights (graph inputs, guarded by dtype and shape only)"
    if not left_out.left_out:
        return "kept: no graph reads a weight it guards by identity"
    whole = f"; {left_out.kept} kept whole (no weight guarded by identity)" if left_out.kept else ""
    logger.info("compiled without dynamo's guards on the model's attributes: %d graph(s)%s", left_out.left_out, whole)
    return (f"left out: {max(forwards, 2)} eager forwards of the model left its attributes as they were "
            f"({left_out.left_out} graph(s) without them{whole})")


def _at_thread_counts(rung: CompileRung, forward: Forward, dtype: DType, counts: Collection[int],
                      batches: Sequence[Any], references: Sequence[Any], gate: QualityGate, run: Run,
                      ) -> tuple[int, ...]:
    """The thread counts the accepted compiled ``forward`` is proven at: the process's count now, and each other
    count in ``counts`` where the warmup, the gate and the steady state pass there too. Dynamo guards the intra-op
    thread count with the rest of torch's global state, so a compiled forward called at another count compiles again;
    after READY the shape policy's stance would serve that call eagerly instead; an inductor compile on shared cores
    leaves that guard out (``handlers.rungs.thread_guard``), and serves every count with the same graphs."""
    now = torch.get_num_threads()
    proven = [now]
    others = sorted(set(counts) - {now}, reverse=True)
    for count in others:
        started = time.perf_counter()
        name = f"{rung.name} ({dtype.value}) at {count} thread(s)"
        torch.set_num_threads(count)
        try:
            with rung.warmup_context(len(batches) * (1 + len(others))):  # graphs per shape and count
                before = dynamo_counts()
                quality = _prove(name, forward, batches, references, gate, run)
            # The steady state was checked at the first count (the same frames and guards but this one); here
            # dynamo must only have given up on nothing.
            compiled = dynamo_counts() - before
            if compiled.frames_given_up:
                raise NotCompiled(f"dynamo gave up on {compiled.frames_given_up} frame(s)", compiled)
        except Exception as exc:  # noqa: BLE001 -- no dynamo reset: the graphs proven so far must stay
            logger.warning("rung %s failed after %.1fs, so it runs at %s thread(s) only: %s", name, _since(started),
                           "/".join(map(str, sorted(proven))), summarize(exc))
            continue
        finally:
            torch.set_num_threads(now)
        proven.append(count)
        # One set of graphs where the compile follows the count; else graphs of its own.
        graphs = (f"{compiled.graphs} graph(s) compiled for it" if compiled.graphs
                  else f"on the graphs compiled at {now} thread(s)")
        logger.info("rung %s proven too, %s: %s %.6f, in %.1fs", name, graphs, quality.metric, quality.value,
                    _since(started))
    return tuple(sorted(proven))


class _Walk:
    """Runs the steps ``plan.walk`` asks for and records each as an Attempt."""

    def __init__(self, reference: torch.nn.Module, rungs: Sequence[Rung], batches: Sequence[Any],
                 references: Sequence[Any], gate: Callable[[DType], QualityGate], run: Run,
                 int8_rest: torch.dtype = torch.float32, calibration: Calibration | None = None,
                 half_must_pay: Collection[DType] = (), memory: Memory | None = None, machine: str = "",
                 int8_weights: Int8Weights = Int8Weights.FULL):
        self.rungs = {rung.name: rung for rung in rungs}
        self.reference = reference
        self.batches = batches
        self.references = references
        self.gate = gate
        self.run = run
        self.int8_rest = int8_rest
        self.calibration = calibration
        self.int8_weights = int8_weights
        self.half_must_pay = frozenset(half_must_pay)
        self._held_out: tuple[Sequence[Any], Sequence[Any]] | None = None  # int8's held-out batches, references
        self.attempts: list[Attempt] = []
        self.forwards: dict[plan.Step, Forward] = {}
        self._attempt_of: dict[plan.Step, int] = {}  # where each accepted step's attempt is in ``attempts``
        self._models: dict[DType, torch.nn.Module] = {DType.FLOAT32: reference}
        self._screens: dict[DType, Attempt] = {}  # the screens that passed
        self._screened: dict[DType, plan.Outcome] = {}  # every screen run: int8 asks for bf16's before plan does
        self._int8_choice: sensitivity.Choice | None = None  # the layers int8 takes beyond its rule, measured
        self._int8_by_rule = False  # int8 with the measured layers lost the answers: built again by the rule alone
        self.memory = memory
        self.machine = machine
        self.weights_key: str | None = None  # hashed on the first key asked for

    def attempt(self, step: plan.Step) -> plan.Outcome:
        dtype = DType(step.precision)
        if step.screen:
            return self._screen(dtype)
        rung = self.rungs[step.rung]
        if isinstance(rung, EagerRung) and dtype in self._screens:  # proven by its screen: not run again
            screen = self._screens[dtype]
            self.attempts.append(Attempt(rung.name, AttemptStatus.ACCEPTED, "answers proven by its screen", 0.0,
                                         dtype.value, screen.quality))
            self.forwards[step] = self._model(dtype)
            return plan.Outcome.ACCEPTED
        attempt, forward = _try(rung, self._model(dtype), dtype, self.batches, self.references, self.gate(dtype),
                                self.run, self._held_out_for(dtype))
        self.attempts.append(attempt)
        if forward is not None:
            self.forwards[step] = forward
            self._attempt_of[step] = len(self.attempts) - 1
        return _outcome(attempt)

    def faster(self, challenger: plan.Step, rival: plan.Step) -> plan.Step:
        """Race two accepted steps of one rung on the warmup batches; record both times; the challenger (int8)
        serves only if it pays (``race.MIN_GAIN``). The loser's forward is dropped."""
        started = time.perf_counter()
        raced = self._race([self.forwards[challenger], self.forwards[rival]], self._raced_what(challenger, rival))
        ms = raced.ms
        pays = race.pays(ms[0], ms[1])
        winner, loser = (challenger, rival) if pays else (rival, challenger)
        timed = self._timed(challenger, rival, raced)
        if pays:
            reasons = {winner: f"faster: {timed}", loser: f"passed the gate, but {challenger.precision} was faster "
                                                           f"here: {timed}"}
        else:
            reasons = {winner: f"serves: {challenger.precision} passed the gate, but was not "
                               f"{race.MIN_GAIN:.0%} faster here: {timed}",
                       loser: f"passed the gate, but not {race.MIN_GAIN:.0%} faster here: {timed}"}
        for step, forward_ms in ((challenger, ms[0]), (rival, ms[1])):
            index = self._attempt_of[step]
            status = AttemptStatus.ACCEPTED if step == winner else AttemptStatus.SLOWER
            self.attempts[index] = _replace(self.attempts[index], status=status, reason=reasons[step],
                                            forward_ms=forward_ms)
        del self.forwards[loser]
        if loser.precision != plan.REFERENCE_PRECISION:  # the reference model serves the eager fallback
            self._models.pop(DType(loser.precision), None)
        log = logger.warning if raced.disturbed else logger.info
        log("raced %s (%s) against %s on %s: %s; %s serves, in %.1fs", challenger.precision,
            challenger.rung, rival.precision, rival.rung, timed, winner.precision, _since(started))
        return winner

    def settled(self, challenger: plan.Step, rival: plan.Step) -> bool:
        """Whether a reliable race that an earlier load on this machine kept found the (accepted) challenger faster
        than ``rival``: then the challenger serves and the rival is not built, which it would only be to lose."""
        earlier = self._recall(self._race_key(self._raced_what(challenger, rival), race.ROUNDS),
                               race.Race.from_record)
        if earlier is None or earlier.disturbed or not race.pays(*earlier.ms):
            return False
        timed = self._timed(challenger, rival, earlier)
        index = self._attempt_of[challenger]
        self.attempts[index] = _replace(self.attempts[index], reason=f"faster: {timed}", forward_ms=earlier.ms[0])
        self.attempts.append(Attempt(rival.rung, AttemptStatus.SLOWER, f"not built: {challenger.precision} was "
                                                                        f"faster here: {timed}", 0.0,
                                     rival.precision, forward_ms=earlier.ms[1]))
        logger.info("%s (%s) serves: %s; %s on %s not built", challenger.precision, challenger.rung, timed,
                    rival.precision, rival.rung)
        return True

    def _raced_what(self, challenger: plan.Step, rival: plan.Step) -> tuple[object, ...]:
        """What a race of two compiled steps depends on besides the weights, batches and machine: the steps, how
        the rung compiles (its YAML options), and how int8 was built (the layers it took, its float layers' dtype)."""
        int8 = None
        if DType.INT8.value in (challenger.precision, rival.precision):
            choice = self._int8_layers()
            taken = () if self._int8_by_rule else (choice.taken, sorted(choice.split.items()))
            int8 = (self._int8_by_rule, taken, str(self._int8_rest()), self.int8_weights.value)
        return challenger, rival, repr(getattr(self.rungs[challenger.rung], "spec", None)), int8

    def _timed(self, challenger: plan.Step, rival: plan.Step, raced: race.Race) -> str:
        return (f"{raced.ms[0]:.2f} ms in {challenger.precision} against {raced.ms[1]:.2f} in {rival.precision} (sum "
                f"of the fastest forward per warmup batch, {len(self.batches)} batches, {race.ROUNDS} rounds, "
                f"{raced.describe()})")

    def _screen(self, dtype: DType) -> plan.Outcome:
        if dtype not in self._screened:
            self._screened[dtype] = self._run_screen(dtype)
        return self._screened[dtype]

    def _run_screen(self, dtype: DType) -> plan.Outcome:
        outcome = self._screen_model(dtype)
        if dtype is DType.INT8 and outcome is not plan.Outcome.ACCEPTED and self._int8_widened():
            # The real int8 model lost what the simulation kept: int8 by the rule alone, judged afresh.
            self._int8_by_rule = True
            self._models.pop(dtype, None)
            return self._screen_model(dtype)
        return outcome

    def _screen_model(self, dtype: DType) -> plan.Outcome:
        widened = dtype is DType.INT8 and self._int8_widened()
        if_not = ("; int8 is built again with the rule's float layers" if widened
                  else f"; so no rung runs in {dtype.value}")
        try:  # the first use of the precision: its converted copy is made here
            model = self._model(dtype)
        except Exception as exc:  # noqa: BLE001 -- a model that cannot be converted: no rung runs in it
            logger.warning("converting the model to %s failed: %s", dtype.value, summarize(exc), exc_info=True)
            self.attempts.append(Attempt(plan.EAGER, AttemptStatus.FAILED,
                                         f"screen: converting the model to {dtype.value} failed: {summarize(exc)}"
                                         f"{if_not}", 0.0, dtype.value, screen=True))
            return plan.Outcome.RAISED
        attempt, _ = _try(EagerRung(), model, dtype, self.batches, self.references, self.gate(dtype), self.run,
                          self._held_out_for(dtype))
        if attempt.status is AttemptStatus.ACCEPTED and dtype in self.half_must_pay:
            attempt = self._race_fp32_eager(model, dtype, attempt)
        if attempt.status is AttemptStatus.ACCEPTED:
            kept = f"{dtype.value} keeps the answers in eager"
            if dtype is DType.INT8:
                kept += f" (its float layers in {str(self._int8_rest()).removeprefix('torch.')}; {self._int8_said()})"
            attempt = _replace(attempt, status=AttemptStatus.PASSED, screen=True,
                               reason=f"screen: {kept}{attempt.reason or ''}; faster rungs try it first")
            self._screens[dtype] = attempt
        elif attempt.status is AttemptStatus.SLOWER:
            self._models.pop(dtype, None)
        else:
            loses = (f", with {self._int8_said()}{if_not}" if widened
                     else f"{if_not} (the precision loses the answers)")
            attempt = _replace(attempt, screen=True, reason=f"screen: {attempt.reason}{loses}")
            self._models.pop(dtype, None)
        self.attempts.append(attempt)
        return _outcome(attempt)

    def _race_fp32_eager(self, model: torch.nn.Module, dtype: DType, screen: Attempt) -> Attempt:
        """``screen`` (passed) with the race of ``model`` in ``dtype`` against fp32 eager on the warmup batches: still
        accepted where the half precision pays (``race.MIN_GAIN``), SLOWER where it does not."""
        raced = self._race([model, self.reference], f"eager {dtype.value} against eager float32", SCREEN_ROUNDS)
        half_ms, fp32_ms = raced.ms
        timed = (f"{half_ms:.2f} ms eager in {dtype.value} against {fp32_ms:.2f} in float32 (sum of the fastest "
                 f"forward per warmup batch, {len(self.batches)} batches, {SCREEN_ROUNDS} rounds, "
                 f"{raced.describe()})")
        log = logger.warning if raced.disturbed else logger.info
        if race.pays(half_ms, fp32_ms):
            log("screen: %s pays here: %s", dtype.value, timed)
            return _replace(screen, reason=f", and is faster than float32 here: {timed}", forward_ms=half_ms)
        log("screen: %s keeps the answers but is not faster than float32 here: %s; no rung runs in it", dtype.value,
            timed)
        return _replace(screen, status=AttemptStatus.SLOWER, screen=True, forward_ms=half_ms,
                        reason=f"screen: {dtype.value} keeps the answers in eager, but is not {race.MIN_GAIN:.0%} "
                               f"faster than float32 here: {timed}; so no rung runs in {dtype.value} (auto serves "
                               "the faster precision)")

    def _int8_widened(self) -> bool:
        """Whether int8 is (to be) built with layers beyond its rule: measures them on first use."""
        choice = self._int8_layers()
        return not self._int8_by_rule and bool(choice.taken or choice.split)

    def _int8_layers(self) -> sensitivity.Choice:
        """Which of the layers int8's rule keeps in float int8 takes too, and in which form (measured once)."""
        if self._int8_choice is None:
            self._int8_choice = self._measure_int8_layers()
        return self._int8_choice

    def _int8_said(self) -> str:
        if self._int8_by_rule:
            return "the rule's float layers only: with the measured ones too it lost the answers"
        return self._int8_layers().describe()

    def _measure_int8_layers(self) -> sensitivity.Choice:
        assert self.calibration is not None  # run_ladder gives one whenever int8 is tried
        linears = {name: layer for name, layer in self.reference.named_modules() if isinstance(layer, torch.nn.Linear)}
        candidates = [name for name, layer in linears.items() if stays_float(name, layer)]
        gate = self.gate(DType.INT8)
        batches, references = list(self.batches), list(self.references)
        held_out = self._held_out_for(DType.INT8)
        if held_out is not None:
            batches, references = batches + list(held_out[0]), references + list(held_out[1])

        def scorer(judged: Sequence[Any], wanted: Sequence[Any]) -> sensitivity.Score:
            def score(module: torch.nn.Module) -> float:
                worst = float("inf")
                with torch.inference_mode():
                    for batch, expected in zip(judged, wanted, strict=True):
                        try:
                            worst = min(worst, gate.measure(self.run(module, batch), expected))
                        except QualityError:  # e.g. a label that flipped: this layer stays float
                            return float("-inf")
                return worst

            return score

        quantized = [name for name in linears if name not in candidates]
        try:
            key = self._key("int8 layers", sensitivity.SHARE, sensitivity.OUTLIER_CHANNELS, candidates, quantized,
                            type(gate).__name__, gate.threshold, self.int8_weights.value,
                            batches=[*self.calibration.batches, *batches])
            choice = self._recall(key, sensitivity.Choice.from_record)
            if choice is None:
                # Each layer alone is scored on the held-out batches only (the harsher texts), the chosen ones
                # together on every batch the gate judges.
                choice = sensitivity.choose(self.reference, candidates, self.calibration.batches,
                                            scorer(batches, references), gate.threshold, quantized=quantized,
                                            score_alone=None if held_out is None else scorer(*held_out),
                                            weights=self.int8_weights)
                if self.memory:
                    self.memory.keep(key, choice.record())
        except Exception as exc:  # noqa: BLE001 -- measuring is an extra: without it, the rule alone
            logger.warning("int8: measuring the layers kept in float failed (%s); the rule alone decides",
                           summarize(exc), exc_info=True)
            return sensitivity.Choice((), {}, 0.0, 0.0)
        logger.info("int8: %s: as they are: %s; with their largest input channels in float: %s", choice.describe(),
                    ", ".join(choice.taken) or "none", ", ".join(choice.split) or "none")
        return choice

    def _race(self, forwards: Sequence[Forward], what: object, rounds: int = race.ROUNDS) -> race.Race:
        """``race.run_race`` of ``forwards`` on the warmup batches, or the race an earlier load on this machine kept:
        one whose times were reliable is followed without racing; a busy machine's is raced again, kept over if
        this race is reliable, followed if not (so workers loading side by side agree)."""
        key = self._race_key(what, rounds)
        earlier = self._recall(key, race.Race.from_record)
        if earlier is not None and not earlier.disturbed:
            return earlier
        raced = race.run_race(forwards, self.batches, self.run, rounds=rounds)
        if earlier is not None and raced.disturbed:
            return earlier
        if self.memory:
            self.memory.keep(key, raced.record())
        return raced

    def _race_key(self, what: object, rounds: int) -> str:
        return self._key("race", what, rounds, self.machine, batches=self.batches)

    def _recall(self, key: str, parse: Callable[[Mapping[str, Any]], Kept]) -> Kept | None:
        """What an earlier load kept under ``key``, parsed; None where nothing (readable) was kept."""
        kept = self.memory.recall(key) if self.memory else None
        if kept is None:
            return None
        try:
            return parse(kept)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.warning("the remembered record %s is not what this version keeps (%s); measuring again", key,
                           summarize(exc))
            return None

    def _key(self, *said: object, batches: Sequence[Any]) -> str:
        """The memory's key for a decision about this reference model on ``batches``: the weights are hashed once."""
        if self.weights_key is None:
            self.weights_key = fingerprint(tensors=self.reference.state_dict().items())
        run = getattr(self.run, "__qualname__", type(self.run).__name__)
        return fingerprint(self.weights_key, run, said, [shape_of(batch) for batch in batches],
                           tensors=batch_tensors(batches))

    def _int8_rest(self) -> torch.dtype:
        """The precision int8's float layers run in: bf16 where the ladder tries bf16 and bf16's screen passed (it
        keeps the answers and, where it must, pays); float32 otherwise. Screens bf16 first if it has not been."""
        if self.int8_rest is torch.bfloat16 and self._screen(DType.BFLOAT16) is not plan.Outcome.ACCEPTED:
            return torch.float32
        return self.int8_rest

    @property
    def calibration_said(self) -> str | None:
        """For describe: what int8 was calibrated on and what it was judged on."""
        if self.calibration is None:
            return None
        held_out = len(self.calibration.held_out)
        judged = (f" and {held_out} held-out batches of {self.calibration.held_out_source}" if held_out
                  else ", nothing held out")
        return (f"calibrated on {self.calibration.source} ({len(self.calibration.batches)} batches); judged on the "
                f"{len(self.batches)} warmup batches{judged}")

    def _held_out_for(self, dtype: DType) -> tuple[Sequence[Any], Sequence[Any]] | None:
        """int8's held-out batches and fp32 eager's answers to them (computed once); None for other precisions."""
        if dtype is not DType.INT8 or self.calibration is None or not self.calibration.held_out:
            return None
        if self._held_out is None:
            with torch.inference_mode():
                answers = [_detached(self.run(self.reference, batch)) for batch in self.calibration.held_out]
            self._held_out = (self.calibration.held_out, answers)
        return self._held_out

    def _model(self, dtype: DType) -> torch.nn.Module:
        """The model in ``dtype``: the reference itself for fp32, a converted copy (made once) otherwise; int8
        is calibrated on ``calibration``, its float layers in bf16 where the ladder tries bf16 too."""
        if dtype not in self._models:
            if dtype is DType.INT8:
                assert self.calibration is not None  # run_ladder gives one whenever int8 is tried
                rest = self._int8_rest()  # before the copy: bf16's screen may run first
                model, taken = copy.deepcopy(self.reference), set()
                if not self._int8_by_rule:
                    choice = self._int8_layers()
                    taken = {*choice.taken, *split_outliers(model, choice.split).values()}
                self._models[dtype] = static_int8(
                    model, self.calibration.batches, rest,
                    keep_float=lambda name, layer: stays_float(name, layer) and name not in taken,
                    weights=self.int8_weights)
            else:
                self._models[dtype] = in_precision(copy.deepcopy(self.reference), dtype)
        return self._models[dtype]


def _outcome(attempt: Attempt) -> plan.Outcome:
    if attempt.status in (AttemptStatus.ACCEPTED, AttemptStatus.PASSED):
        return plan.Outcome.ACCEPTED
    if attempt.status is AttemptStatus.SKIPPED:
        return plan.Outcome.SKIPPED
    if attempt.status is AttemptStatus.SLOWER:
        return plan.Outcome.SLOWER
    return plan.Outcome.GATE_FAILED if attempt.quality is not None else plan.Outcome.RAISED


def _replace(attempt: Attempt, **changes: Any) -> Attempt:
    return Attempt(**{**attempt.__dict__, **changes})


def _try(rung: Rung, module: torch.nn.Module, dtype: DType, batches: Sequence[Any], references: Sequence[Any],
         gate: QualityGate, run: Run, held_out: tuple[Sequence[Any], Sequence[Any]] | None = None,
         ) -> tuple[Attempt, Forward | None]:
    started = time.perf_counter()
    reason = rung.unavailable_reason()
    if reason is not None:
        logger.info("rung %s skipped: %s", rung.name, reason)
        return Attempt(rung.name, AttemptStatus.SKIPPED, reason, 0.0, dtype.value), None
    compiled = isinstance(rung, CompileRung)
    counts = None
    try:
        forward = rung.apply(module, dtype)
        with rung.warmup_context(len(batches)):
            before = dynamo_counts() if compiled else None
            quality = _prove(f"{rung.name} ({dtype.value})", forward, batches, references, gate, run)
            if compiled:
                counts = _check_steady_state(forward, batches, run, before)
            if held_out is not None:  # at the warmup shapes: nothing new to compile
                quality = _judge_held_out(f"{rung.name} ({dtype.value})", forward, *held_out, gate, run, quality)
    except Exception as exc:  # noqa: BLE001 -- any failure of an optimized rung means: next attempt
        seconds = _since(started)
        logger.warning("rung %s (%s) failed after %.1fs: %s", rung.name, dtype.value, seconds, summarize(exc),
                       exc_info=not isinstance(exc, (QualityError, NotCompiled)))
        if compiled:
            torch._dynamo.reset()  # drop half-built graphs so the next attempt starts clean
        quality = exc.quality if isinstance(exc, QualityError) else None
        counts = exc.counts if isinstance(exc, NotCompiled) else counts
        return Attempt(rung.name, AttemptStatus.FAILED, summarize(exc), seconds, dtype.value, quality,
                       dynamo=counts), None
    seconds = _since(started)
    logger.info("rung %s accepted: %d warmup batches ran in %s, %s %.6f >= %g, in %.1fs", rung.name, len(batches),
                dtype.value, quality.metric, quality.value, quality.threshold, seconds)
    return Attempt(rung.name, AttemptStatus.ACCEPTED, None, seconds, dtype.value, quality, dynamo=counts), forward


def _check_steady_state(forward: Forward, batches: Sequence[Any], run: Run, before: DynamoCounts) -> DynamoCounts:
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


def _judge_held_out(name: str, forward: Forward, batches: Sequence[Any], references: Sequence[Any],
                    gate: QualityGate, run: Run, warmup: Quality) -> Quality:
    """The gate on the held-out batches too: ``warmup``'s quality with the held-out worst added, if that passes."""
    try:
        held_out = _prove(f"{name} held out", forward, batches, references, gate, run)
    except QualityError as exc:
        assert exc.quality is not None
        quality = Quality(gate.metric, min(warmup.value, exc.quality.value), gate.threshold, exc.quality.value)
        raise QualityError(f"{exc} on held-out batches (calibration never saw them; the warmup batches read "
                           f"{warmup.value:.6f})", quality) from None
    return Quality(gate.metric, min(warmup.value, held_out.value), gate.threshold, held_out.value)


def _prove(name: str, forward: Forward, batches: Sequence[Any], references: Sequence[Any],
           gate: QualityGate, run: Run) -> Quality:
    worst = float("inf")
    for index, (batch, expected) in enumerate(zip(batches, references, strict=True)):
        started = time.perf_counter()
        with torch.inference_mode():
            worst = min(worst, gate.measure(run(forward, batch), expected))
        logger.info("rung %s warmup %d/%d (shape %s) ran in %.2fs", name, index + 1, len(batches), shape_of(batch),
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


def shape_of(batch: Any) -> str:
    """The first tensor's shape, e.g. ``4x128``; a task's own batch type describes itself (``str``)."""
    if isinstance(batch, Mapping):
        return "x".join(str(d) for d in next(iter(batch.values())).shape)
    return str(batch)


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)
