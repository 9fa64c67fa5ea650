"""The walk: each step ``handlers.ladder.plan`` asks for, run and recorded as an ``Attempt``; and the races the plan
asks to settle: two accepted steps of one rung (int8 and the next precision), or of two racing rungs (openvino and
compile), whose loser may still serve the warmup shapes it was faster at (``handlers.ladder.routes``).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from handlers.config import DType
from handlers.ladder import plan, race, routes
from handlers.ladder.attempts import Attempt, AttemptStatus, Forward, shape_of, since
from handlers.ladder.int8_layers import Int8Layers
from handlers.ladder.proof import Proof
from handlers.ladder.screens import Screens
from handlers.ladder.variants import ModelVariants
from handlers.rungs import EagerRung, Rung

logger = logging.getLogger(__name__)


class Walk:
    """Runs the steps ``plan.walk`` asks for (``attempt``), and decides its races (``faster``, ``settled``)."""

    def __init__(self, rungs: Sequence[Rung], proof: Proof, variants: ModelVariants, screens: Screens,
                 races: race.KeptRaces, int8_layers: Int8Layers, attempts: list[Attempt],
                 race_rungs: bool = True, precisions: Sequence[DType] = ()):
        self.rungs = {rung.name: rung for rung in rungs}
        self.order = [rung.name for rung in rungs]
        self.race_rungs = race_rungs
        self.precisions = tuple(p.value for p in precisions)
        self.rung_race: dict[str, object] | None = None  # the race of two rungs, for describe
        self._won_before: dict[str, tuple[float, str]] = {}  # a rung a kept race found faster: its time, and why
        self.routed = False  # the served forward routes some shapes to the rung that lost the race
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
        lost = self._lost_before(step)
        if lost is not None:
            self.attempts.append(lost)
            return plan.Outcome.SKIPPED
        attempt, forward = self.proof.attempt(rung, self._module(step), dtype)
        won = self._won_before.pop(step.rung, None)
        if won is not None and attempt.status is AttemptStatus.ACCEPTED:
            attempt = attempt.but(reason=f"faster: {won[1]}", forward_ms=won[0])
        self.attempts.append(attempt)
        if forward is not None:
            self.forwards[step] = forward
            self._attempt_of[step] = len(self.attempts) - 1
        return attempt.outcome()

    def rival_of(self, rung: str) -> str | None:
        """The rung ``rung`` races once accepted: the next racing rung after it in the ladder (openvino and compile
        race each other), where the YAML's ``pick`` is fastest."""
        if not self.race_rungs or not self.rungs[rung].races:
            return None
        later = self.order[self.order.index(rung) + 1:]
        return next((name for name in later if self.rungs[name].races), None)

    def faster(self, first: plan.Step, second: plan.Step) -> plan.Step:
        """Race two accepted steps on the warmup batches; record both times; the challenger serves only if it pays
        (``race.MIN_GAIN``). Of one rung the challenger is ``first`` (int8, against the next precision); of two rungs
        it is ``second``, the later rung of the ladder, and the loser still serves the smallest batches where it is
        faster on them (``routes``). The loser's forward is otherwise dropped."""
        started = time.perf_counter()
        challenger, rival = (first, second) if first.rung == second.rung else (second, first)
        raced = self.races([self.forwards[challenger], self.forwards[rival]], self._raced_what(first, second))
        ms = raced.ms
        pays = race.pays(ms[0], ms[1])
        winner, loser = (challenger, rival) if pays else (rival, challenger)
        timed = self._timed(challenger, rival, raced)
        what = _label(challenger, rival)
        if pays:
            reasons = {winner: f"faster: {timed}", loser: f"passed the gate, but {what} was faster here: {timed}"}
        else:
            reasons = {winner: f"serves: {what} passed the gate, but was not {race.MIN_GAIN:.0%} faster here: {timed}",
                       loser: f"passed the gate, but not {race.MIN_GAIN:.0%} faster here: {timed}"}
        routed = self._route(raced, loser == challenger) if challenger.rung != rival.rung else None
        if routed is not None:
            shown = ", ".join("x".join(map(str, shape)) for shape in routed)
            reasons[loser] = (f"serves the batches nearest the warmup shapes {shown} of {self._first_input()}, where "
                              f"it was at least {race.MIN_GAIN:.0%} faster: {timed}")
        for step, forward_ms in ((challenger, ms[0]), (rival, ms[1])):
            index = self._attempt_of[step]
            status = AttemptStatus.ACCEPTED if step == winner or routed is not None else AttemptStatus.SLOWER
            self.attempts[index] = self.attempts[index].but(status=status, reason=reasons[step],
                                                            forward_ms=forward_ms)
        if routed is not None:
            shapes = routes.shapes_of(self.proof.batches) or []
            switching = {side: self.rungs[step.rung].before_switching_in for side, step in
                         (("loser", loser), ("winner", winner)) if self.rungs[step.rung].before_switching_in}
            self.forwards[winner] = routes.Routed(self.forwards.pop(loser), self.forwards[winner], routed, shapes,
                                                  switching)
            self.routed = True
        else:
            del self.forwards[loser]
            if self._variant(loser) != self._variant(winner):
                self.variants.drop(self._variant(loser))  # the reference (fp32) stays: it serves the eager fallback
        if challenger.rung != rival.rung:
            self._said_race(winner, loser, challenger, rival, raced, routed)
        log = logger.warning if raced.disturbed else logger.info
        log("raced %s against %s: %s; %s (%s) serves%s, in %.1fs", _named(challenger), _named(rival), timed,
            winner.rung, winner.precision,
            f", {loser.rung} the batches it is faster at" if routed is not None else "", since(started))
        return winner

    def _route(self, raced: race.Race, challenger_lost: bool) -> list[routes.Shape] | None:
        """The warmup shapes the loser of a race of two rungs still serves (``routes.split``); None: none."""
        shapes = routes.shapes_of(self.proof.batches)
        if raced.per_batch is None or shapes is None:
            return None
        loser, winner = raced.per_batch if challenger_lost else reversed(raced.per_batch)
        return routes.split(loser, winner, shapes, race.MIN_GAIN)

    def _first_input(self) -> str:
        first = self.proof.batches[0]
        return f"'{next(iter(first))}'" if isinstance(first, Mapping) and first else "the first input"

    def _said_race(self, winner: plan.Step, loser: plan.Step, challenger: plan.Step, rival: plan.Step,
                   raced: race.Race, routed: list[routes.Shape] | None) -> None:
        """The race of two rungs as describe shows it."""
        ms = raced.ms
        self.rung_race = _race_said(_named(winner), _named(loser), {_named(challenger): ms[0], _named(rival): ms[1]},
                                    raced)
        if routed is not None:
            self.rung_race["routed"] = {"served_by": _named(loser), "input": self._first_input(),
                                        "nearest_warmup_shapes": ["x".join(map(str, shape)) for shape in routed]}
        if raced.per_batch is not None:
            self.rung_race["per_batch_ms"] = {
                _named(challenger): raced.per_batch[0], _named(rival): raced.per_batch[1],
                "shapes": [shape_of(batch) for batch in self.proof.batches]}

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

    def rung_settled(self, step: plan.Step, rival: str) -> bool:
        """Whether a reliable race that an earlier load on this machine kept found ``rival`` (the later rung) not
        faster than the accepted ``step``: then ``step`` serves and ``rival`` is not built."""
        earlier = self.races.earlier(self._raced_what(step, plan.Step(rival, "")))
        if earlier is None or race.pays(*earlier.ms) or self._route(earlier, challenger_lost=True) is not None:
            return False  # no kept race, the rival won it, or the rival serves small batches: build it
        said = (f"{earlier.ms[0]:.2f} ms on {rival} against {earlier.ms[1]:.2f} on {step.rung} ({step.precision}), "
                f"{earlier.describe()}")
        index = self._attempt_of[step]
        self.attempts[index] = self.attempts[index].but(
            reason=f"serves: {rival} was not {race.MIN_GAIN:.0%} faster here: {said}", forward_ms=earlier.ms[1])
        self.attempts.append(Attempt(rival, AttemptStatus.SLOWER, f"not built: not {race.MIN_GAIN:.0%} faster "
                                                                  f"than {step.rung} here: {said}", 0.0,
                                     forward_ms=earlier.ms[0]))
        self.rung_race = _race_said(_named(step), rival, {rival: earlier.ms[0], _named(step): earlier.ms[1]}, earlier)
        logger.info("%s (%s) serves: %s; %s not built", step.rung, step.precision, said, rival)
        return True

    def _lost_before(self, step: plan.Step) -> Attempt | None:
        """Where a reliable race an earlier load on this machine kept found ``step``'s rival rung faster, ``step`` is
        not built (it would only lose): the attempt that says so; else None."""
        rival = self.rival_of(step.rung)
        earlier = None if rival is None else self.races.earlier(self._raced_what(step, plan.Step(rival, "")))
        if earlier is None or not race.pays(*earlier.ms) or self._route(earlier, challenger_lost=False) is not None:
            return None  # no kept race, this step won it, or it serves small batches: build it
        said = (f"{earlier.ms[0]:.2f} ms on {rival} against {earlier.ms[1]:.2f} on {_named(step)}, "
                f"{earlier.describe()}")
        self.rung_race = _race_said(rival, _named(step), {rival: earlier.ms[0], _named(step): earlier.ms[1]}, earlier)
        self._won_before[rival] = (earlier.ms[0], said)
        logger.info("%s not built: %s was faster here: %s", _named(step), rival, said)
        return Attempt(step.rung, AttemptStatus.SLOWER, f"not built: {rival} was faster here: {said}", 0.0,
                       step.precision, forward_ms=earlier.ms[1])

    def _module(self, step: plan.Step) -> object:
        return self.variants[self._variant(step)]

    def _variant(self, step: plan.Step) -> DType:
        """The model variant ``step`` runs: a rung that converts the model itself takes the fp32 one."""
        return DType.FLOAT32 if self.rungs[step.rung].takes_float32 else DType(step.precision)

    def _raced_what(self, first: plan.Step, second: plan.Step) -> tuple[object, ...]:
        """What a race of two steps depends on besides the weights, batches and machine: the steps, how their rungs
        build forwards (their YAML options, versions), and how int8 was built (the layers it took, its float layers'
        dtype). A race of two rungs is kept under the first rung's step and the second rung's name (its precision is
        its own walk's), with the precisions tried."""
        identities = (self.rungs[first.rung].identity(), self.rungs[second.rung].identity())
        if first.rung != second.rung:
            return "rungs", first, second.rung, identities, self.precisions
        int8 = None
        if DType.INT8.value in (first.precision, second.precision):
            taken = self.int8_layers.taken()
            int8 = (self.int8_layers.by_rule, taken, str(self.screens.int8_rest()), self.int8_layers.weights.value)
        return first, second, identities[0], int8

    def _timed(self, challenger: plan.Step, rival: plan.Step, raced: race.Race) -> str:
        if challenger.rung != rival.rung:
            return (f"{raced.ms[0]:.2f} ms on {_named(challenger)} against {raced.ms[1]:.2f} on {_named(rival)} (sum "
                    f"of the fastest forward per warmup batch, {len(self.proof.batches)} batches, {race.ROUNDS} "
                    f"rounds, {raced.describe()})")
        return (f"{raced.ms[0]:.2f} ms in {challenger.precision} against {raced.ms[1]:.2f} in {rival.precision} (sum "
                f"of the fastest forward per warmup batch, {len(self.proof.batches)} batches, {race.ROUNDS} rounds, "
                f"{raced.describe()})")


def _named(step: plan.Step) -> str:
    return f"{step.rung} ({step.precision})"


def _label(challenger: plan.Step, rival: plan.Step) -> str:
    """The challenger as a race's reasons name it: its precision on one rung, its rung across two."""
    return challenger.precision if challenger.rung == rival.rung else challenger.rung


def _race_said(served: str, against: str, forward_ms: dict[str, float], raced: race.Race) -> dict[str, object]:
    """A race of two rungs as describe's ``rung_race`` shows it."""
    times = list(forward_ms.values())
    return {"served": served, "against": against, "forward_ms": forward_ms,
            "speedup": round(max(times) / max(min(times), 1e-9), 3), "measured": raced.describe()}
