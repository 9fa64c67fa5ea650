"""The task's module exported with ``torch.export`` on a warmup batch: what the rungs that run an exported program
(openvino, aot) share. Export refuses Python control flow that depends on the data, where a trace would bake in the
branch the example took.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.utils._pytree as pytree

from handlers.cpu import fused_attention


def example_batch(batches: Sequence[Any]) -> Mapping[str, torch.Tensor] | None:
    """The warmup batch the module is exported on: named tensors, the largest batch (then the longest). An axis of
    size 1 in the example would be exported as fixed, so the largest sizes keep the batch and sequence axes dynamic."""
    named = [batch for batch in batches if isinstance(batch, Mapping) and batch
             and all(isinstance(value, torch.Tensor) for value in batch.values())]
    if not named:
        return None
    return max(named, key=lambda batch: sorted((min(t.shape, default=0), t.numel()) for t in batch.values()))


def export(module: torch.nn.Module, example: Mapping[str, torch.Tensor],
           fixed: Mapping[str, tuple[int, ...]] = MappingProxyType({}),
           flat_outputs: bool = False) -> torch.export.ExportedProgram:
    """``module`` exported with the axes of each input left to torch.export (``Dim.AUTO``): those the model fixes
    (a hidden size) stay fixed, the rest (batch, sequence) dynamic; but the axes ``fixed`` names per input are
    exported at the example's size (an image's height and width, one size after preprocessing: left dynamic, shape
    arithmetic such as a window's padding becomes operations OpenVINO cannot convert). The inputs go in
    positionally, in the example's order (a forward may take them as ``**inputs``). ``flat_outputs``: the program
    returns the output's tensors as a flat tuple (``structure`` nests them again), so loading it needs no pytree
    registration of the module's output classes (a process that did not export it has none)."""
    auto = torch.export.Dim.AUTO
    shapes = tuple({axis: auto for axis in range(tensor.dim()) if axis not in fixed.get(name, ())}
                   for name, tensor in example.items())
    positional = _Positional(module, list(example), flat_outputs)
    positional.training = False  # the module is the ladder's reference, in eval mode (an exported one has no eval())
    with torch.no_grad(), fused_attention.left_out():  # OpenVINO does not know this package's attention kernel
        return torch.export.export(positional, tuple(example.values()), dynamic_shapes=(shapes,), strict=False)


def fixed_axes(batches: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """Per input, the axes past the batch and sequence (0 and 1) that have one size in every warmup batch: what the
    task's preprocessing fixes (an image's height and width)."""
    named = [batch for batch in batches if isinstance(batch, Mapping)]
    sizes: dict[str, set[tuple[int, ...]]] = {}
    for batch in named:
        for name, tensor in batch.items():
            if isinstance(tensor, torch.Tensor):
                sizes.setdefault(name, set()).add(tuple(tensor.shape[2:]))
    return {name: tuple(range(2, 2 + len(next(iter(shapes))))) for name, shapes in sizes.items()
            if len(shapes) == 1 and next(iter(shapes))}


class _Positional(torch.nn.Module):
    """A module that takes keyword tensors, called with them in order; ``flat``: its outputs' tensors as a tuple."""

    def __init__(self, module: torch.nn.Module, names: list[str], flat: bool = False):
        super().__init__()
        self.module = module
        self.names = names
        self.flat = flat

    def forward(self, *tensors: torch.Tensor) -> Any:
        outputs = self.module(**dict(zip(self.names, tensors, strict=True)))
        return tuple(pytree.tree_leaves(outputs)) if self.flat else outputs


def structure(module: torch.nn.Module, example: Mapping[str, torch.Tensor]) -> pytree.TreeSpec:
    """How the module's outputs nest (a tensor, a tuple, a dict of tensors): OpenVINO, and a program exported with
    ``flat_outputs``, return them flat."""
    with torch.inference_mode():
        return pytree.tree_flatten(module(**example))[1]
