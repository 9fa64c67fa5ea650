"""The shape policy: which input shapes a compiled model sees, and what happens to the others.

* ``buckets``: every batch is padded up to a configured (batch, sequence) bucket, each bucket is compiled
  statically and warmed before READY, and the outputs are sliced back to the real rows. A batch with more
  rows than the largest batch bucket is served in chunks. Static shapes give the fastest CPU kernels.
* ``dynamic``: batch and sequence dimensions are symbolic; the warmup runs size 1 (which torch
  specializes) and sizes >= 2, so one graph serves every later size without compiling. Sequence lengths are
  padded up to a multiple of ``seq_multiple`` (16): the graph is shape-generic, but the kernels under it are
  not. oneDNN (bf16/fp16 and int8 matmuls on CPU, and float32 ones in a frozen graph) builds and keeps a
  primitive per matmul shape, in its own cache and in ideep's (1,024 each, hundreds of KB apiece on an AMX CPU),
  so a worker seeing every length up to 256 grew by hundreds of MB; rounded, it sees at most max_length / 16
  lengths per batch size.

``after_ready`` decides what an unseen shape does once the worker is READY: served eagerly without
compiling (``eager``), refused (``fail``), or compiled on the spot (``compile``).

The engine asks "which padded shape serves this batch?", the ladder "which shapes must be warmed?".
Tensors only: no TorchServe, no config parsing.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

ONEDNN_SEQ_MULTIPLE = 16  # measured: fewer primitives than 8 would leave, and AMX tiles like 16 rows


class PolicyKind(str, enum.Enum):
    BUCKETS = "buckets"
    DYNAMIC = "dynamic"


class AfterReady(str, enum.Enum):
    EAGER = "eager"  # serve an unseen shape eagerly, never compile after READY
    FAIL = "fail"  # refuse it with an error naming the shape
    COMPILE = "compile"  # compile it (the request that meets it waits for the compile)


@dataclass(frozen=True)
class ShapePolicy:
    kind: PolicyKind = PolicyKind.BUCKETS
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    seq_lengths: tuple[int, ...] = (16, 32, 64, 128)
    after_ready: AfterReady = AfterReady.EAGER
    # dynamic only: sequence lengths run padded up to a multiple of this (1: each batch at its own length). None:
    # chosen at load from what serves (``for_served``): ONEDNN_SEQ_MULTIPLE where oneDNN runs the matmuls, else 1.
    seq_multiple: int | None = None
    max_length: int | None = None  # the model's (``fitted``): rounding never pads past it
    length_groups: bool = True  # rows of mixed lengths may run in groups (handlers.serving.length_groups)
    # dynamic only: batches of at most this many tokens run a second graph, tuned at that size
    # (handlers.rungs.small_batch_graph); 0: one graph for every batch
    small_batch_tokens: int = 0

    @property
    def dynamic(self) -> bool:
        """What the compile rungs pass as ``torch.compile(dynamic=...)``."""
        return self.kind is PolicyKind.DYNAMIC

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes)

    def fitted(self, max_length: int) -> ShapePolicy:
        """Buckets never exceed ``max_length``; the largest one is ``max_length`` so every text has a bucket."""
        lengths = sorted({min(length, max_length) for length in self.seq_lengths})
        if self.kind is PolicyKind.BUCKETS and lengths[-1] < max_length:
            lengths.append(max_length)
        return replace(self, batch_sizes=tuple(sorted(set(self.batch_sizes))), seq_lengths=tuple(lengths),
                       max_length=max_length)

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """Every (batch, sequence) pair: each bucket, or the sizes that prove a dynamic graph."""
        return [(batch, seq) for batch in self.batch_sizes for seq in self.seq_lengths]

    def serving_shape(self, rows: int, seq: int) -> tuple[int, int]:
        """The shape a batch of ``rows`` x ``seq`` is run at (``rows`` <= ``max_batch``)."""
        if self.kind is PolicyKind.DYNAMIC:
            multiple = self.seq_multiple or 1
            rounded = -(-seq // multiple) * multiple
            return rows, max(seq, min(rounded, self.max_length or rounded))
        return _bucket(self.batch_sizes, rows), _bucket(self.seq_lengths, seq)

    def for_served(self, kernels_per_shape: bool) -> ShapePolicy:
        """This policy with ``seq_multiple`` chosen where the YAML left it: the primitive caches grow only where what
        serves keeps ``kernels_per_shape`` (``handlers.rungs.Rung.keeps_kernels_per_shape``); elsewhere the matmuls
        go through MKL, which keeps nothing per shape, and exact lengths cost no memory."""
        if self.seq_multiple is not None:
            return self
        return replace(self, seq_multiple=ONEDNN_SEQ_MULTIPLE if kernels_per_shape else 1)

    def describe(self) -> dict[str, Any]:
        described = {"policy": self.kind.value, "batch_sizes": list(self.batch_sizes),
                     "seq_lengths": list(self.seq_lengths), "after_ready": self.after_ready.value}
        if self.kind is PolicyKind.DYNAMIC:
            described["seq_multiple"] = self.seq_multiple
        if not self.length_groups:
            described["length_groups"] = False
        if self.small_batch_tokens:
            described["small_batch_tokens"] = self.small_batch_tokens
        return described


def _bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket >= size; a size beyond the largest stays as it is (an unseen shape)."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else size
