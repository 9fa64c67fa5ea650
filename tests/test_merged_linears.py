"""Linear layers reading one tensor, each only reshaped after, quantized as one (handlers.precision.merged_linears): an
attention block's query, key and value. The same answers; left alone where a layer's output goes on to anything but a
reshape, where a layer stays float, or where the inputs differ; once compiled, one oneDNN int8 linear where there were
three. Real torch.export, real PT2E, real inductor, on a small model."""

from __future__ import annotations

import pytest
import torch

from handlers.config import CompileSpec, DType
from handlers.precision import merged_linears, quantize
from handlers.rungs import CompileRung
from tests.test_outlier_producers import examples, exported  # the same 16-feature inputs, exported alike

pytestmark = pytest.mark.torchao


class Attention(torch.nn.Module):
    """Query, key and value projections of 16 features into 2 heads of 8, then attention. ``gelu_value``: the value
    projection's output goes through GELU first (a reader that is not a reshape)."""

    def __init__(self, gelu_value: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.value = (torch.nn.Linear(16, 16) for _ in range(3))
        self.gelu_value = gelu_value

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)

    def forward(self, x):
        value = self.value(x)
        if self.gelu_value:
            value = torch.nn.functional.gelu(value)
        attended = torch.nn.functional.scaled_dot_product_attention(
            self.heads(self.query(x)), self.heads(self.key(x)), self.heads(value))
        return attended.transpose(1, 2).reshape(x.shape)


def linears(graph: torch.fx.GraphModule) -> int:
    return sum(node.target is torch.ops.aten.linear.default for node in graph.graph.nodes)


def test_projections_reading_one_input_become_one_linear_with_the_same_answers():
    graph = exported(Attention())
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        before = graph(x)
    merged = merged_linears.merge(graph, lambda paths: True)
    assert merged == [[f"inner.{name}.weight" for name in ("value", "query", "key")]]  # in the order they run
    assert linears(graph) == 1
    with torch.no_grad():
        torch.testing.assert_close(graph(x), before, rtol=1e-6, atol=1e-6)
    assert merged_linears.merge(graph, lambda paths: True) == []  # nothing left to merge


def test_a_layer_read_by_more_than_a_reshape_or_kept_float_stays_on_its_own():
    activated = exported(Attention(gelu_value=True))  # value's output goes through GELU, which fuses into it alone
    assert merged_linears.merge(activated, lambda paths: True) == [["inner.query.weight", "inner.key.weight"]]
    assert linears(activated) == 2
    kept_float = exported(Attention())  # query and key stay float (the quantizer leaves them): only value is int8
    assert merged_linears.merge(kept_float, lambda paths: "inner.value" in paths) == []
    assert linears(kept_float) == 3


def _int8(merge: bool) -> torch.nn.Module:
    return quantize.static_int8(Attention(), examples(), keep_float=lambda name, layer: False,
                                merge_shared_inputs=merge)


def test_int8_quantizes_the_merged_layer_once_and_answers_as_the_three_do():
    merged, separate = _int8(merge=True), _int8(merge=False)
    weights = "quantized_decomposed.dequantize_per_channel.default"
    count = [str(node.target) for node in merged.graph.graph.nodes].count(weights)
    assert count == 1, merged.graph.code
    assert [str(node.target) for node in separate.graph.graph.nodes].count(weights) == 3
    x = examples(seed=5)[1]["x"]
    with torch.inference_mode():
        torch.testing.assert_close(merged(x=x), separate(x=x), rtol=1e-5, atol=1e-5)


def _compiled(merge: bool) -> tuple[list[str], torch.Tensor]:
    """The oneDNN int8 linear calls inductor generates for the int8 attention, compiled as the rung does, and its
    answer."""
    from torch._inductor.utils import run_and_get_code

    rung = CompileRung("compile", CompileSpec(enabled=True, backend="inductor"))
    forward = rung.apply(_int8(merge), DType.INT8)
    with rung.warmup_context(1), torch.no_grad():
        answer, code = run_and_get_code(forward, **examples()[1])
    calls = [line for source in code for line in source.splitlines()
             if "qlinear_pointwise" in line and "(" in line and "def " not in line and "import" not in line]
    return calls, answer


def test_compiled_the_three_projections_are_one_int8_linear(private_inductor_cache):
    (merged, merged_answer), (separate, separate_answer) = _compiled(True), _compiled(False)
    assert len(merged) == 1 and len(separate) == 3, (merged, separate)
    torch.testing.assert_close(merged_answer, separate_answer, rtol=1e-5, atol=1e-5)
