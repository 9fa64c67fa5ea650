"""The model in a precision: a float dtype, or int8 linear layers, made for the ladder to prove.

The ladder's int8 is **static** (``static_int8``): PT2E quantization with torchao's x86 inductor quantizer. The
model is exported with every axis the model lets vary dynamic; weights are quantized per output channel, and
each activation once per tensor with a scale calibrated on the warmup batches (``handlers.tasks.calibration``). Linear
layers that narrow (more inputs than outputs: a transformer's FFN output, whose input is GELU's long tail, and
the task heads) stay in float, and so do attention value projections (``stays_float``): MiniLM embeddings keep
cosine 0.994-0.997 vs fp32 on held-out texts, where quantizing every linear loses the gate (0.970). That rule is
the safe start: the ladder quantizes those of its float layers that a measurement finds cheap
(``handlers.precision.sensitivity``), some as an ``OutlierSplit``, their few largest input channels kept in float.
Compiled with freezing, each quantize step folds into the layer before it and the int8 linears become oneDNN's
fused ``qlinear``: twice as fast as the dynamic scheme at 8x128 tokens (docs/performance.md).
What is not quantized runs in ``rest``: bf16 under autocast where the ladder also tries bf16, else float32.
Weights take all of int8's range where the CPU has int8 dot products, 7 bits where it has none (``Int8Weights``).

``in_precision`` gives a float dtype, or torchao's dynamic scheme (per-token activation scales, computed on every
call), which the benchmarks keep as the comparison.

torchao is imported only when int8 is asked for, never at module import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from handlers.config import DType
from handlers.cpu.features import INT8_CPU_FEATURES
from handlers.precision import merged_linears, outlier_producers

logger = logging.getLogger(__name__)

TORCHAO = "torchao"
# CPU features with int8 dot products (u8 x s8 -> s32 in one instruction).
class Int8Weights(enum.Enum):
    """The values the int8 rung's weights take (per output channel, symmetric), by whether the CPU has int8 dot
    products. Without them oneDNN multiplies u8 activations by s8 weights with vpmaddubsw, which sums each pair of
    products into a saturating int16: full-range weights come out wrong (MiniLM: held-out min cosine 0.981, below the
    gate, on an AVX2-only EPYC). Weights in [-64, 63] cannot saturate it (2 x 255 x 64 = 32,640 < 32,767), and there
    cost far less than the other remedy, 7-bit activations (0.9928 held out, against 0.9848 with reduce_range)."""

    FULL = (-128, 127)
    SEVEN_BITS = (-64, 63)

    @classmethod
    def for_cpu(cls, features: Mapping[str, bool]) -> Int8Weights:
        """``FULL`` where the CPU (its usable ``features``) has int8 dot products, else ``SEVEN_BITS``."""
        return cls.FULL if any(features.get(name) for name in INT8_CPU_FEATURES) else cls.SEVEN_BITS

    def describe(self) -> str:
        low, high = self.value
        if self is Int8Weights.FULL:
            return f"weights in [{low}, {high}] (the CPU has int8 dot products)"
        return (f"weights in [{low}, {high}]: the CPU has none of {'/'.join(INT8_CPU_FEATURES)}, and its int16 "
                "pair sums of u8 x s8 products would saturate with full-range weights")


@functools.cache
def probe_torchao() -> tuple[ModuleType | None, str | None]:
    """``(torchao.quantization, None)`` when torchao imports with this torch, else ``(None, reason)``."""
    if importlib.util.find_spec(TORCHAO) is None:
        return None, f"{TORCHAO} is not installed (pip install torchao beside torch {torch.__version__})"
    try:
        with _quiet_torchao():
            return importlib.import_module(f"{TORCHAO}.quantization"), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- any failure means: no int8 here
        return None, f"{TORCHAO} failed to import with torch {torch.__version__}: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    """torchao logs (WARNING) each optional CUDA extension a CPU-only torch cannot load, and torch a deprecation
    for each enum torchao registers as it goes: noise to a server log, at import and at the first quantize."""
    noisy = [logging.getLogger(name) for name in (TORCHAO, "torch.utils._pytree")]
    levels = [each.level for each in noisy]
    for each in noisy:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(noisy, levels, strict=True):
            each.setLevel(level)


def int8_problem(device: torch.device) -> str | None:
    """Why int8 is not tried on ``device``, or None when it is (on any CPU: ``Int8Weights`` says in which form)."""
    if device.type != "cpu":
        return f"int8 is CPU-only here (torchao's x86 inductor quantizer), and this worker runs on {device.type}"
    return probe_torchao()[1]


def in_precision(module: torch.nn.Module, dtype: DType, rest: torch.dtype = torch.float32) -> torch.nn.Module:
    """``module`` (float32, changed in place) in ``dtype``. int8 here is torchao's dynamic scheme: the weights and
    activations of every ``nn.Linear`` quantized, activations per token on every call; what it leaves alone (norms,
    GELU, attention) runs in ``rest``. The ladder's int8 is ``static_int8``; benchmarks compare the two."""
    module = module.to(rest if dtype is DType.INT8 else dtype.torch)
    if dtype is not DType.INT8:
        return module
    quantization, reason = probe_torchao()
    if quantization is None:
        raise RuntimeError(reason)
    config = quantization.Int8DynamicActivationInt8WeightConfig()
    with _quiet_torchao():
        quantization.quantize_(module, config)
    return module


