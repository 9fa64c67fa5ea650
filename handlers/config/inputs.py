"""``pt2_handlers.inputs``: the tensors a model takes, by name, for the ``tensor`` task (and tasks of one's own):
each one's dtype and shape, its batch axis first, so that requests can be checked and warmup inputs made.

A shape lists ``batch``, then each other axis as a fixed size or, at most one of them, a name (``seq``, ``length``):
a dynamic axis whose sizes are warmed from ``shapes.seq_lengths``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, StrictFloat, StrictInt, StrictStr, field_validator

from handlers.config.fields import Section, problem

BATCH_AXIS = "batch"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
TensorDType = Literal[tuple(DTYPES)]
Axis = Annotated[StrictInt, Field(ge=1)] | StrictStr


@dataclass(frozen=True)
class TensorSpec:
    """One named model input: dtype, shape (``batch`` first; ints fixed; one name for a dynamic axis), and the range
    its warmup values are drawn from (floats: a standard normal where none is given)."""

    name: str
    dtype: str = "float32"
    shape: tuple[int | str, ...] = (BATCH_AXIS,)
    low: float | None = None
    high: float | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dynamic_axis(self) -> int | None:
        """The index of the named non-batch axis, if any."""
        return next((i for i, axis in enumerate(self.shape) if i and isinstance(axis, str)), None)

    def sizes(self, batch: int, seq: int) -> list[int]:
        return [batch if i == 0 else seq if isinstance(axis, str) else axis for i, axis in enumerate(self.shape)]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


class InputSection(Section):
    """A model input: the tensor a request sends under this name."""

    name: StrictStr
    """The input's name: the forward's keyword argument, and the request's key."""
    dtype: TensorDType = "float32"
    """The tensor's dtype; requests' numbers are converted to it."""
    shape: list[Axis] = Field(min_length=1)
    """`batch` first, then each axis as a fixed size (`8`) or, for one axis whose size varies between requests, a
    name (`seq`); its sizes are warmed from `shapes.seq_lengths`."""
    range: Annotated[list[StrictFloat | StrictInt], Field(min_length=2, max_length=2)] | None = None
    """`[low, high]`: what the warmup draws this input's values from (integers: `low` to `high - 1`, e.g. token
    ids below the vocabulary's size). Left out: a standard normal for floats, `[0, 2]` for integers and bool."""

    @field_validator("shape")
    @classmethod
    def _batch_first_one_dynamic(cls, shape: list[int | str]) -> list[int | str]:
        if shape[0] != BATCH_AXIS:
            raise problem(f"the first axis is the batch: write [{BATCH_AXIS}, ...], got {shape}")
        named = [axis for axis in shape[1:] if isinstance(axis, str)]
        if len(named) > 1 or BATCH_AXIS in named:
            raise problem(f"at most one axis besides the batch may vary (a name), got {shape}")
        return shape

    @field_validator("range")
    @classmethod
    def _low_below_high(cls, bounds: list[float] | None) -> list[float] | None:
        if bounds is not None and not bounds[0] < bounds[1]:
            raise problem(f"low must be below high, got {bounds}")
        return bounds

    def spec(self) -> TensorSpec:
        low, high = self.range or (None, None)
        return TensorSpec(self.name, self.dtype, tuple(self.shape), low, high)
