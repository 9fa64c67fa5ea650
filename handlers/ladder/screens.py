"""A precision's screen: before its first attempt on any rung, the model runs eagerly in it through the warmup and
the gate (seconds, no compile). A precision whose eager answers fail is tried on no rung; so is a half precision
that ``auto`` picked and that is no faster than fp32 eager here (raced on the warmup batches).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch

from handlers.config import DType
from handlers.ladder import plan, race
from handlers.ladder.attempts import Attempt, AttemptStatus, summarize
from handlers.ladder.int8_layers import Int8Layers
from handlers.ladder.proof import Proof
from handlers.ladder.variants import ModelVariants
from handlers.rungs import EagerRung

logger = logging.getLogger(__name__)

# Timed calls per forward when a half precision's screen races fp32 eager: eager calls, no compile, so 3 suffice
# to find each one's fastest; the load pays ~3 eager passes of the warmup in each precision.
SCREEN_ROUNDS = 3


class Screens:
    """Each precision screened once, on first use; the attempts go to ``record``. int8's float layers run in
    ``int8_rest`` (bf16 where the ladder tries it), but only where bf16's own screen passed."""

    def __init__(self, proof: Proof, variants: ModelVariants, int8_layers: Int8Layers, races: race.KeptRaces,
                 must_beat_fp32: Collection[DType], int8_rest: torch.dtype, record: Callable[[Attempt], None]):
        self.proof = proof
        self.variants = variants
        self.int8_layers = int8_layers
        self.races = races
        self.must_beat_fp32 = frozenset(must_beat_fp32)
        self._int8_rest = int8_rest
        self.record = record
        self.passed: dict[DType, Attempt] = {}  # the screens that passed
        self._outcomes: dict[DType, plan.Outcome] = {}  # every screen run: int8 asks for bf16's before plan does

    def __call__(self, dtype: DType) -> plan.Outcome:
        """How ``dtype``'s screen went (run on the first call)."""
        if dtype not in self._outcomes:
            self._outcomes[dtype] = self._run(dtype)
        return self._outcomes[dtype]

    def int8_rest(self) -> torch.dtype:
        """The precision int8's float layers run in: bf16 where the ladder tries bf16 and bf16's screen passed (it
        keeps the answers and, where it must, pays); float32 otherwise. Screens bf16 first if it has not been."""
        if self._int8_rest is torch.bfloat16 and self(DType.BFLOAT16) is not plan.Outcome.ACCEPTED:
            return torch.float32
        return self._int8_rest

    def _run(self, dtype: DType) -> plan.Outcome:
        outcome = self._screen(dtype)
        if dtype is DType.INT8 and outcome is not plan.Outcome.ACCEPTED and self.int8_layers.widened():
            # The real int8 model lost what the simulation kept: int8 by the rule alone, judged afresh.
            self.int8_layers.by_rule = True
            self.variants.drop(dtype)
            return self._screen(dtype)
        return outcome

    def _screen(self, dtype: DType) -> plan.Outcome:
        widened = dtype is DType.INT8 and self.int8_layers.widened()
        if_not = ("; int8 is built again with the rule's float layers" if widened
                  else f"; so no rung runs in {dtype.value}")
        try:  # the first use of the precision: its converted copy is made here
            model = self.variants[dtype]
        except Exception as exc:  # noqa: BLE001 -- a model that cannot be converted: no rung runs in it
            logger.warning("converting the model to %s failed: %s", dtype.value, summarize(exc), exc_info=True)
            self.record(Attempt(plan.EAGER, AttemptStatus.FAILED,
                                f"screen: converting the model to {dtype.value} failed: {summarize(exc)}{if_not}",
                                0.0, dtype.value, screen=True))
            return plan.Outcome.RAISED
        attempt, _ = self.proof.attempt(EagerRung(), model, dtype)
        if attempt.status is AttemptStatus.ACCEPTED and dtype in self.must_beat_fp32:
            attempt = self._race_fp32_eager(model, dtype, attempt)
        if attempt.status is AttemptStatus.ACCEPTED:
            kept = f"{dtype.value} keeps the answers in eager"
            if dtype is DType.INT8:
                rest = str(self.int8_rest()).removeprefix("torch.")
                kept += f" (its float layers in {rest}; {self.int8_layers.describe()})"
            attempt = attempt.but(status=AttemptStatus.PASSED, screen=True,
                                  reason=f"screen: {kept}{attempt.reason or ''}; faster rungs try it first")
            self.passed[dtype] = attempt
        elif attempt.status is AttemptStatus.SLOWER:
            self.variants.drop(dtype)
        else:
            loses = (f", with {self.int8_layers.describe()}{if_not}" if widened
                     else f"{if_not} (the precision loses the answers)")
            attempt = attempt.but(screen=True, reason=f"screen: {attempt.reason}{loses}")
            self.variants.drop(dtype)
        self.record(attempt)
        return attempt.outcome()

    def _race_fp32_eager(self, model: torch.nn.Module, dtype: DType, screen: Attempt) -> Attempt:
        """``screen`` (passed) with the race of ``model`` in ``dtype`` against fp32 eager on the warmup batches: still
        accepted where the half precision pays (``race.MIN_GAIN``), SLOWER where it does not."""
        raced = self.races([model, self.proof.reference], f"eager {dtype.value} against eager float32",
                           SCREEN_ROUNDS)
        half_ms, fp32_ms = raced.ms
        timed = (f"{half_ms:.2f} ms eager in {dtype.value} against {fp32_ms:.2f} in float32 (sum of the fastest "
                 f"forward per warmup batch, {len(self.proof.batches)} batches, {SCREEN_ROUNDS} rounds, "
                 f"{raced.describe()})")
        log = logger.warning if raced.disturbed else logger.info
        if race.pays(half_ms, fp32_ms):
            log("screen: %s pays here: %s", dtype.value, timed)
            return screen.but(reason=f", and is faster than float32 here: {timed}", forward_ms=half_ms)
        log("screen: %s keeps the answers but is not faster than float32 here: %s; no rung runs in it", dtype.value,
            timed)
        return screen.but(status=AttemptStatus.SLOWER, screen=True, forward_ms=half_ms,
                          reason=f"screen: {dtype.value} keeps the answers in eager, but is not {race.MIN_GAIN:.0%} "
                                 f"faster than float32 here: {timed}; so no rung runs in {dtype.value} (auto serves "
                                 "the faster precision)")
