"""Which of the layers static int8 keeps in float by rule can be quantized too: measured before int8 is built.

``handlers.precision.quantize.stays_float`` keeps every layer that narrows (a transformer's FFN output) and every
attention value projection in float: about 40 % of a BERT encoder's linear work. Which of them int8 spoils differs by
model, and mostly by a few input channels whose values dwarf the rest (one scale per tensor spent on them rounds the
others to a few steps). So each of those layers is *simulated* in int8, alone, the rest of the model in float: its
input rounded per tensor to uint8 with the scale the quantizer's own histogram observer picks on the calibration
batches, its weights per output channel to int8 (``torch.fake_quantize_*``, the quantizer's specs); once as it is, once
with its
``OUTLIER_CHANNELS`` largest input channels kept in float (``handlers.precision.quantize.OutlierSplit``). The task's
gate scores each form, and the layer keeps the cheaper. Then the cheapest layers are simulated together, with the
layers int8 quantizes anyway, as many as cost at most ``SHARE`` of the margin those leave above the gate's threshold
(found by halving). Seconds for MiniLM, where building and judging a real int8 model takes tens. A layer measured alone
changes nothing before it: where the model runs its layers as a list of blocks (a transformer's encoder layers), the
blocks before the one holding it give back what they gave on the same batches with none of the candidates simulated
(recorded once), so only the rest runs: the same answers to the bit, in a third less time. The real int8 model is then
judged by the gate as always; if it fails, the ladder builds int8 again with the rule's float layers
(``handlers.ladder``).

Pure torch + torchao (imported only when int8 is built).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from handlers.precision.quantize import Int8Weights, x86_config

logger = logging.getLogger(__name__)

# Of the margin the rule's own int8 leaves above the gate's threshold (simulated; MiniLM: about 0.995 against 0.99),
# the share the extra layers may cost together: the rest is room for texts the gate did not judge.
SHARE = 0.5
# Input channels a layer may keep in float: in MiniLM's FFN outputs one or two channels reach 14-24 where the rest
# stay under 5, and one scale per tensor spent on them rounds the rest to a few steps. With the 4 largest in float
# each FFN output costs 0.0001-0.0002 of cosine in int8, where it cost up to 0.009.
OUTLIER_CHANNELS = 4
# The most the blocks' recorded outputs may take (MiniLM's: 28 MB); past it, every layer is measured in a whole
# forward, as before the replay.
REPLAY_BYTES = 1 << 30
Score = Callable[[torch.nn.Module], float]  # the gate's worst value over the judged batches; -inf if it raised


@dataclass(frozen=True)
class Choice:
    """The layers to quantize beyond the rule: ``taken`` as they are, ``split`` (name -> input channels) with those
    few channels kept in float (``handlers.precision.quantize.OutlierSplit``); what each candidate cost alone in its
    cheaper form (``costs``: the gate's best value minus its value with that layer in int8), the budget the chosen ones
    cost
    ``together`` within, and the time it took."""

    taken: tuple[str, ...]
    costs: Mapping[str, float]
    budget: float
    seconds: float
    split: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    together: float = 0.0  # what the chosen layers cost the gate together, simulated
    remembered: bool = False  # read back from an earlier load's measurement (``handlers.ladder.decisions``)

    def describe(self) -> str:
        if not self.costs:
            return "no layer is kept in float by rule"
        chosen = [*self.taken, *self.split]
        split = (f" ({len(self.split)} with their {OUTLIER_CHANNELS} largest input channels in float)" if self.split
                 else "")
        when = "remembered from an earlier load" if self.remembered else f"{self.seconds:.1f}s"
        return (f"{len(chosen)} of the {len(self.costs)} layers kept in float by rule quantized too{split}, measured "
                f"alone, then together: cost {self.together:.6f} within {self.budget:.6f}, {when}")

    def record(self) -> dict[str, Any]:
        """What ``handlers.ladder.decisions`` keeps of this choice for the next load."""
        return {**dataclasses.asdict(self), "remembered": False}

    @classmethod
    def from_record(cls, saved: Mapping[str, Any]) -> Choice:
        """A choice an earlier load kept (``record``); raises KeyError, TypeError or ValueError if it is not one."""
        return cls(tuple(saved["taken"]), dict(saved["costs"]), float(saved["budget"]), float(saved["seconds"]),
                   {name: tuple(channels) for name, channels in saved["split"].items()}, float(saved["together"]),
                   remembered=True)


def choose(module: torch.nn.Module, candidates: Sequence[str], calibration: Sequence[Mapping[str, torch.Tensor]],
           score: Score, threshold: float, share: float = SHARE, quantized: Sequence[str] = (),
           score_alone: Score | None = None, weights: Int8Weights = Int8Weights.FULL) -> Choice:
    """Of ``candidates`` (names of ``nn.Linear`` layers in ``module``, a float32 model), the cheapest in simulated
    int8, as many as can be together while they cost ``score`` at most ``share`` of the margin left above
    ``threshold`` with the ``quantized`` layers (those int8 quantizes anyway) simulated in int8. Each candidate is
    first measured alone in two forms, as it is and with its ``OUTLIER_CHANNELS`` largest input channels (on
    ``calibration``) in float, and kept in the cheaper; then the cheapest ones are measured together, the count found
    by halving. ``score_alone`` (by default ``score``) scores the layers alone: fewer batches make the load shorter,
    and only the layers' order depends on it. Weights are rounded to ``weights``' range, as the real int8 rounds
    them. ``module`` is left as it was: a simulated layer stands in for the real
    one while it is scored, then the real one is put back."""
    started = time.perf_counter()
    if not candidates:
        return Choice((), {}, 0.0, 0.0)
    layers = {name: module.get_submodule(name) for name in [*candidates, *quantized]}
    plain, channels = _observe_inputs(module, layers, calibration)
    outliers = {name: channels[name][:OUTLIER_CHANNELS] for name in candidates}
    masked, _ = _observe_inputs(module, {name: layers[name] for name in candidates}, calibration, outliers)
    anyway = {name: _int8_output(layers[name], *plain[name], weights=weights) for name in quantized}
    blocks = _Blocks.of(module, candidates)

    def simulated(stand_ins: Mapping[str, torch.nn.Module], scorer: Score = score) -> float:
        swapped = {**anyway, **stand_ins}
        for name, stand_in in swapped.items():
            _swap(module, name, stand_in)
        try:
            return scorer(module)
        finally:
            for name in swapped:
                _swap(module, name, layers[name])

    alone_scorer = score_alone or score
    # The rule's int8 alone; the blocks' outputs, to replay, on the batches layers are scored alone on.
    best = blocks.recorded(partial(simulated, {}), score_alone is None)
    if not best > threshold:  # it loses the answers already (also NaN, -inf): nothing to spend
        return Choice((), dict.fromkeys(candidates, float("inf")), 0.0, time.perf_counter() - started)
    best_alone = best if score_alone is None else blocks.recorded(partial(simulated, {}, alone_scorer))

    def cost(stand_ins: Mapping[str, torch.nn.Module]) -> float:
        return best - simulated(stand_ins)

    costs, forms = {}, {}
    for name in candidates:
        layer = layers[name]
        for form, stand_in in (("plain", _int8_output(layer, *plain[name], weights=weights)),
                               ("split", _int8_output(layer, *masked[name], outliers[name], weights))):
            alone = best_alone - blocks.replayed(name, partial(simulated, {name: stand_in}, alone_scorer))
            if name not in costs or alone < costs[name]:  # a tie keeps the plain form: no extra work per call
                costs[name], forms[name] = alone, (form, stand_in)
    blocks.forget()
    budget = share * (best - threshold)
    cheapest = sorted(costs, key=lambda name: (costs[name], name))
    count, spent = _most_within(budget, len(cheapest),
                                lambda count: cost({name: forms[name][1] for name in cheapest[:count]}))
    chosen = cheapest[:count]
    return Choice(tuple(name for name in chosen if forms[name][0] == "plain"), costs, budget,
                  time.perf_counter() - started,
                  {name: outliers[name] for name in chosen if forms[name][0] == "split"}, spent)


class _Blocks:
    """The model's longest list of blocks (a transformer's layers), run in order; each candidate's block. Records
    what each block gave on one scoring's batches (and what the first was given), and replays it for the blocks
    before a candidate's while the first is given the same."""

    def __init__(self, blocks: Sequence[torch.nn.Module], index: Mapping[str, int]):
        self.blocks, self.index = blocks, index
        self.outputs: list[list[torch.Tensor]] | None = None  # per block, per call; None: nothing to replay
        self.inputs: list[torch.Tensor] = []  # the first block's, per call

    @classmethod
    def of(cls, module: torch.nn.Module, candidates: Sequence[str]) -> _Blocks:
        lists = [(name, layer) for name, layer in module.named_modules() if isinstance(layer, torch.nn.ModuleList)]
        if not lists:
            return cls([], {})
        prefix, blocks = max(lists, key=lambda named: len(named[1]))
        index = {name: int(name[len(prefix) + 1:].split(".")[0]) for name in candidates
                 if name.startswith(f"{prefix}.") and name[len(prefix) + 1:].split(".")[0].isdigit()}
        return cls(list(blocks), index)

    def recorded(self, scored: Callable[[], float], record: bool = True) -> float:
        """``scored()``, keeping what each block gave (if ``record``) to replay."""
        if not record:
            return scored()
        with self._recording():
            return scored()

    def forget(self) -> None:
        self.outputs, self.inputs = None, []

    @contextmanager
    def _recording(self) -> Iterator[None]:
        """What each block gives while this is held, and what the first is given: kept if every one is a tensor,
        within ``REPLAY_BYTES``. First among the blocks' hooks: what the block itself gave."""
        outputs: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        inputs: list[torch.Tensor] = []
        kept = [0 if self.blocks else REPLAY_BYTES + 1]  # bytes so far; past the cap, nothing is kept

        def keep(block: int) -> Callable[..., None]:
            def hook(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
                given = args[0] if args else None
                if not isinstance(output, torch.Tensor) or (block == 0 and not isinstance(given, torch.Tensor)):
                    kept[0] = REPLAY_BYTES + 1
                if kept[0] > REPLAY_BYTES:
                    return
                outputs[block].append(output.detach().clone())
                kept[0] += output.nbytes
                if block == 0:
                    inputs.append(given.detach().clone())
                    kept[0] += given.nbytes
                if kept[0] > REPLAY_BYTES:  # let go of what was kept at once
                    inputs.clear()
                    for per_block in outputs:
                        per_block.clear()

            return hook

        handles = [block.register_forward_hook(keep(index), prepend=True) for index, block in enumerate(self.blocks)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.outputs, self.inputs = (outputs, inputs) if kept[0] <= REPLAY_BYTES else (None, [])

    def replayed(self, name: str, scored: Callable[[], float]) -> float:
        """``scored()`` with the blocks before ``name``'s giving back their recorded outputs; run whole where they
        cannot: nothing recorded, a block with a ``forward`` of its own, the first block given other inputs than
        when recorded (a loop feeding answers back), or a block called other than as often as it was."""
        before = self.index.get(name, 0)
        outputs = self.outputs
        if outputs is None or before == 0 or any("forward" in vars(block) for block in self.blocks[:before]):
            return scored()
        calls, strayed = [0] * before, [False]

        def replay(block: int) -> Callable[..., torch.Tensor]:
            def forward(*args: Any, **_: Any) -> torch.Tensor:
                call = calls[block]
                if call >= len(outputs[block]) or (block == 0 and not (
                        args and isinstance(args[0], torch.Tensor) and torch.equal(args[0], self.inputs[call]))):
                    strayed[0] = True
                    raise _NotRecorded
                calls[block] += 1
                return outputs[block][call].clone()  # the model may change it in place

            return forward

        for block in range(before):
            self.blocks[block].forward = replay(block)  # an instance attribute: nn.Module calls it
        try:
            value = scored()
        except _NotRecorded:
            value = None
        finally:
            for block in range(before):
                del self.blocks[block].forward
        if strayed[0] or calls != [len(outputs[block]) for block in range(before)]:
            return scored()
        return value


class _NotRecorded(Exception):
    """A replayed block was called other than as when it was recorded."""


def _most_within(budget: float, most: int, together: Callable[[int], float]) -> tuple[int, float]:
    """The largest count (at most ``most``) whose ``together(count)`` stays within ``budget``, and that cost. Layers
    cost more together than alone, and the cheapest k together cost more as k grows: halving finds it."""
    low, high, spent = 0, most, 0.0
    while low < high:
        count = (low + high + 1) // 2
        cost = together(count)
        if cost <= budget:
            low, spent = count, cost
        else:
            high = count - 1
    return low, spent


def _specs(weights: Int8Weights = Int8Weights.FULL) -> tuple[Any, Any]:
    """The activation and weight specs of the quantizer ``handlers.precision.quantize.static_int8`` uses."""
    config = x86_config(weights)
    return config.input_activation, config.weight


def _observe_inputs(module: torch.nn.Module, layers: Mapping[str, torch.nn.Module],
                    calibration: Sequence[Mapping[str, torch.Tensor]], kept: Mapping[str, Sequence[int]] | None = None,
                    ) -> tuple[dict[str, tuple[float, int]], dict[str, tuple[int, ...]]]:
    """One pass over ``calibration``: each layer's input scale and zero point, as the activation spec's observer
    picks them, with ``kept`` channels zeroed first (they stay float); and its input channels, largest absolute value
    first."""
    spec, _ = _specs()
    observers = {name: spec.observer_or_fake_quant_ctr(dtype=spec.dtype, quant_min=spec.quant_min,
                                                       quant_max=spec.quant_max, qscheme=spec.qscheme)
                 for name in layers}
    largest: dict[str, torch.Tensor] = {}

    def observe(name: str) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...]) -> None:
            inputs = args[0].detach().float()
            values = inputs.abs().reshape(-1, inputs.shape[-1]).amax(0)
            largest[name] = values if name not in largest else torch.maximum(largest[name], values)
            observers[name](_without(inputs, (kept or {}).get(name, ())))

        return hook

    _calibrate(module, {name: observe(name) for name in layers}, layers, calibration)
    qparams = {}
    for name, observer in observers.items():
        scale, zero_point = observer.calculate_qparams()
        qparams[name] = (float(scale), int(zero_point))
    return qparams, {name: tuple(values.argsort(descending=True).tolist()) for name, values in largest.items()}


