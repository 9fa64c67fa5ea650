"""The walk: each step ``handlers.ladder.plan`` asks for, run and recorded as an ``Attempt``; and the races between
two accepted steps of one rung that the plan asks to settle.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from handlers.config import DType
from handlers.ladder import plan, race
from handlers.ladder.attempts import Attempt, AttemptStatus, Forward, since
from handlers.ladder.int8_layers import Int8Layers
from handlers.ladder.proof import Proof
from handlers.ladder.screens import Screens
from handlers.ladder.variants import ModelVariants
from handlers.rungs import EagerRung, Rung

logger = logging.getLogger(__name__)


class Walk:
    """Runs the steps ``plan.walk`` asks for (``attempt``), and decides its races (``faster``, ``settled``)."""

    def __init__(self, rungs: Sequence[Rung], proof: Proof, variants: ModelVariants, screens: Screens,
                 races: race.KeptRaces, int8_layers: Int8Layers, attempts: list[Attempt]):
        self.rungs = {rung.name: rung for rung in rungs}
        self.proof = proof
        self.variants = variants
        self.screens = screens
        self.races = races
        self.int8_layers = int8_layers
        self.attempts = attempts
        self.forwards: dict[plan.Step, Forward] = {}
        self._attempt_of: dict[plan.Step, int] = {}  # where each accepted step's attempt is in ``attempts``

    def runs_in(self, rung: str, precision: str) -> bool:
        return self.rungs[rung].runs_in(DType(precision))

    def attempt(self, step: plan.Step) -> plan.Outcome:
        dtype = DType(step.precision)
        if step.screen:
            return self.screens(dtype)
        rung = self.rungs[step.rung]
        screen = self.screens.passed.get(dtype)
        if isinstance(rung, EagerRung) and screen is not None:  # proven by its screen: not run again
            self.attempts.append(Attempt(rung.name, AttemptStatus.ACCEPTED, "answers proven by its screen", 0.0,
                                         dtype.value, screen.quality))
            self.forwards[step] = self.variants[dtype]
            return plan.Outcome.ACCEPTED
        attempt, forward = self.proof.attempt(rung, self.variants[dtype], dtype)
        self.attempts.append(attempt)
        if forward is not None:
            self.forwards[step] = forward
            self._attempt_of[step] = len(self.attempts) - 1
        return attempt.outcome()

    def faster(self, challenger: plan.Step, rival: plan.Step) -> plan.Step:
        """Race two accepted steps of one rung on the warmup batches; record both times; the challenger (int8)
        serves only if it pays (``race.MIN_GAIN``). The loser's forward is dropped."""
        started = time.perf_counter()
        raced = self.races([self.forwards[challenger], self.forwards[rival]], self._raced_what(challenger, rival))
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
            self.attempts[index] = self.attempts[index].but(status=status, reason=reasons[step],
                                                            forward_ms=forward_ms)
        del self.forwards[loser]
        self.variants.drop(DType(loser.precision))  # the reference (fp32) stays: it serves the eager fallback
        log = logger.warning if raced.disturbed else logger.info
        log("raced %s (%s) against %s on %s: %s; %s serves, in %.1fs", challenger.precision,
            challenger.rung, rival.precision, rival.rung, timed, winner.precision, since(started))
        return winner

    def settled(self, challenger: plan.Step, rival: plan.Step) -> bool:
        """Whether a reliable race that an earlier load on this machine kept found the (accepted) challenger faster
        than ``rival``: then the challenger serves and the rival is not built, which it would only be to lose."""
        earlier = self.races.earlier(self._raced_what(challenger, rival))
        if earlier is None or not race.pays(*earlier.ms):
            return False
        timed = self._timed(challenger, rival, earlier)
        index = self._attempt_of[challenger]
        self.attempts[index] = self.attempts[index].but(reason=f"faster: {timed}", forward_ms=earlier.ms[0])
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
            taken = self.int8_layers.taken()
            int8 = (self.int8_layers.by_rule, taken, str(self.screens.int8_rest()), self.int8_layers.weights.value)
        return challenger, rival, repr(getattr(self.rungs[challenger.rung], "spec", None)), int8

    def _timed(self, challenger: plan.Step, rival: plan.Step, raced: race.Race) -> str:
        return (f"{raced.ms[0]:.2f} ms in {challenger.precision} against {raced.ms[1]:.2f} in {rival.precision} (sum "
                f"of the fastest forward per warmup batch, {len(self.proof.batches)} batches, {race.ROUNDS} rounds, "
                f"{raced.describe()})")
