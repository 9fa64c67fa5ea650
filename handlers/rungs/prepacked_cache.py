"""Lets inductor's FX graph cache keep a frozen graph whose weights oneDNN prepacked (int8 always; fp32 or bf16 with
``freezing: true``), so a restarted or added worker loads it instead of lowering and compiling it again.

Inductor keys a frozen graph's weights by their metadata alone and, on a hit, takes their values from the graph
being compiled (torch's own scheme for frozen parameters). It still refuses any graph holding a oneDNN tensor
(``Bypassing FX Graph Cache because 'mkldnn tensors unpickleable'``), a check written before frozen graphs could be
cached: a frozen prepacked weight is never pickled, only keyed. A second int8 worker of MiniLM then loads in 19 s
instead of 31 (docs/performance.md).

``keyed_by_metadata()`` applies torch's scheme to frozen oneDNN tensors too (their size, dtype and device: the
layout is opaque to the generated code, oneDNN reads it at run time), only while it is entered. Unfrozen oneDNN
tensors still bypass the cache. Where torch's internals differ from what this expects (another torch version), it
changes nothing and the cache is bypassed as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MARK = "_pt2_handlers_keys_prepacked"  # on our replacements, so a nested entry changes nothing


def _key_of(metadata: Any) -> Any:
    return metadata


def _frozen_prepacked(tensor: torch.Tensor) -> bool:
    """A frozen oneDNN weight that the generated code reads at run time. One small enough for inductor to inline
    its values into the code would need them in the key: left to torch, which bypasses the cache for it."""
    from torch._inductor.freezing_utils import is_frozen_param
    from torch._inductor.graph import GraphLowering

    return tensor.is_mkldnn and is_frozen_param(tensor) and not GraphLowering.can_inline_constant(tensor)


def _targets() -> tuple[Any, staticmethod, Any, Callable[..., Any]] | None:
    """Inductor's validator and key pickler with the methods this replaces (as in torch 2.13), else None."""
    try:
        from torch._inductor import codecache, freezing_utils, graph
    except ImportError:
        return None
    validator = getattr(codecache, "CacheabilityValidator", None)
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    check = getattr(validator, "__dict__", {}).get("check_tensor")
    reduce = getattr(pickler, "__dict__", {}).get("_reduce_tensor")
    inlines = callable(getattr(getattr(graph, "GraphLowering", None), "can_inline_constant", None))
    if not (isinstance(check, staticmethod) and callable(reduce) and hasattr(freezing_utils, "is_frozen_param")
            and inlines):
        return None
    return validator, check, pickler, reduce


def _checking(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    @functools.wraps(original)
    def check_tensor(tensor: torch.Tensor) -> None:
        if not _frozen_prepacked(tensor):
            original(tensor)

    setattr(check_tensor, _MARK, True)
    return check_tensor


def _reducing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reduce_tensor(self: Any, tensor: torch.Tensor) -> Any:
        if _frozen_prepacked(tensor):
            return _key_of, (("frozen oneDNN tensor", tuple(tensor.size()), str(tensor.dtype), str(tensor.device)),)
        return original(self, tensor)

    setattr(reduce_tensor, _MARK, True)
    return reduce_tensor


@contextlib.contextmanager
def keyed_by_metadata() -> Iterator[bool]:
    """While entered, a frozen graph with prepacked oneDNN weights may be cached. Yields whether it may."""
    targets = _targets()
    if targets is None:
        yield False
        return
    validator, check, pickler, reduce = targets
    if getattr(check.__func__, _MARK, False):
        yield True  # entered already, further up the stack
        return
    validator.check_tensor = staticmethod(_checking(check.__func__))
    pickler._reduce_tensor = _reducing(reduce)
    try:
        yield True
    finally:
        validator.check_tensor = check
        pickler._reduce_tensor = reduce