def _calibrate(module: torch.nn.Module, hooks: Mapping[str, Callable[..., None]],
               layers: Mapping[str, torch.nn.Module], calibration: Sequence[Mapping[str, torch.Tensor]]) -> None:
    handles = [layers[name].register_forward_pre_hook(hook) for name, hook in hooks.items()]
    try:
        with torch.inference_mode():
            for batch in calibration:
                module(**batch)
    finally:
        for handle in handles:
            handle.remove()


def _without(values: torch.Tensor, channels: Sequence[int]) -> torch.Tensor:
    """``values`` with the last dimension's ``channels`` zeroed."""
    if not channels:
        return values
    values = values.clone()
    values[..., list(channels)] = 0
    return values


def _swap(module: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent), child, layer)


class _Int8Simulated(torch.nn.Module):
    """Stands in for a linear layer: its output with the input and weights rounded as static int8 rounds them (fake
    quantization, in float); the input channels ``kept`` stay float (``handlers.precision.quantize.OutlierSplit``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: float, zero_point: int,
                 kept: Sequence[int], exact: torch.Tensor, quant_range: tuple[int, int]):
        super().__init__()
        self.weight, self.bias, self.exact = weight, bias, exact
        self.scale, self.zero_point, self.kept, self.quant_range = scale, zero_point, list(kept), quant_range

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        values = inputs.float()
        quantized = torch.fake_quantize_per_tensor_affine(_without(values, self.kept), self.scale, self.zero_point,
                                                          *self.quant_range)
        result = torch.nn.functional.linear(quantized, self.weight, self.bias)
        if self.kept:
            result = result + torch.nn.functional.linear(values[..., self.kept], self.exact)
        return result.to(inputs.dtype)


def _int8_output(layer: torch.nn.Module, scale: float, zero_point: int, kept: Sequence[int] = (),
                 weights: Int8Weights = Int8Weights.FULL) -> _Int8Simulated:
    """A stand-in for ``layer``: its output with its input and weights (in ``weights``' range) rounded as static
    int8 rounds them; the input channels ``kept`` stay float (``handlers.precision.quantize.OutlierSplit``)."""
    activation, weight_spec = _specs(weights)
    observer = weight_spec.observer_or_fake_quant_ctr(dtype=weight_spec.dtype, quant_min=weight_spec.quant_min,
                                                      quant_max=weight_spec.quant_max, qscheme=weight_spec.qscheme,
                                                      ch_axis=weight_spec.ch_axis)
    weight = _without(layer.weight.detach().float(), kept)
    observer(weight)
    scales, zero_points = observer.calculate_qparams()
    rounded = torch.fake_quantize_per_channel_affine(weight, scales.float(), zero_points.int(), weight_spec.ch_axis,
                                                     weight_spec.quant_min, weight_spec.quant_max)
    exact = layer.weight.detach().float()[:, list(kept)]
    return _Int8Simulated(rounded, layer.bias, scale, zero_point, kept, exact,
                          (activation.quant_min, activation.quant_max))
