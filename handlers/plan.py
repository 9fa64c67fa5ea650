"""The order of the ladder's attempts: rungs x precisions, as a value you can test without a model.

An attempt is one rung (compile, safe_compile, ipex, eager) at one precision (e.g. bfloat16, float32). The
precisions come from the YAML's ``dtype``, fastest first; fp32 eager, the reference, ends every walk.

1. Before a half precision's first attempt it is *screened*: the model runs eagerly in it, through the warmup
   and the quality gate (seconds, no compile). A precision whose eager answers fail the gate is tried on no
   rung: what it loses is the precision's doing, and no compile gives it back.
2. Rungs go in order, each at the fastest precision still allowed that it can run in (int8 is compile-only:
   eager or IPEX int8 would be slower than their bf16/fp32, so they start at the next precision).
3. A rung that runs but fails the gate is tried at the next precision, before any lower rung.
4. A rung that raises, or cannot run here, hands over to the next rung, at the fastest precision.
5. Eager at a screened precision was proven by its screen; fp32 eager is the reference and always serves.

Pure Python: the ladder (``handlers.ladder``) supplies ``attempt``, which runs a step and says how it went.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EAGER = "eager"
REFERENCE_PRECISION = "float32"


class Outcome(str, enum.Enum):
    ACCEPTED = "accepted"  # ran, and its answers passed the gate
    GATE_FAILED = "gate_failed"  # ran, and its answers failed the gate
    RAISED = "raised"  # failed to apply or to run
    SKIPPED = "skipped"  # cannot run here


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
         runs_in: Callable[[str, str], bool] = lambda rung, precision: True) -> Step:
    """Make the attempts in the ladder's order, each through ``attempt``, until one is accepted; return it.
    ``rungs`` in the configured order, ``precisions`` fastest first; ``runs_in(rung, precision)`` says which
    pairs exist at all. Returns ``REFERENCE`` when no other step is accepted (``attempt`` is never asked to run
    it: the reference needs no proof)."""
    screened: dict[str, bool] = {}

    def allowed(precision: str) -> bool:
        if precision == REFERENCE_PRECISION:
            return True
        if precision not in screened:
            screened[precision] = attempt(Step(EAGER, precision, screen=True)) is Outcome.ACCEPTED
        return screened[precision]

    for rung in rungs:
        for precision in precisions:
            step = Step(rung, precision)
            if step.is_reference:
                return REFERENCE
            if not runs_in(rung, precision) or not allowed(precision):
                continue
            outcome = attempt(step)
            if outcome is Outcome.ACCEPTED:
                return step
            if outcome is not Outcome.GATE_FAILED:
                break  # raised or cannot run: the next rung, at the fastest precision
    return REFERENCE
