"""The ``tensor`` task: any ``nn.Module`` whose forward takes the named tensors ``pt2_handlers.inputs`` declares and
returns tensors (one, a tuple, or a dict of them). A request sends each input's rows as nested JSON lists (or Open
Inference tensors); the answer is each output's rows for that request, as nested lists. Judged by cosine per row and
the largest error against fp32 eager (``handlers.tasks.base.TensorGate``).

Rows are padded to the batch buckets (copies of the first row, sliced away); a dynamic axis is never padded, since
the model has no mask to hide padding from: requests of different sizes on it run as separate forwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.config.inputs import TensorSpec
from handlers.config.shapes import ShapePolicy
from handlers.errors import ConfigError, InvalidInput
from handlers.tasks import open_inference
from handlers.tasks.base import Emit, Encoded, Served, Task, TaskSettings

WARMUP_SEED = 0
HELD_OUT_SEED = 1  # int8's held-out inputs: the same distribution, other values


@dataclass(frozen=True)
class TensorRequest:
    rows: int
    tensors: dict[str, torch.Tensor]

    def key(self, specs: Sequence[TensorSpec]) -> tuple[int, ...]:
        """The sizes of the request's dynamic axes: requests with the same key share a forward."""
        return tuple(self.tensors[spec.name].shape[spec.dynamic_axis] for spec in specs if spec.dynamic_axis)


@dataclass(frozen=True)
class Group:
    requests: list[int]  # indexes into the batch's requests
    inputs: dict[str, torch.Tensor]


