"""Rows dynamo cannot ask about, for a model whose compile would otherwise give batch size 1 a graph of its own.

While the compile rung traces, the dynamic shape policy keeps size-1 dimensions symbolic (size-oblivious), so one
graph serves every batch. Inductor can still ask about the rows themselves: lowering a question-answering head's
``logits.split(1, -1)`` and ``squeeze(-1)`` to a view, it computes the view's strides with ``rows != 1``, a guard,
and batch 4 then compiles a second graph (docs/performance.md). With the
traced batch's rows marked unbacked, dynamo has no value to guard on: one graph, and a QA worker's warmup 13-16 s
shorter on an AVX2-only EPYC.

Opt-in per module, by the task that builds it (``ATTRIBUTE``): an unbacked size gives inductor no hint to pick
kernels by, which was measured not to matter only for an unfrozen fp32 model. Only while the warmup traces: a view
of each tensor is marked, never the caller's, and live calls pass through. Pure torch; no TorchServe import.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

ATTRIBUTE = "rows_unbacked_while_traced"  # a module's class sets it True to ask for this
# Checked with torch 2.13; under an older torch (the ipex profile's 2.8) the rung traces as before.
FIRST_TORCH = (2, 13)

_tracing = contextvars.ContextVar("pt2_handlers_unbacked_rows", default=False)


def wanted(module: torch.nn.Module) -> bool:
    recent = torch.torch_version.TorchVersion(torch.__version__) >= FIRST_TORCH
    return recent and bool(getattr(module, ATTRIBUTE, False))


@contextlib.contextmanager
def while_traced() -> Iterator[None]:
    """The warmup: forwards wrapped by ``marking`` mark their rows unbacked while inside."""
    token = _tracing.set(True)
    try:
        yield
    finally:
        _tracing.reset(token)


def marking(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, called with the rows (dimension 0) of every tensor argument unbacked while ``while_traced``."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not _tracing.get():
            return compiled(*args, **kwargs)
        return compiled(*map(_rows_unbacked, args), **{name: _rows_unbacked(value) for name, value in kwargs.items()})

    return forward


def _rows_unbacked(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    view = value.view(value.shape)  # its own tensor object: the caller's batch stays unmarked for the other rungs
    torch._dynamo.decorators.mark_unbacked(view, 0)
    return view
