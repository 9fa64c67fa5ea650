"""Which rows of a batch run together: sorted by length and cut into groups, each run at its own longest length,
where the model of the served forward's cost says that is cheaper than one forward padded to the batch's longest.

A batch of texts of mixed lengths is padded to its longest, and every layer computes the padding: at 8-96 words
about 40 % of a batch's tokens. Run as two or three groups of similar length, the batch computes far fewer tokens,
for a fixed cost per extra call. How much each costs depends on the CPU (on AMX tiles small matmuls are mostly fixed
cost, on AVX-512 they scale with their rows), so the cost of a forward is fitted at load from the served forward's
own times at the warmup shapes (``CostModel.fit``): a fixed part per call, a part per token (the linear layers),
and a part per token and token of its row (attention). Only for tasks whose answers are one row per text
(embeddings, text classification), where a row's answer does not depend on the rows beside it.

Pure Python + torch (least squares, and the race's timing); no TorchServe import.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.ladder import race
from handlers.ladder.decisions import DecisionStore, batch_tensors, fingerprint

logger = logging.getLogger(__name__)

# Fewer distinct warmup shapes than this leave the three parts undetermined: no model, no grouping.
MIN_SHAPES = 3
# A fit whose worst relative error at the shapes it was fitted to is larger says the times were not the forward's
# alone (quiet fits of MiniLM: 2-9 %; one timed while three archives compiled beside it: 61 %).
MAX_FIT_ERROR = 0.25
# How long the timing waits out a busy machine (``handlers.ladder.race``), shorter than a race: grouping is only a
# speed-up.
PATIENCE_S = 10.0
# How often a worker that could not time its forward looks for a model a sibling kept since (a file read).
LOOK_AGAIN_S = 30.0


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of one forward at (rows, seq): ``fixed_ms + rows * seq * (token_ms + seq * pair_ms)``."""

    fixed_ms: float
    token_ms: float
    pair_ms: float
    worst_error: float = 0.0  # the largest relative error of the fit on the shapes it was fitted to

    def ms(self, rows: int, seq: int) -> float:
        return self.fixed_ms + rows * seq * (self.token_ms + seq * self.pair_ms)

    @classmethod
    def fit(cls, timings: Sequence[tuple[int, int, float]]) -> CostModel | None:
        """The model that fits (rows, seq, ms) best in relative error, every part at least 0 (each subset of the
        parts is fitted, the best one whose parts are all >= 0 kept); None with fewer than ``MIN_SHAPES`` shapes."""
        shapes = {(rows, seq) for rows, seq, _ in timings}
        if len(shapes) < MIN_SHAPES or any(not ms > 0 for _, _, ms in timings):
            return None
        terms = torch.tensor([[1.0, rows * seq, rows * seq * seq] for rows, seq, _ in timings], dtype=torch.float64)
        times = torch.tensor([ms for _, _, ms in timings], dtype=torch.float64)
        best: tuple[float, list[float]] | None = None
        for used in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (1, 2, 3)):
            weighted = terms[:, list(used)] / times[:, None]  # relative error: a 2 ms shape counts as a 200 ms one
            solved = torch.linalg.lstsq(weighted, torch.ones_like(times)).solution
            if bool((solved < 0).any()):
                continue
            parts = [0.0, 0.0, 0.0]
            for index, value in zip(used, solved.tolist(), strict=True):
                parts[index] = value
            error = float(((terms @ torch.tensor(parts, dtype=torch.float64)) / times - 1).abs().max())
            if best is None or error < best[0]:
                best = (error, parts)
        assert best is not None  # the fixed part alone always solves to the mean time, > 0
        return cls(*best[1], worst_error=best[0])

    def describe(self) -> dict[str, Any]:
        return {"fixed_ms": round(self.fixed_ms, 4), "token_ms": round(self.token_ms, 6),
                "pair_ms": round(self.pair_ms, 9), "worst_error": round(self.worst_error, 3)}


