"""A batch through the served forward at the shape policy's shapes: chunks of at most the largest batch bucket, each
padded up to its bucket, outputs sliced back to the real rows; rows of mixed lengths in groups where that is cheaper
(``handlers.serving.length_groups``).

Pure torch; no TorchServe import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from handlers.config.shapes import ShapePolicy
from handlers.ladder.guard import GuardedForward
from handlers.serving import length_groups
from handlers.serving.length_groups import LengthGrouping


@dataclass
class BatchStats:
    """What one batch cost, for metrics: milliseconds per stage, and how much of what ran was padding."""

    requests: int = 0
    milliseconds: dict[str, float] = field(default_factory=dict)  # parse, preprocess, forward, postprocess
    real_tokens: int = 0  # tokens of the requests' texts, in the rows forward_batch ran
    run_tokens: int = 0  # rows x sequence as run, after padding to the batch and to a shape bucket
    threads: int = 0  # the forward's intra-op threads (handlers.cpu.core_share)

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.real_tokens / self.run_tokens if self.run_tokens else 0.0


class BatchForward:
    """The served forward as a task runs it (``handlers.tasks.base.Served``): ``guard`` at the shape policy's shapes;
    the tokens each batch ran are counted into ``stats``."""

    def __init__(self, guard: GuardedForward, shapes: ShapePolicy, pad_values: Mapping[str, int],
                 on_device: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
                 lengths: LengthGrouping | None, stats: BatchStats, pads_sequence: bool = True):
        """``pads_sequence``: each chunk's axis 1 is padded to the policy's sequence bucket (text behind a mask);
        False pads rows only, the other axes run as they came."""
        self.guard = guard
        self.shapes = shapes
        self.pad_values = pad_values
        self.on_device = on_device
        self.lengths = lengths
        self.stats = stats
        self.pads_sequence = pads_sequence

    def forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Run the batch at the shape policy's shapes: chunks of at most the largest batch bucket, each padded
        up to its bucket, outputs sliced back to the real rows. Where the task answers one row per text, the rows
        run in groups of similar length, each trimmed to its longest, where the cost model says that is cheaper
        (``handlers.serving.length_groups``); the outputs come back in the batch's order."""
        outputs = []
        mask = inputs.get("attention_mask")
        rows, seq = rows_and_length(next(iter(inputs.values())))
        self.stats.real_tokens += int(mask.sum()) if mask is not None else rows * seq
        cost = self.lengths.cost_now() if self.lengths is not None else None
        groups = None if cost is None or mask is None else length_groups.row_groups(
            mask, self.shapes.max_batch, lambda rows, seq: cost.ms(*self.shapes.serving_shape(rows, seq)))
        chunks = split_rows(inputs, self.shapes.max_batch) if groups is None else length_groups.take_groups(
            inputs, mask, groups)
        for chunk in chunks:
            rows, seq = rows_and_length(next(iter(chunk.values())))
            shape = self.shapes.serving_shape(rows, seq)
            if not self.pads_sequence:
                shape = (shape[0], seq)
            self.stats.run_tokens += shape[0] * shape[1]
            padded = pad_batch(chunk, shape, self.pad_values, self.pads_sequence)
            outputs.append(take_rows(self.guard(**self.on_device(padded)), rows))
        joined = concat_rows(outputs)
        if groups is None:
            return joined
        order = torch.tensor([row for group in groups for row in group])
        return gather_rows(joined, torch.empty_like(order).scatter_(0, order, torch.arange(len(order))))

    def forward_step(self, **inputs: Any) -> Any:
        """One guarded call at exactly these shapes (a task's loop pads them to a warmed bucket itself)."""
        return self.guard(**inputs)


Batch = Mapping[str, torch.Tensor]


def rows_and_length(tensor: torch.Tensor) -> tuple[int, int]:
    """A batch's rows and the length of its axis 1 (1 where it has none)."""
    return tensor.shape[0], tensor.shape[1] if tensor.dim() > 1 else 1


def split_rows(batch: Batch, size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive chunks of at most ``size`` rows."""
    rows = next(iter(batch.values())).shape[0]
    for start in range(0, rows, size):
        yield {name: tensor[start : start + size] for name, tensor in batch.items()}


def pad_batch(batch: Batch, shape: tuple[int, int], pad_values: Mapping[str, int],
              pads_sequence: bool = True) -> dict[str, torch.Tensor]:
    """Pad 2-D token tensors to ``shape``: extra positions get the input's pad value (masked out), extra
    rows repeat the first row, so the padding rows compute on real numbers (a fully masked row can give
    NaN in attention) and are sliced away afterwards. Without ``pads_sequence``, rows only, of tensors of any
    rank."""
    rows, seq = shape
    padded = {}
    for name, tensor in batch.items():
        extra_seq = seq - tensor.shape[1] if pads_sequence else 0
        if extra_seq > 0:
            fill = tensor.new_full((tensor.shape[0], extra_seq), pad_values.get(name, 0))
            tensor = torch.cat([tensor, fill], dim=1)
        extra_rows = rows - tensor.shape[0]
        if extra_rows > 0:
            tensor = torch.cat([tensor, tensor[:1].expand(extra_rows, *tensor.shape[1:])], dim=0)
        padded[name] = tensor
    return padded


def take_rows(output: Any, rows: int) -> Any:
    """The first ``rows`` rows of every tensor in a (nested) output."""
    if isinstance(output, torch.Tensor):
        return output[:rows]
    if isinstance(output, Mapping):
        return {key: take_rows(value, rows) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(take_rows(value, rows) for value in output)
    return output


def gather_rows(output: Any, index: torch.Tensor) -> Any:
    """The rows ``index`` names, in that order, of every tensor in a (nested) output."""
    if isinstance(output, torch.Tensor):
        return output.index_select(0, index.to(output.device))
    if isinstance(output, Mapping):
        return {key: gather_rows(value, index) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(gather_rows(value, index) for value in output)
    return output


def concat_rows(outputs: Sequence[Any]) -> Any:
    """Join chunk outputs of the same structure along the batch dimension."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, Mapping):
        return {key: concat_rows([out[key] for out in outputs]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat_rows(list(parts)) for parts in zip(*outputs, strict=True))
    return first