class TensorTask(Task):
    """Named tensors in, tensors out, for any ``nn.Module``."""

    name = "tensor"

    def __init__(self, setup: TaskSettings):
        super().__init__(setup)
        if not setup.inputs:
            raise ConfigError("the tensor task needs pt2_handlers.inputs: the model's input tensors")
        self.inputs: tuple[TensorSpec, ...] = setup.inputs
        self.dynamic = any(spec.dynamic_axis for spec in self.inputs)

    def fit_shapes(self, shapes: ShapePolicy) -> ShapePolicy:
        """Without a dynamic axis, the batch sizes alone."""
        return shapes if self.dynamic else super().fit_shapes(shapes)

    def parse(self, body: Any) -> TensorRequest:
        if isinstance(body, Mapping) and "inputs" in body:
            unknown = sorted(str(key) for key in body if key != "inputs")
            if unknown:
                raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; send {{\"inputs\": ...}}")
            body = body["inputs"]
        if not isinstance(body, Mapping):
            if len(self.inputs) != 1:
                raise InvalidInput(f"this model takes {len(self.inputs)} inputs: send {{\"inputs\": {{"
                                   + ", ".join(f'"{spec.name}": [...]' for spec in self.inputs) + "}}")
            body = {self.inputs[0].name: body}
        names = {spec.name for spec in self.inputs}
        unknown = sorted(str(key) for key in body if key not in names)
        missing = [spec.name for spec in self.inputs if spec.name not in body]
        if unknown or missing:
            raise InvalidInput(f"this model takes the inputs {', '.join(sorted(names))}"
                               + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                               + (f"; missing: {', '.join(missing)}" if missing else ""))
        tensors = {spec.name: self._tensor(body[spec.name], spec) for spec in self.inputs}
        rows = {tensor.shape[0] for tensor in tensors.values()}
        if len(rows) != 1:
            raise InvalidInput(f"every input needs the same number of rows, got {sorted(rows)}")
        self._same_dynamic_sizes(tensors)
        return TensorRequest(rows.pop(), tensors)

    def _tensor(self, value: Any, spec: TensorSpec) -> torch.Tensor:
        where = f'input "{spec.name}"'
        try:
            tensor = value.to(spec.torch_dtype) if isinstance(value, torch.Tensor) else torch.tensor(
                value, dtype=spec.torch_dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidInput(f"{where} must be nested lists of numbers of equal length ({spec.dtype}): "
                               f"{str(exc).splitlines()[0][:200]}") from None
        if tensor.dim() == len(spec.shape) - 1:
            tensor = tensor.unsqueeze(0)  # one row, sent without its batch axis
        if tensor.dim() != len(spec.shape):
            raise InvalidInput(f"{where} has {tensor.dim()} axes, this model takes {len(spec.shape)}: "
                               f"{list(spec.shape)}")
        for axis, (size, want) in enumerate(zip(tensor.shape, spec.shape, strict=True)):
            if isinstance(want, int) and size != want:
                raise InvalidInput(f"{where} has size {size} on axis {axis}; this model takes {want} "
                                   f"(shape {list(spec.shape)})")
            if size == 0:
                raise InvalidInput(f"{where} is empty on axis {axis}")
        if tensor.shape[0] > self.max_inputs:
            raise InvalidInput(f"{where} has {tensor.shape[0]} rows; at most {self.max_inputs} per request")
        return tensor

    def _same_dynamic_sizes(self, tensors: Mapping[str, torch.Tensor]) -> None:
        sizes: dict[str, set[int]] = {}
        for spec in self.inputs:
            if spec.dynamic_axis:
                axis_name = str(spec.shape[spec.dynamic_axis])
                sizes.setdefault(axis_name, set()).add(tensors[spec.name].shape[spec.dynamic_axis])
        differ = {name: sorted(found) for name, found in sizes.items() if len(found) > 1}
        if differ:
            raise InvalidInput(f"inputs disagree on the size of axis {', '.join(differ)}: {differ}")

    def preprocess(self, requests: Sequence[TensorRequest]) -> Encoded:
        """Requests of the same dynamic sizes share a forward: one group each, rows concatenated."""
        keys: dict[tuple[int, ...], list[int]] = {}
        for index, request in enumerate(requests):
            keys.setdefault(request.key(self.inputs), []).append(index)
        groups = [Group(indexes, {spec.name: torch.cat([requests[i].tensors[spec.name] for i in indexes])
                                  for spec in self.inputs}) for indexes in keys.values()]
        return Encoded(groups[0].inputs, groups)

    def run(self, served: Served, encoded: Encoded, emit: Emit | None) -> list[Any]:
        """Each group's forward; the outputs by group."""
        return [served.forward_batch(group.inputs) for group in encoded.extras]

    def postprocess(self, outputs: list[Any], encoded: Encoded, requests: Sequence[TensorRequest]) -> list[Any]:
        answers: list[Any] = [None] * len(requests)
        for group, output in zip(encoded.extras, outputs, strict=True):
            start = 0
            for index in group.requests:
                rows = requests[index].rows
                answers[index] = to_json(output, start, start + rows)
                start += rows
        return answers

    def warmup_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        return self._random_batches(shapes, WARMUP_SEED)

    def held_out_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        return self._random_batches(shapes, HELD_OUT_SEED)

    def _random_batches(self, shapes: Sequence[tuple[int, int]], seed: int) -> list[dict[str, torch.Tensor]]:
        """Seeded inputs at each (batch, dynamic size): the same on every load, so the gate reads the same."""
        generator = torch.Generator().manual_seed(seed)
        return [{spec.name: random_tensor(spec, spec.sizes(batch, seq), generator) for spec in self.inputs}
                for batch, seq in dict.fromkeys(shapes)]

    def from_open_inference(self, request: open_inference.InferRequest) -> Any:
        """Each v2 input as the model input of its name, at its shape."""
        inputs = {}
        for name, values in request.values.items():
            datatype = request.datatypes[name]
            if datatype == "BYTES":
                raise InvalidInput(f'input "{name}" is BYTES; this model reads numbers: send '
                                   f"{', '.join(open_inference.NUMERIC_DATATYPES)}")
            dtype = getattr(torch, open_inference.NUMERIC_DATATYPES[datatype])
            inputs[name] = torch.tensor(values, dtype=dtype).reshape(request.shapes[name])
        if request.parameters:
            raise InvalidInput(f"this model reads no parameters, got {', '.join(sorted(request.parameters))}")
        return {"inputs": inputs}

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        """One v2 tensor per output: ``output`` (one), ``output_0``... (a tuple), or the dict's names."""
        if isinstance(answer, Mapping):
            named = dict(answer)
        elif isinstance(answer, list) and answer and isinstance(answer[0], OutputList):
            named = {f"{self.open_inference_output}_{index}": value for index, value in enumerate(answer)}
        else:
            named = {self.open_inference_output: answer}
        return [v2_tensor(name, value) for name, value in named.items()]

    def describe_inputs(self) -> dict[str, Any]:
        return {"tensors": [spec.describe() for spec in self.inputs], "max_per_request": self.max_inputs}


class OutputList(list):
    """One output's rows, where the forward returned several (a tuple): kept apart from a nested list of numbers."""


def to_json(output: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of every tensor in ``output`` as nested lists (floats in float32), in its structure."""
    if isinstance(output, torch.Tensor):
        rows = output[start:end]
        return (rows.float() if rows.is_floating_point() else rows).tolist()
    if isinstance(output, Mapping):
        return {str(key): to_json(value, start, end) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return [OutputList(to_json(value, start, end)) if isinstance(value, torch.Tensor) else
                to_json(value, start, end) for value in output]
    return output


def random_tensor(spec: TensorSpec, sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    dtype = spec.torch_dtype
    if dtype.is_floating_point:
        values = torch.randn(sizes, generator=generator)
        if spec.low is not None and spec.high is not None:
            values = spec.low + (spec.high - spec.low) * torch.rand(sizes, generator=generator)
        return values.to(dtype)
    low, high = (int(spec.low), int(spec.high)) if spec.low is not None and spec.high is not None else (0, 2)
    return torch.randint(low, high, sizes, generator=generator).to(dtype)


def v2_tensor(name: str, rows: Any) -> dict[str, Any]:
    shape, flat = [], rows
    while isinstance(flat, list):
        shape.append(len(flat))
        flat = flat[0] if flat else None
    data = torch.tensor(rows).flatten().tolist() if shape else [rows]
    kinds = {type(value) for value in data}
    datatype = "BOOL" if kinds <= {bool} else "INT64" if kinds <= {int} else "FP32"
    return {"name": name, "shape": shape or [1], "datatype": datatype, "data": data}