@dataclass(frozen=True)
class NoCostModel:
    """Why a forward has no cost model: then every batch runs as one padded forward."""

    reason: str

    def describe(self) -> dict[str, Any]:
        return {"none": self.reason}


def groups(lengths: Sequence[int], most_rows: int, cost: Callable[[int, int], float]) -> list[list[int]]:
    """Row indices in groups of at most ``most_rows`` rows, each group run at its longest length: rows sorted by
    length, cut where the summed ``cost(rows, longest)`` of the groups is least (dynamic programming over the cuts).
    Ties keep fewer, larger groups."""
    order = sorted(range(len(lengths)), key=lambda row: (lengths[row], row))
    least = [0.0] + [math.inf] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(max(0, end - most_rows), end):
            total = least[start] + cost(end - start, lengths[order[end - 1]])
            if total < least[end]:
                least[end], cut[end] = total, start
    found, end = [], len(order)
    while end > 0:
        found.append(order[cut[end]:end])
        end = cut[end]
    return found[::-1]


def row_groups(mask: torch.Tensor, most_rows: int, cost: Callable[[int, int], float]) -> list[list[int]] | None:
    """``groups`` of a batch by its [rows, seq] attention mask, each row's length its extent (its last real token
    + 1: its length where padding is on the right, the whole row where it is on the left, so trimming a group to its
    longest never cuts a token); None for a single row."""
    if mask.dim() != 2 or mask.shape[0] < 2:
        return None
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    extents = (mask.ne(0) * positions).amax(dim=1).clamp(min=1)
    return groups(extents.tolist(), most_rows, cost)


def take_groups(inputs: Mapping[str, torch.Tensor], mask: torch.Tensor,
                groups: Sequence[Sequence[int]]) -> Iterator[dict[str, torch.Tensor]]:
    """Each group's rows of ``inputs``, trimmed to the group's last real token, in fresh tensors with the strides
    the compiled graph was traced with: a view's would fail its guards and the batch would be served eagerly (a
    one-row view counts as contiguous, so ``.contiguous()`` keeps its strides; a clone does not)."""
    for group in groups:
        index = torch.tensor(group)
        extent = int(mask.index_select(0, index).ne(0).any(dim=0).nonzero().max()) + 1
        yield {name: tensor.index_select(0, index)[:, :extent].clone(memory_format=torch.contiguous_format)
               for name, tensor in inputs.items()}


def _recalled(kept: DecisionStore, key: str) -> CostModel | None:
    earlier = kept.recall(key)
    if earlier is None:
        return None
    try:
        return CostModel(**earlier)
    except TypeError:
        logger.warning("length groups: the kept cost model %s is not one; timing again", key)
        return None


def kept_key(batches: Sequence[Mapping[str, torch.Tensor]], served: object, weights_key: str | None) -> str:
    """The memory's key for the cost model of one forward: what is served (rung, precision, options, shapes,
    machine), the weights (``memory.fingerprint`` of them, as the ladder hashes them) and the warmup batches."""
    return fingerprint("length groups", weights_key, served, tensors=batch_tensors(batches))


