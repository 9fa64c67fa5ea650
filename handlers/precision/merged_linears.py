"""Linear layers that read the same input, quantized as one: an attention block's query, key and value projections.

At a few rows a oneDNN int8 linear costs about 20 us of its own, whatever its width (16 rows of 384: three 384-wide
projections 90 us, one 1152-wide 44 us), so a lone short text pays that once per projection. ``merge`` rewrites the
exported float graph before it is quantized: linear layers reading the same tensor, each of them to be quantized and
each read only to be reshaped, become one whose weight and bias are theirs stacked, and each reader takes its slice of
the output. Weights are quantized per output channel and the input once, so the answers are the same to the bit. A
layer whose output goes on to an activation or a sum stays on its own: oneDNN fuses those into a layer alone
(``handlers.precision.outlier_producers``' FFN input and its kept rows read one tensor, and would lose their fused
GELU). Pure torch.fx; a graph without such layers is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from handlers.precision.fx_rewrite import add_node, held_tensor, hold

aten = torch.ops.aten
# What a projection's reader may do to its output for the projection to join others: change its shape, nothing else.
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
            aten.transpose.int, aten.unsqueeze.default)


def module_paths(node: torch.fx.Node) -> list[str]:
    """The modules a node of an exported graph ran in, outermost first (its ``nn_module_stack``)."""
    return [path for path, _ in node.meta.get("nn_module_stack", {}).values()]


def merge(graph: torch.fx.GraphModule, quantized: Callable[[Sequence[str]], bool]) -> list[list[str]]:
    """Merge, in place, each group of linear layers reading one tensor whose ``module_paths`` ``quantized`` accepts
    and whose outputs are only reshaped; return each merged group's weight names."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.graph.nodes:
        if _mergeable(graph, node) and quantized(module_paths(node)):
            groups.setdefault(node.args[0], []).append(node)
    merged = []
    for linears in groups.values():
        with_bias = {_bias(linear) is not None for linear in linears}
        if len(linears) > 1 and len(with_bias) == 1:
            merged.append(_merge(graph, linears, with_bias.pop()))
    if merged:
        graph.graph.eliminate_dead_code()
        graph.graph.lint()
        graph.recompile()
    return merged


def _bias(linear: torch.fx.Node) -> Any:
    return linear.args[2] if len(linear.args) > 2 else None


def _mergeable(graph: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """``aten.linear`` with a weight (and bias, if any) that the graph holds, its output only reshaped."""
    return (node.op == "call_function" and node.target is aten.linear.default and not node.kwargs
            and held_tensor(graph, node.args[1]) is not None
            and (_bias(node) is None or held_tensor(graph, _bias(node)) is not None)
            and bool(node.users) and all(reader.target in RESHAPES for reader in node.users))


def _merge(graph: torch.fx.GraphModule, linears: list[torch.fx.Node], with_bias: bool) -> list[str]:
    inputs, first = linears[0].args[0], linears[0]
    weights = [held_tensor(graph, linear.args[1]) for linear in linears]
    stacked = {"weight": torch.cat([weight.detach() for weight in weights])}
    if with_bias:
        stacked["bias"] = torch.cat([held_tensor(graph, _bias(linear)).detach() for linear in linears])
    stem = str(first.args[1].target).replace(".", "_")
    fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])  # the quantizer reads each node's meta value
    nodes = {}
    with graph.graph.inserting_before(first), fake_mode:
        for key, tensor in stacked.items():
            name = f"{stem}_merged_{len(linears)}_{key}"
            nodes[key] = hold(graph, name, tensor, fake_mode)
        whole = add_node(graph, aten.linear.default, inputs, nodes["weight"], nodes.get("bias"))
        whole.meta.update({key: value for key, value in first.meta.items() if key != "val"})
        start = 0
        for linear, weight in zip(linears, weights, strict=True):
            part = add_node(graph, aten.slice.Tensor, whole, -1, start, start + weight.shape[0])
            # Run by the module holding the layer, not by the layer: the quantizer takes every node a Linear module
            # ran for a linear operator.
            part.meta["nn_module_stack"] = dict(list(linear.meta.get("nn_module_stack", {}).items())[:-1])
            start += weight.shape[0]
            linear.replace_all_uses_with(part)
    names = [str(linear.args[1].target) for linear in linears]
    for linear in linears:
        graph.graph.erase_node(linear)
    return names
