"""Which of the layers int8's rule keeps in float int8 takes too, measured once per model and kept between loads
(``handlers.precision.sensitivity`` measures; this module asks it with the ladder's gate and batches).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from handlers.config import DType
from handlers.ladder.attempts import summarize
from handlers.ladder.decisions import Decisions
from handlers.ladder.gate import QualityError
from handlers.ladder.proof import Proof
from handlers.precision import sensitivity
from handlers.precision.quantize import Int8Weights, stays_float

logger = logging.getLogger(__name__)


class Int8Layers:
    """The layers int8 takes beyond its rule (``choice``, measured on first use), unless the real int8 model lost
    what the measurement kept: then int8 is built by the rule alone (``by_rule``)."""

    def __init__(self, proof: Proof, decisions: Decisions, weights: Int8Weights):
        self.proof = proof
        self.decisions = decisions
        self.weights = weights
        self.by_rule = False
        self._choice: sensitivity.Choice | None = None

    def choice(self) -> sensitivity.Choice:
        """Which of the layers int8's rule keeps in float int8 takes too, and in which form (measured once)."""
        if self._choice is None:
            self._choice = self._measure()
        return self._choice

    def widened(self) -> bool:
        """Whether int8 is (to be) built with layers beyond its rule: measures them on first use."""
        choice = self.choice()
        return not self.by_rule and bool(choice.taken or choice.split)

    def taken(self) -> tuple[object, ...]:
        """What the int8 model is built with beyond its rule: nothing, or the layers taken and those split."""
        if self.by_rule:
            return ()
        choice = self.choice()
        return choice.taken, sorted(choice.split.items())

    def describe(self) -> str:
        if self.by_rule:
            return "the rule's float layers only: with the measured ones too it lost the answers"
        return self.choice().describe()

    def _measure(self) -> sensitivity.Choice:
        proof = self.proof
        calibration = proof.calibration
        assert calibration is not None  # run_ladder gives one whenever int8 is tried
        reference = proof.reference
        linears = {name: layer for name, layer in reference.named_modules() if isinstance(layer, torch.nn.Linear)}
        candidates = [name for name, layer in linears.items() if stays_float(name, layer)]
        gate = proof.gate(DType.INT8)
        batches, references = list(proof.batches), list(proof.references)
        held_out = proof.held_out(DType.INT8)
        if held_out is not None:
            batches, references = batches + list(held_out[0]), references + list(held_out[1])

        def scorer(judged: Sequence[Any], wanted: Sequence[Any]) -> sensitivity.Score:
            def score(module: torch.nn.Module) -> float:
                worst = float("inf")
                with torch.inference_mode():
                    for batch, expected in zip(judged, wanted, strict=True):
                        try:
                            worst = min(worst, gate.measure(proof.run(module, batch), expected))
                        except QualityError:  # e.g. a label that flipped: this layer stays float
                            return float("-inf")
                return worst

            return score

        quantized = [name for name in linears if name not in candidates]
        try:
            key = self.decisions.key("int8 layers", sensitivity.SHARE, sensitivity.OUTLIER_CHANNELS, candidates,
                                     quantized, type(gate).__name__, gate.threshold, self.weights.value,
                                     batches=[*calibration.batches, *batches])
            choice = self.decisions.recall(key, sensitivity.Choice.from_record)
            if choice is None:
                # Each layer alone is scored on the held-out batches only (the harsher texts), the chosen ones
                # together on every batch the gate judges.
                choice = sensitivity.choose(reference, candidates, calibration.batches, scorer(batches, references),
                                            gate.threshold, quantized=quantized,
                                            score_alone=None if held_out is None else scorer(*held_out),
                                            weights=self.weights)
                self.decisions.keep(key, choice.record())
        except Exception as exc:  # noqa: BLE001 -- measuring is an extra: without it, the rule alone
            logger.warning("int8: measuring the layers kept in float failed (%s); the rule alone decides",
                           summarize(exc), exc_info=True)
            return sensitivity.Choice((), {}, 0.0, 0.0)
        logger.info("int8: %s: as they are: %s; with their largest input channels in float: %s", choice.describe(),
                    ", ".join(choice.taken) or "none", ", ".join(choice.split) or "none")
        return choice
