"""Which of the layers static int8 keeps in float by rule can be quantized too: measured, one layer at a time.

``handlers.quantize.stays_float`` keeps every layer that narrows (a transformer's FFN output) and every attention
value projection in float: about 40 % of a BERT encoder's linear work. In MiniLM most of them cost the answers
nothing in int8 and two FFN outputs cost a lot; which ones differs by model. So before int8 is built, each of those
layers is *simulated* in int8 alone, the rest of the model in float: its input rounded per tensor to uint8 with the
scale the quantizer's own histogram observer picks on the calibration batches, its weights per output channel to
int8 (``torch.fake_quantize_*``, the quantizer's specs). The task's gate scores each; the layers that cost least are
quantized too, cheapest first, while their summed cost stays within ``SHARE`` of the gate's margin. A fraction of a
second per layer for MiniLM, where building and judging a real int8 model takes seconds. The real int8 model is then
judged by the gate as always; if it fails, the ladder builds int8 again with the rule's float layers
(``handlers.ladder``).

Pure torch + torchao (imported only when int8 is built).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Of the gate's margin (the best value minus its threshold, e.g. 1 - 0.99 for embeddings), the share the extra
# layers may spend, summed as each costs alone. Costs add up to more than their sum once the layers are int8
# together (MiniLM: 6 layers summing 0.0022 alone cost 0.0015 more together), so half the margin is left unspent.
SHARE = 0.25
Score = Callable[[torch.nn.Module], float]  # the gate's worst value over the judged batches; -inf if it raised


@dataclass(frozen=True)
class Choice:
    """The layers to quantize beyond the rule (``taken``), what each layer cost alone (``costs``: the gate's best
    value minus its value with that layer in int8), the budget the taken ones spent within, and the time it took."""

    taken: tuple[str, ...]
    costs: Mapping[str, float]
    budget: float
    seconds: float

    def describe(self) -> str:
        if not self.costs:
            return "no layer is kept in float by rule"
        spent = sum(self.costs[name] for name in self.taken)
        return (f"{len(self.taken)} of the {len(self.costs)} layers kept in float by rule quantized too, each measured "
                f"alone: summed cost {spent:.6f} within {self.budget:.6f}, {self.seconds:.1f}s")


def choose(module: torch.nn.Module, candidates: Sequence[str], calibration: Sequence[Mapping[str, torch.Tensor]],
           score: Score, threshold: float, share: float = SHARE) -> Choice:
    """Of ``candidates`` (names of ``nn.Linear`` layers in ``module``, a float32 model), those whose simulated int8
    costs ``score`` least, cheapest first, while the summed cost stays within ``share`` of (the float model's score
    minus ``threshold``). ``module`` is not changed: each layer's int8 output is a forward hook's, removed after."""
    started = time.perf_counter()
    if not candidates:
        return Choice((), {}, 0.0, 0.0)
    layers = {name: module.get_submodule(name) for name in candidates}
    inputs = _observe_inputs(module, layers, calibration)
    best = score(module)
    costs = {}
    for name, layer in layers.items():
        hook = layer.register_forward_hook(_int8_output(layer, *inputs[name]))
        try:
            costs[name] = best - score(module)
        finally:
            hook.remove()
    budget = share * (best - threshold)
    taken, spent = [], 0.0
    for name in sorted(costs, key=lambda name: (costs[name], name)):
        if spent + max(costs[name], 0.0) > budget:
            break
        taken.append(name)
        spent += max(costs[name], 0.0)
    return Choice(tuple(taken), costs, budget, time.perf_counter() - started)


def _specs() -> tuple[Any, Any]:
    """The activation and weight specs of the quantizer ``handlers.quantize.static_int8`` uses."""
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    config = x86.get_default_x86_inductor_quantization_config()
    return config.input_activation, config.weight


def _observe_inputs(module: torch.nn.Module, layers: Mapping[str, torch.nn.Module],
                    calibration: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, tuple[float, int]]:
    """Each layer's input scale and zero point, as the activation spec's observer picks them on ``calibration``."""
    spec, _ = _specs()
    observers = {name: spec.observer_or_fake_quant_ctr(dtype=spec.dtype, quant_min=spec.quant_min,
                                                       quant_max=spec.quant_max, qscheme=spec.qscheme)
                 for name in layers}

    def observe(name: str) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: tuple[Any, ...]) -> None:
            observers[name](args[0].detach().float())

        return hook

    hooks = [layer.register_forward_pre_hook(observe(name)) for name, layer in layers.items()]
    try:
        with torch.inference_mode():
            for batch in calibration:
                module(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    qparams = {}
    for name, observer in observers.items():
        scale, zero_point = observer.calculate_qparams()
        qparams[name] = (float(scale), int(zero_point))
    return qparams


def _int8_output(layer: torch.nn.Module, scale: float, zero_point: int) -> Callable[..., torch.Tensor]:
    """A forward hook giving ``layer``'s output with its input and weights rounded as static int8 rounds them."""
    activation, weight_spec = _specs()
    observer = weight_spec.observer_or_fake_quant_ctr(dtype=weight_spec.dtype, quant_min=weight_spec.quant_min,
                                                      quant_max=weight_spec.quant_max, qscheme=weight_spec.qscheme,
                                                      ch_axis=weight_spec.ch_axis)
    weight = layer.weight.detach().float()
    observer(weight)
    scales, zero_points = observer.calculate_qparams()
    rounded = torch.fake_quantize_per_channel_affine(weight, scales.float(), zero_points.int(), weight_spec.ch_axis,
                                                     weight_spec.quant_min, weight_spec.quant_max)

    def hook(_: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        inputs = torch.fake_quantize_per_tensor_affine(args[0].float(), scale, zero_point, activation.quant_min,
                                                       activation.quant_max)
        return torch.nn.functional.linear(inputs, rounded, layer.bias).to(output.dtype)

    return hook
