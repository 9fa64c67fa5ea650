"""The optimization ladder: try rungs at precisions at load time, serve the first attempt that proves itself.

``run_ladder`` walks the rungs x precisions in ``plan``'s order (``walk``): each precision is screened first
(``screens``), each attempt proven on the warmup batches against fp32 eager (``proof``), int8's layers measured
(``int8_layers``) and int8 raced against the next precision (``race``), what a load measured kept for the next
(``decisions``). fp32 eager is the reference and the last resort. ``guard`` runs the accepted forward on live traffic.

Pure torch; no TorchServe import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from handlers.config import DType
from handlers.ladder import plan, race
from handlers.ladder.attempts import Attempt, AttemptStatus, Forward, LadderResult, NotCompiled, shape_of, summarize
from handlers.ladder.decisions import Decisions
from handlers.ladder.gate import Quality, QualityError, QualityGate, detached, tensors
from handlers.ladder.inputs import Calibration, Precisions, Run, Site, Warmup, call
from handlers.ladder.int8_layers import Int8Layers
from handlers.ladder.proof import Proof
from handlers.ladder.screens import Screens
from handlers.ladder.variants import ModelVariants
from handlers.ladder.walk import Walk
from handlers.rungs import Rung, module_guards

__all__ = ["Attempt", "AttemptStatus", "Calibration", "Forward", "LadderResult", "NotCompiled", "Precisions",
           "Quality", "QualityError", "QualityGate", "Run", "Site", "Warmup", "call", "run_ladder", "shape_of",
           "summarize", "tensors"]

logger = logging.getLogger(__name__)

# Precisions that trade answers for speed: each serves only where it is faster than the next precision that
# keeps the answers, on the same rung (handlers.ladder.race).
MUST_PAY = (DType.INT8,)


def run_ladder(reference: torch.nn.Module, rungs: Sequence[Rung], warmup: Warmup, precisions: Precisions,
               site: Site | None = None, module_guards_optional: bool = True, race_rungs: bool = True) -> LadderResult:
    """Walk ``rungs`` x ``precisions`` (fastest first) in ``handlers.ladder.plan``'s order; return the first attempt
    that runs and whose answers pass ``warmup``'s gate against ``reference`` (the fp32 model run eagerly). If none
    does, serve the reference. An accepted int8 attempt serves only if it is faster on the warmup batches than the
    same rung at the next precision that passes (``MUST_PAY``); int8's float layers run in bf16 only where bf16's
    screen passed, and which of them int8 takes too is measured. What a load measures is kept at ``site`` for the
    next load. An accepted compiled forward is proven again at each of the site's thread counts. Unless
    ``module_guards_optional`` is False, compile rungs leave out the guards on the model's attributes where the
    reference forwards left them as they were (``handlers.rungs.module_guards``). With ``race_rungs``, an accepted
    rung that races (openvino, compile) is raced against the next racing rung of the ladder, and the faster serves."""
    site = site or Site()
    with torch.inference_mode():
        references, changed = module_guards.run_watching_state(
            reference, warmup.batches, lambda module, batch: detached(warmup.run(module, batch)))
    rungs, guards_kept = _module_guards(rungs, changed, module_guards_optional)
    calibration = precisions.int8_calibration
    if DType.INT8 in precisions.order and calibration is None:
        calibration = Calibration(warmup.batches, (), "the warmup batches")
    for rung in rungs:
        rung.prepare(warmup.batches)
    walk = _walk(reference, rungs, warmup, references, precisions, calibration, site, race_rungs)
    step = plan.walk([rung.name for rung in rungs], [p.value for p in precisions.order], walk.attempt,
                     runs_in=walk.runs_in, must_pay=[p.value for p in MUST_PAY], faster=walk.faster,
                     settled=walk.settled, rival_of=walk.rival_of, rung_settled=walk.rung_settled,
                     own_precision=lambda name: walk.rungs[name].own_precision)
    calibration_said = None if calibration is None else calibration.describe(len(warmup.batches))
    weights_key = walk.races.decisions.weights_key
    if step.is_reference:
        planned = DType.FLOAT32 in precisions.order
        reason = None if planned else (f"no rung kept the answers in "
                                       f"{' or '.join(p.value for p in precisions.order)}; serving fp32 eager")
        walk.attempts.append(Attempt(plan.EAGER, AttemptStatus.ACCEPTED, reason, 0.0, DType.FLOAT32.value))
        return LadderResult(plan.EAGER, reference, DType.FLOAT32, walk.attempts, calibration_said, weights_key,
                            module_guards=guards_kept or "not compiled: eager serves", rung_race=walk.rung_race)
    rung, dtype, forward = walk.rungs[step.rung], DType(step.precision), walk.forwards[step]
    threads = None if rung.follows_threads() and not walk.routed else (torch.get_num_threads(),)
    if rung.compiles and not walk.routed:  # routed: OpenVINO's part runs at the count it was compiled for
        threads = walk.proof.at_thread_counts(rung, forward, dtype, site.thread_counts)
    return LadderResult(step.rung, forward, dtype, walk.attempts, calibration_said, weights_key, threads,
                        _module_guards_said(rung, dtype, guards_kept, len(warmup.batches)), walk.rung_race)


def _walk(reference: torch.nn.Module, rungs: Sequence[Rung], warmup: Warmup, references: Sequence[object],
          precisions: Precisions, calibration: Calibration | None, site: Site, race_rungs: bool) -> Walk:
    """The walk's parts, wired: what proves an attempt, the decisions kept, int8's layers, the model in each
    precision, the screens and the races."""
    proof = Proof(reference, warmup, references, calibration)
    decisions = Decisions(site.decisions, reference, warmup.run)
    races = race.KeptRaces(decisions, warmup.batches, warmup.run, site.machine)
    int8_layers = Int8Layers(proof, decisions, precisions.int8_weights)
    attempts: list[Attempt] = []
    variants = ModelVariants(reference, calibration, int8_layers, lambda: screens.int8_rest())
    screens = Screens(proof, variants, int8_layers, races, precisions.must_beat_fp32,
                      torch.bfloat16 if DType.BFLOAT16 in precisions.order else torch.float32, attempts.append)
    return Walk(rungs, proof, variants, screens, races, int8_layers, attempts, race_rungs, precisions.order)


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
    return [rung.without_module_guards() for rung in rungs], None


def _module_guards_said(rung: Rung, dtype: DType, kept: str | None, forwards: int) -> str:
    """What describe says about the served forward's guards on the model's attributes."""
    if kept is not None:
        return kept
    if not rung.compiles:
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