# What attention value projections are called (BERT/RoBERTa/MiniLM, DistilBERT, BART/OPT/Llama, DeBERTa).
VALUE_PROJECTIONS = ("value", "v_lin", "v_proj", "value_proj")


def narrows(name: str, layer: torch.nn.Linear) -> bool:
    """A linear layer with more inputs than outputs: a transformer's FFN output, a task head."""
    return layer.in_features > layer.out_features


def stays_float(name: str, layer: torch.nn.Linear) -> bool:
    """What static int8 leaves in float: layers that narrow, and attention value projections, whose error every
    token's attention output carries unsoftened (MiniLM: held-out min cosine 0.9885 -> 0.9952, 1-6 % slower)."""
    return narrows(name, layer) or name.rpartition(".")[2] in VALUE_PROJECTIONS


class OutlierSplit(torch.nn.Module):
    """A linear layer whose input ``channels`` (the few whose values dwarf the rest) bypass int8: ``main`` is the
    layer with those channels zeroed, quantized like any linear layer, and their exact float contribution is added
    as a sum of ``len(channels)`` products, which inductor fuses into one pointwise kernel (as a GEMM this thin,
    oneDNN set itself up again on every change of shape: 25 ms of 40 at 8x128 tokens)."""

    def __init__(self, linear: torch.nn.Linear, channels: Sequence[int]):
        super().__init__()
        mask = torch.ones(linear.in_features, dtype=linear.weight.dtype)
        mask[list(channels)] = 0
        self.register_buffer("mask", mask)
        self.register_buffer("channels", torch.tensor(list(channels), dtype=torch.long))
        self.register_buffer("float_weight", linear.weight.detach()[:, list(channels)].t().contiguous())
        self.main = linear
        with torch.no_grad():
            linear.weight.mul_(mask)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        kept = (inputs.index_select(-1, self.channels).unsqueeze(-1) * self.float_weight).sum(-2)
        return self.main(inputs * self.mask) + kept


def split_outliers(module: torch.nn.Module, channels: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Each linear layer ``channels`` names, in ``module`` (changed in place), as an ``OutlierSplit`` keeping those
    input channels float. Returns each one's new name for the linear layer int8 should quantize (``NAME.main``)."""
    renamed = {}
    for name, kept in channels.items():
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, child, OutlierSplit(module.get_submodule(name), kept))
        renamed[name] = f"{name}.main"
    return renamed


def x86_config(weights: Int8Weights = Int8Weights.FULL) -> Any:
    """torchao's x86 inductor quantization config (static: u8 activations per tensor, s8 weights per output channel),
    its weights in ``weights``' range."""
    with _quiet_torchao():
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    config = x86.get_default_x86_inductor_quantization_config()
    if weights is Int8Weights.FULL:
        return config
    low, high = weights.value
    return dataclasses.replace(config, weight=dataclasses.replace(config.weight, quant_min=low, quant_max=high))


