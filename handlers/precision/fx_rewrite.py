"""What the int8 rung's graph rewrites share (``handlers.precision.outlier_producers``,
``handlers.precision.merged_linears``): reading a tensor the exported graph holds, and adding a node with the meta
value the quantizer reads. Pure torch.fx."""

from __future__ import annotations

from typing import Any

import torch


def held_tensor(graph: torch.fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads from ``graph``; None for anything else."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = graph
        for part in node.target.split("."):
            value = getattr(value, part, None)
        return value if isinstance(value, torch.Tensor) else None
    return None


def add_node(graph: torch.fx.GraphModule, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new call of ``target`` at the graph's insert point, its meta value computed on its arguments' (call it under
    their fake mode): the quantizer reads every node's."""
    node = graph.graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*(arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg for arg in args), **kwargs)
    return node


def hold(graph: torch.fx.GraphModule, name: str, tensor: torch.Tensor, fake_mode: Any) -> torch.fx.Node:
    """``tensor`` registered on ``graph`` as ``name`` and a ``get_attr`` node reading it, with its meta value."""
    graph.register_buffer(name, tensor)
    node = graph.graph.get_attr(name)
    node.meta["val"] = fake_mode.from_tensor(tensor)
    return node
