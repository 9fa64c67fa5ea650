"""A split FFN output whose input is GELU of another linear layer: that producer rewritten so its int8 form fuses
(handlers.precision.outlier_producers). Exact in float; left alone where the pattern is not there; quantized as the
producer; and once compiled, the producer's int8 linear writes GELU's output quantized, in one oneDNN call. Real
torch.export, real PT2E, real inductor, on a small model."""

from __future__ import annotations

import pytest
import torch

from handlers.config import CompileSpec, DType
from handlers.precision import outlier_producers, quantize
from handlers.rungs import CompileRung

pytestmark = pytest.mark.torchao

CHANNELS = (0, 1, 2, 3)


class FFN(torch.nn.Module):
    """16 -> 64 -> GELU -> 16, hidden channel 0 about 50 times the rest and read by the narrowing layer: what
    ``OutlierSplit`` keeps in float. ``also_activation``: the forward returns GELU's output too (a second reader)."""

    def __init__(self, also_activation: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        with torch.no_grad():
            self.up.weight[0] *= 50
            self.up.bias[0] = 20
        self.also_activation = also_activation

    def forward(self, x):
        hidden = torch.nn.functional.gelu(self.up(x))
        out = self.down(hidden)
        return (out, hidden) if self.also_activation else out


def examples(seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, length, 16, generator=generator)} for rows, length in ((2, 5), (4, 7), (1, 3))]


def exported(model: torch.nn.Module) -> torch.fx.GraphModule:
    """The float graph as static_int8 exports it (batch and length dynamic)."""
    example = examples()[1]
    return torch.export.export(quantize._Positional(model.eval(), ["x"]), (example["x"],),
                               dynamic_shapes=(quantize._dynamic_axes(example, ["x"]),), strict=False).module()


def targets(graph: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]


def test_the_rewritten_float_graph_computes_what_the_split_did_with_the_producer_rows_zeroed():
    model = FFN()
    quantize.split_outliers(model, {"down": CHANNELS})
    graph = exported(model)
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        before = graph(x)
    assert "aten.index_select.default" in targets(graph)
    assert outlier_producers.from_producers(graph) == ["inner.up.weight"]
    with torch.no_grad():
        after = graph(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)
    assert "aten.index_select.default" not in targets(graph)
    assert targets(graph).count("aten.linear.default") == 3  # the producer, its kept rows, the consumer's main part
    main = next(node for node in graph.graph.nodes if node.target is torch.ops.aten.linear.default
                and node.args[0].op == "placeholder" and node.args[1].target.endswith("main_weight"))
    weight = getattr(graph, main.args[1].target)
    assert weight[list(CHANNELS)].abs().sum() == 0 and weight[4:].abs().sum() > 0
    assert outlier_producers.from_producers(graph) == []  # nothing left to rewrite


def test_a_split_reading_anything_but_an_activation_read_by_it_alone_is_left_as_it_is():
    reads_input = FFN()
    quantize.split_outliers(reads_input, {"up": CHANNELS})  # its input is the graph's input, no producer
    shared = FFN(also_activation=True)
    quantize.split_outliers(shared, {"down": CHANNELS})  # GELU's output is returned too
    plain = FFN()  # no split at all
    for model in (reads_input, shared, plain):
        graph = exported(model)
        code = graph.code
        assert outlier_producers.from_producers(graph) == []
        assert graph.code == code


def _int8(fuse: bool, rest: torch.dtype = torch.float32) -> torch.nn.Module:
    model = FFN()
    quantize.split_outliers(model, {"down": CHANNELS})
    return quantize.static_int8(model, examples(), rest, keep_float=lambda name, layer: False,
                                fuse_split_producers=fuse)


def test_int8_quantizes_the_kept_rows_as_the_producer_and_answers_as_the_unfused_form_does():
    fused, unfused = _int8(fuse=True), _int8(fuse=False)
    weights = "quantized_decomposed.dequantize_per_channel.default"
    assert targets(unfused.graph).count(weights) == 2
    assert targets(fused.graph).count(weights) == 3  # the producer's kept rows: int8 products, as before
    x = examples(seed=5)[1]["x"]
    with torch.inference_mode():
        want, got, before = FFN().eval()(x), fused(x=x), unfused(x=x)
    cosine = torch.nn.functional.cosine_similarity
    assert cosine(got.flatten(1), want.flatten(1)).min().item() > 0.999
    assert cosine(got.flatten(1), before.flatten(1)).min().item() > 0.999


def _compiled_calls(fuse: bool, rest: torch.dtype) -> list[str]:
    """The oneDNN int8 linear calls in the code inductor generates for the int8 FFN, compiled as the rung does."""
    from torch._inductor.utils import run_and_get_code

    module = _int8(fuse, rest)
    rung = CompileRung("compile", CompileSpec(enabled=True, backend="inductor"))
    forward = rung.apply(module, DType.INT8)
    with rung.warmup_context(1), torch.no_grad():
        _, code = run_and_get_code(forward, **examples()[1])
    return [line.strip() for source in code for line in source.splitlines() if "qlinear_pointwise" in line
            and "(" in line and "def " not in line and "import" not in line]


@pytest.mark.parametrize("rest", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_compiled_the_producer_writes_gelu_quantized_in_its_int8_linear(private_inductor_cache, rest):
    fused, unfused = _compiled_calls(True, rest), _compiled_calls(False, rest)
    writes_quantized_gelu = "torch.uint8, 'gelu'"
    assert sum(writes_quantized_gelu in call for call in fused) == 1, fused
    assert sum(writes_quantized_gelu in call for call in unfused) == 0, unfused  # floats, then a pass of its own
    assert len(fused) == len(unfused) + 1  # the kept rows' own int8 linear