def static_int8(module: torch.nn.Module, examples: Sequence[Mapping[str, torch.Tensor]],
                rest: torch.dtype = torch.float32,
                keep_float: Callable[[str, torch.nn.Linear], bool] = stays_float,
                weights: Int8Weights = Int8Weights.FULL, fuse_split_producers: bool = True,
                merge_shared_inputs: bool = True) -> torch.nn.Module:
    """``module`` (float32) with every linear layer but those ``keep_float`` names (by default ``stays_float``; each
    named as ``module.named_modules()`` names it) quantized statically to int8 (PT2E), calibrated on ``examples``
    (the warmup batches), exported from the largest of them with every axis the model lets vary dynamic, its weights
    in ``weights``' range (``Int8Weights.for_cpu``). Called with the same keywords as ``module``; what is not
    quantized runs in ``rest``. An ``OutlierSplit`` reading an activation of another linear layer is rewritten so
    that layer fuses (``handlers.precision.outlier_producers``), and quantized linear layers reading one tensor become
    one (``handlers.precision.merged_linears``), unless ``fuse_split_producers`` / ``merge_shared_inputs`` say not
    (benchmarks)."""
    if not examples or not all(isinstance(example, Mapping) for example in examples):
        raise TypeError("static int8 needs warmup batches of named tensors to export and calibrate on")
    quantization, reason = probe_torchao()
    if quantization is None:
        raise RuntimeError(reason)
    with _quiet_torchao():
        from torchao.quantization.pt2e import quantize_pt2e
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    names = list(examples[0])
    positional = _Positional(module.eval(), names)
    largest = max(examples, key=lambda example: sum(tensor.numel() for tensor in example.values()))
    with torch.no_grad():
        graph = torch.export.export(positional, tuple(largest[name] for name in names),
                                    dynamic_shapes=(_dynamic_axes(largest, names),), strict=False).module()
    for node in list(graph.graph.nodes):  # export's dtype checks: they would fail under bf16 autocast
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()  # e.g. BERT's unused pooler, whose dangling tanh the quantizer trips on
    graph.recompile()
    # keep_float sees the model's own names; the graph's are under inner
    kept_float = {f"inner.{name}" for name, layer in module.named_modules()
                  if isinstance(layer, torch.nn.Linear) and keep_float(name, layer)}
    _rewrite_float_graph(graph, kept_float, fuse_split_producers, merge_shared_inputs)
    quantizer = x86.X86InductorQuantizer().set_global(x86_config(weights))
    for name in kept_float:
        quantizer.set_module_name_qconfig(name, None)
    with _quiet_torchao():
        prepared = quantize_pt2e.prepare_pt2e(graph, quantizer)
        with torch.no_grad():
            for example in examples:
                prepared(*(example[name] for name in names))
        quantized = quantize_pt2e.convert_pt2e(prepared)
    return _Keywords(quantized, names, rest)


def _rewrite_float_graph(graph: torch.fx.GraphModule, kept_float: set[str], fuse_split_producers: bool,
                         merge_shared_inputs: bool) -> None:
    """The exported graph's rewrites before it is quantized (``static_int8``), each logged where it applied."""
    if fuse_split_producers:
        fused = outlier_producers.from_producers(graph)
        if fused:
            logger.info("int8: %d split layers' producers rewritten to fuse: %s", len(fused), ", ".join(fused))
    if merge_shared_inputs:
        merged = merged_linears.merge(graph, lambda paths: not kept_float.intersection(paths))
        if merged:
            logger.info("int8: %d groups of linear layers reading one input merged: %s", len(merged),
                        "; ".join(", ".join(group) for group in merged))


def _dynamic_axes(example: Mapping[str, torch.Tensor], names: Sequence[str]) -> tuple[dict, ...]:
    """Every axis of every input as automatic: export keeps dynamic what the model lets vary (batch, length, even
    a length the warmup saw only once) and fixes what it pins (feature sizes), without asking."""
    return tuple({axis: torch.export.Dim.AUTO for axis in range(example[name].dim())} for name in names)


class _Positional(torch.nn.Module):
    """Keyword inputs as positional ones, in a fixed order: what torch.export traces most reliably."""

    def __init__(self, inner: torch.nn.Module, names: Sequence[str]):
        super().__init__()
        self.inner = inner
        self.names = list(names)

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.inner(**dict(zip(self.names, tensors, strict=True)))


class _Keywords(torch.nn.Module):
    """The quantized graph, called with keywords again; the float layers in ``rest`` (bf16 under autocast)."""

    def __init__(self, graph: torch.nn.Module, names: Sequence[str], rest: torch.dtype):
        super().__init__()
        self.graph = graph
        self.names = list(names)
        self.rest = rest

    def forward(self, **inputs: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.rest is torch.bfloat16):
            return self.graph(*(inputs[name] for name in self.names))
