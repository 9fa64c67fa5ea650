"""Small batches through a graph of their own (``pt2_handlers.shapes.small_batch_tokens``).

One dynamic graph serves every batch, and its matmuls are the library's (oneDNN, MKL), chosen for no size in
particular. At a few dozen rows of tokens those calls cost more than their arithmetic: on an AVX2-only EPYC a
384 x 384 fp32 linear over 16 rows takes 0.10 ms in oneDNN and 0.05 ms in inductor's C++ GEMM template, which loses
by 10-30 % from 128 rows up (docs/performance.md). So a compile rung may build a second graph of the
same model, traced at the smallest warmup shape with ``max_autotune`` (each matmul timed at that size, template
against library), and send it every batch of at most ``max_tokens`` tokens; larger ones keep the first graph.
Both are warmed, judged by the quality gate and proven before READY like any forward of the rung.
Pure torch; no TorchServe import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Forward = Callable[..., Any]

# Checked with torch 2.13. torch 2.8 (the ipex profile) keeps both graphs in one cache of the model's forward, guards
# each copy's frozen weights by identity, and can bring the small graph back from the graph cache specialized to one
# row: a later small batch of another size matches neither and is served eagerly (docs/shapes.md: Small batches).
FIRST_TORCH = (2, 13)


def unsupported_reason() -> str | None:
    """Why this torch keeps one graph (None: a small batches' graph works here)."""
    if torch.torch_version.TorchVersion(torch.__version__) >= FIRST_TORCH:
        return None
    return (f"shapes.small_batch_tokens: one graph under torch {torch.__version__} (a second graph for small batches "
            f"needs torch >= {'.'.join(map(str, FIRST_TORCH))}: docs/shapes.md)")


def tokens_of(batch: dict[str, Any]) -> int:
    """Rows x length of the batch's first tensor (``input_ids``: rows x padded tokens); rows of a 1-d one."""
    first = next(value for value in batch.values() if isinstance(value, torch.Tensor))
    return first.shape[0] * first.shape[1] if first.dim() >= 2 else first.shape[0]


class SmallBatchForward:
    """``small`` for batches of at most ``max_tokens`` tokens, ``large`` for the rest; counts what each served."""

    def __init__(self, large: Forward, small: Forward, max_tokens: int):
        self.large = large
        self.small = small
        self.max_tokens = max_tokens
        self.small_batches = 0
        self.large_batches = 0

    def __call__(self, **batch: Any) -> Any:
        if tokens_of(batch) <= self.max_tokens:
            self.small_batches += 1
            return self.small(**batch)
        self.large_batches += 1
        return self.large(**batch)
