"""An ``OutlierSplit`` behind an activation of another linear layer, rewritten so that layer's int8 form fuses.

A transformer's FFN output reads ``gelu(FFN input)``. Split (``handlers.precision.quantize.OutlierSplit``), it reads
that activation twice: its float channels picked out, and the rest masked to zero before the quantize step. An
activation with two readers cannot fuse into the FFN input's int8 linear with the quantize step after it, so that
linear writes floats and inductor runs the activation and the quantize step as one more pass over the FFN's widest
tensor.

``from_producers`` rewrites the exported float graph before it is quantized. The producing linear's rows for the
kept channels are zeroed, so the activation there is the activation of 0, never read by the quantize step's scale
(the consumer's weights for those channels are zero already). The kept channels get a linear layer of their own,
``len(channels)`` rows of the producer's weights on the same input, quantized as the producer is: the same int8
products as before, their activation computed in float once, and the wide layer fuses its activation and quantize
step again. In float the rewritten graph computes exactly what it did. Pure torch.fx; a graph without the pattern
is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from handlers.precision.fx_rewrite import add_node, held_tensor, hold

aten = torch.ops.aten
# Elementwise activations a transformer's FFN applies between its two linear layers.
ACTIVATIONS = (aten.gelu.default, aten.relu.default, aten.silu.default)


def from_producers(graph: torch.fx.GraphModule) -> list[str]:
    """Rewrite, in place, every split whose input is ``ACTIVATION(linear(x))`` read by nothing else; return the
    producing linear layers' weight names."""
    rewritten = []
    for select in list(graph.graph.nodes):
        match = _match(graph, select)
        if match is not None:
            rewritten.append(_rewrite(graph, select, *match))
    if rewritten:
        graph.graph.eliminate_dead_code()
        graph.graph.lint()
        graph.recompile()
    return rewritten


def _match(graph: torch.fx.GraphModule, select: torch.fx.Node) -> tuple[Any, ...] | None:
    """(activation, producing linear, mask multiply, channels) when ``select`` picks an OutlierSplit's float
    channels out of an activation of a linear layer; else None. Checked on the tensors, not on names."""
    if select.op != "call_function" or select.target is not aten.index_select.default:
        return None
    activation, dim, channels_node = select.args
    channels = held_tensor(graph, channels_node)
    if channels is None or not isinstance(activation, torch.fx.Node) or activation.target not in ACTIVATIONS:
        return None
    readers = set(activation.users) - {select}
    if len(readers) != 1:
        return None
    masked = readers.pop()
    if masked.target is not aten.mul.Tensor or masked.args[0] is not activation:
        return None
    mask = held_tensor(graph, masked.args[1])
    expected = torch.ones_like(mask) if mask is not None else None
    if expected is None or mask.dim() != 1:
        return None
    expected[channels] = 0
    value = activation.meta.get("val")
    if not torch.equal(mask, expected) or value is None or dim not in (-1, value.dim() - 1):
        return None
    producer = activation.args[0]
    if (not isinstance(producer, torch.fx.Node) or producer.target is not aten.linear.default
            or len(producer.users) != 1 or held_tensor(graph, producer.args[1]) is None):
        return None
    if len(producer.args) > 2 and producer.args[2] is not None and held_tensor(graph, producer.args[2]) is None:
        return None
    return activation, producer, masked, channels


def _rewrite(graph: torch.fx.GraphModule, select: torch.fx.Node, activation: torch.fx.Node,
             producer: torch.fx.Node, masked: torch.fx.Node, channels: torch.Tensor) -> str:
    inputs, weight_node = producer.args[0], producer.args[1]
    bias_node = producer.args[2] if len(producer.args) > 2 else None
    weight, bias = held_tensor(graph, weight_node), held_tensor(graph, bias_node)
    thin_weight, main_weight = weight.detach()[channels].clone(), weight.detach().clone()
    main_weight[channels] = 0
    added = {"main_weight": main_weight, "thin_weight": thin_weight}
    if bias is not None:
        main_bias, added["thin_bias"] = bias.detach().clone(), bias.detach()[channels].clone()
        main_bias[channels] = 0
        added["main_bias"] = main_bias
    stem = weight_node.target.replace(".", "_")
    fake_mode = torch._guards.detect_fake_mode([inputs.meta["val"]])  # the quantizer reads each node's meta value
    nodes = {}
    with graph.graph.inserting_before(producer):
        for key, tensor in added.items():
            name = f"{stem}_outliers_{key}"
            nodes[key] = hold(graph, name, tensor, fake_mode)
    producer.args = (inputs, nodes["main_weight"], nodes.get("main_bias"), *producer.args[3:])
    with graph.graph.inserting_before(select), fake_mode:
        # The kept channels as a linear layer of their own on the same input, quantized as the producer is (the
        # quantizer reads its module's name from the meta copied below): the same int8 products as before.
        thin = add_node(graph, aten.linear.default, inputs, nodes["thin_weight"], nodes.get("thin_bias"))
        kept = add_node(graph, activation.target, thin, *activation.args[1:], **activation.kwargs)
        for new, like in ((thin, producer), (kept, activation)):
            new.meta.update({key: value for key, value in like.meta.items() if key != "val"})
    select.replace_all_uses_with(kept)
    masked.replace_all_uses_with(activation)
    graph.graph.erase_node(select)
    graph.graph.erase_node(masked)
    return str(weight_node.target)
