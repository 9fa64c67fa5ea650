"""The order of the ladder's attempts: rungs x precisions, as a value you can test without a model.

An attempt is one rung (compile, safe_compile, ipex, eager) at one precision (e.g. bfloat16, float32). The
precisions come from the YAML's ``dtype``, fastest first; fp32 eager, the reference, ends every walk.

1. Before a half precision's first attempt it is *screened*: the model runs eagerly in it, through the warmup
   and the quality gate (seconds, no compile). A precision whose eager answers fail the gate is tried on no
   rung: what it loses is the precision's doing, and no compile gives it back. Nor is one whose screen says it
   is slower here (``Outcome.SLOWER``: the ladder races auto's half precision against fp32 eager in its screen).
2. Rungs go in order, each at the fastest precision still allowed that it can run in (int8 is compile-only:
   eager or IPEX int8 would be slower than their bf16/fp32, so they start at the next precision).
3. A rung that runs but fails the gate is tried at the next precision, before any lower rung.
4. A rung that raises, or cannot run here, hands over to the next rung, at the fastest precision.
5. Eager at a screened precision was proven by its screen; fp32 eager is the reference and always serves.
6. A precision that must *pay* (int8: it trades answers for speed) and is accepted is raced against the same
   rung at the next precision that keeps the answers; the faster of the two serves (``faster`` decides). Where an
   earlier load already found it faster (``settled``), the rival is not built.
7. An accepted rung that races (``rival_of`` names its rival: openvino and compile race each other) is raced against
   its rival rung, walked as any rung (rules 2, 3 and 6) where it comes later in the ladder; the rival serves only if
   ``faster`` finds it faster. Where an earlier load found the accepted rung faster (``rung_settled``), the rival is
   not built.
8. A rung whose precision is its own (``own_precision``: OpenVINO's inference hint keeps the layers that need it
   wider, which eager in bf16 does not) is not held to a half precision's screen: its own warmup and gate decide.

Pure Python: the ladder (``handlers.ladder``) supplies ``attempt``, which runs a step and says how it went.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

EAGER = "eager"
REFERENCE_PRECISION = "float32"


class Outcome(str, enum.Enum):
    ACCEPTED = "accepted"  # ran, and its answers passed the gate
    GATE_FAILED = "gate_failed"  # ran, and its answers failed the gate
    RAISED = "raised"  # failed to apply or to run
    SKIPPED = "skipped"  # cannot run here
    SLOWER = "slower"  # a screen whose answers passed, but whose precision is no faster than fp32 here


@dataclass(frozen=True)
class Step:
    rung: str
    precision: str
    screen: bool = False  # eager at a half precision, run before the precision's first real attempt

    @property
    def is_reference(self) -> bool:
        return self.rung == EAGER and self.precision == REFERENCE_PRECISION


REFERENCE = Step(EAGER, REFERENCE_PRECISION)


def walk(rungs: Sequence[str], precisions: Sequence[str], attempt: Callable[[Step], Outcome],
         runs_in: Callable[[str, str], bool] = lambda rung, precision: True,
         must_pay: Collection[str] = (), faster: Callable[[Step, Step], Step] | None = None,
         settled: Callable[[Step, Step], bool] = lambda step, rival: False,
         rival_of: Callable[[str], str | None] = lambda rung: None,
         rung_settled: Callable[[Step, str], bool] = lambda step, rival: False,
         own_precision: Callable[[str], bool] = lambda rung: False) -> Step:
    """Make the attempts in the ladder's order, each through ``attempt``, until one is accepted; return it.
    ``rungs`` in the configured order, ``precisions`` fastest first; ``runs_in(rung, precision)`` says which
    pairs exist at all. Returns ``REFERENCE`` when no other step is accepted (``attempt`` is never asked to run
    it: the reference needs no proof). An accepted step in a ``must_pay`` precision serves only if
    ``faster(step, rival)`` picks it over the same rung at the next precision that is accepted, or
    ``settled(step, rival)`` says it is faster without the rival being tried (rule 6). An accepted step whose rung
    has a rival later in ``rungs`` (``rival_of``) is raced against that rung's own accepted step (rule 7). A rung
    with ``own_precision`` is not screened (rule 8)."""
    rung_walk = _RungWalk(precisions, attempt, runs_in, must_pay, faster, settled, own_precision)
    for index, rung in enumerate(rungs):
        step = rung_walk(rung)
        if step is None:
            continue
        rival = rival_of(rung)
        if step.is_reference or rival is None or rival not in rungs[index + 1:] or rung_settled(step, rival):
            return step
        if faster is None:
            raise ValueError(f"{rung} races {rival}: walk needs faster to judge them")
        challenger = rung_walk(rival)
        return step if challenger is None or challenger.is_reference else faster(step, challenger)
    return REFERENCE


class _RungWalk:
    """One rung's attempts at the precisions, fastest first (rules 1-6): its accepted step, the reference where the
    walk reaches fp32 eager, or None. Each precision is screened once, before its first attempt on any rung."""

    def __init__(self, precisions: Sequence[str], attempt: Callable[[Step], Outcome],
                 runs_in: Callable[[str, str], bool], must_pay: Collection[str],
                 faster: Callable[[Step, Step], Step] | None, settled: Callable[[Step, Step], bool],
                 own_precision: Callable[[str], bool] = lambda rung: False):
        self.precisions = precisions
        self.own_precision = own_precision
        self.attempt = attempt
        self.runs_in = runs_in
        self.must_pay = must_pay
        self.faster = faster
        self.settled = settled
        self.screened: dict[str, bool] = {}

    def allowed(self, precision: str) -> bool:
        if precision == REFERENCE_PRECISION:
            return True
        if precision not in self.screened:
            self.screened[precision] = self.attempt(Step(EAGER, precision, screen=True)) is Outcome.ACCEPTED
        return self.screened[precision]

    def __call__(self, rung: str) -> Step | None:
        for precision in self.precisions:
            step = Step(rung, precision)
            if step.is_reference:
                return REFERENCE
            allowed = (lambda _: True) if self.own_precision(rung) else self.allowed
            if not self.runs_in(rung, precision) or not allowed(precision):
                continue
            outcome = self.attempt(step)
            if outcome is Outcome.ACCEPTED:
                return (_raced(step, self.precisions, self.attempt, self.runs_in, allowed, self.faster,
                               self.settled) if precision in self.must_pay else step)
            if outcome is not Outcome.GATE_FAILED:
                return None  # raised or cannot run: the next rung, at the fastest precision
        return None


def _raced(step: Step, precisions: Sequence[str], attempt: Callable[[Step], Outcome],
           runs_in: Callable[[str, str], bool], allowed: Callable[[str], bool],
           faster: Callable[[Step, Step], Step] | None, settled: Callable[[Step, Step], bool]) -> Step:
    """``step`` raced against its rival, the same rung at the first later precision that is accepted. Without
    one (none is, or the rung raised there, which says nothing about speed) ``step`` serves; so it does where
    ``settled`` says it won that race before (the rival is then not tried)."""
    if faster is None:
        raise ValueError(f"{step.precision} must pay its way: walk needs faster to judge it")
    for precision in precisions[precisions.index(step.precision) + 1:]:
        if not runs_in(step.rung, precision) or not allowed(precision):
            continue
        rival = Step(step.rung, precision)
        if settled(step, rival):
            return step
        outcome = attempt(rival)
        if outcome is Outcome.ACCEPTED:
            return faster(step, rival)
        if outcome is not Outcome.GATE_FAILED:
            break
    return step