def measure(forward: Callable[..., Any], batches: Sequence[Any], calls: int = 3,
            synchronize: Callable[[], None] = lambda: None, patience_s: float = PATIENCE_S,
            kept: DecisionStore | None = None, key: str | None = None) -> CostModel | NoCostModel:
    """The cost model of ``forward`` (already warm at these shapes): its fastest of ``calls`` at each batch of named
    [rows, seq] tensors, timed as the ladder's races are (``handlers.ladder.race``: run again while other processes keep
    this worker waiting, for up to ``patience_s``), and fitted. A model an earlier load kept in ``kept`` under
    ``key`` (``kept_key``) is read instead; a new one is kept there. No model, and why, where the batches are not
    such mappings, the machine stayed busy, or the times do not fit the model (``MAX_FIT_ERROR``)."""
    if not batches or not all(isinstance(batch, Mapping) and batch for batch in batches):
        return NoCostModel("the warmup batches are not named tensors")
    if kept is not None and key is not None:
        earlier = _recalled(kept, key)
        if earlier is not None:
            return earlier

    def call(batch: Mapping[str, torch.Tensor], _: Any) -> None:
        forward(**batch)
        synchronize()

    try:
        # one forward, its shapes taking turns: nothing else runs between two calls to slow one
        raced = race.run_race(list(batches), [None], call, rounds=calls, patience_s=patience_s, in_a_row=1)
    except Exception as exc:  # noqa: BLE001 -- grouping is only a speed-up: a forward that fails here never fails a load
        return _none(f"timing the forward failed: {type(exc).__name__}: {exc}", logging.WARNING)
    if raced.disturbed:
        return _none(f"the machine stayed busy while timing it ({raced.describe()})")
    model = CostModel.fit([(*next(iter(batch.values())).shape[:2], ms) for batch, ms in zip(batches, raced.ms,
                                                                                            strict=True)])
    if model is None:
        return _none(f"fewer than {MIN_SHAPES} warmup shapes, or a forward timed at 0 ms, to fit one to")
    if model.worst_error > MAX_FIT_ERROR:
        return _none(f"the times do not fit one ({model.describe()})")
    if kept is not None and key is not None:
        kept.keep(key, dataclasses.asdict(model))
    return model


def _none(reason: str, level: int = logging.INFO) -> NoCostModel:
    logger.log(level, "length groups: no cost model, %s", reason)
    return NoCostModel(reason)


@dataclass
class LookAgain:
    """For a worker that got no cost model at load (it timed a machine its siblings kept busy while they loaded):
    while it serves, it looks in the memory again every ``every_s`` for the model a sibling of the same forward kept
    since, once that sibling timed it on a quiet moment. Each look is a file read; the forward is never timed live."""

    kept: DecisionStore
    key: str
    every_s: float = LOOK_AGAIN_S
    clock: Callable[[], float] = time.monotonic
    _due: float | None = None

    def __call__(self) -> CostModel | None:
        now = self.clock()
        if self._due is None:
            self._due = now + self.every_s
        if now < self._due:
            return None
        self._due = now + self.every_s
        return _recalled(self.kept, self.key)


class LengthGrouping:
    """The cost model rows are grouped by (``cost``); where the load had none, why (``no_cost``) and, where a sibling
    may keep one later, the look for it (``look_again``)."""

    def __init__(self, cost: CostModel | None, no_cost: NoCostModel | None = None,
                 look_again: LookAgain | None = None):
        self.cost = cost
        self.no_cost = no_cost
        self.look_again = look_again

    @classmethod
    def measured(cls, forward: Callable[..., Any], batches: Sequence[Any], synchronize: Callable[[], None],
                 kept: DecisionStore | None, key: str | None) -> LengthGrouping:
        """The served ``forward``'s cost model, timed on the warmup ``batches`` (or kept by an earlier load under
        ``key``, and kept for the next)."""
        found = measure(forward, batches, synchronize=synchronize, kept=kept, key=key)
        if isinstance(found, CostModel):
            logger.info("length groups: %s", found.describe())
            return cls(found)
        return cls(None, found, LookAgain(kept, key) if kept is not None and key is not None else None)

    def cost_now(self) -> CostModel | None:
        """The cost model; a worker that had none at load looks for one a sibling kept since."""
        if self.cost is None and self.look_again is not None:
            self.cost = self.look_again()
            if self.cost is not None:
                self.look_again, self.no_cost = None, None
                logger.info("length groups: the model another worker of this forward kept since: %s",
                            self.cost.describe())
        return self.cost

    def describe(self) -> dict[str, Any] | None:
        """The fitted cost model; else why there is none (every batch runs as one)."""
        if self.cost is not None:
            return self.cost.describe()
        if self.no_cost is None:
            return None
        said = self.no_cost.describe()
        if self.look_again is not None:
            said["looks_again_every_s"] = self.look_again.every_s  # for the model another worker of it keeps
        return said
