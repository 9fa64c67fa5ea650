"""The compile rungs: ``torch.compile`` as ``pt2.compile`` asks (``compile``), and its safer form (``safe_compile``).

What a compile needs beyond ``torch.compile`` lives beside this module: freezing that takes effect, one graph for
every thread count on shared cores (``thread_guard``), batch size 1 in the same graph (``unbacked_batch``), a graph of
its own for small batches (``small_batch_graph``), fewer guards (``module_guards``), frozen graphs in the compile
cache (``prepacked_cache``), and CUDA graphs' output buffers cloned.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from handlers.config import IPEX_BACKEND, CompileSpec, DType, RungName
from handlers.rungs import module_guards, prepacked_cache, small_batch_graph, thread_guard, unbacked_batch
from handlers.rungs.base import Forward, Rung
from handlers.rungs.ipex import probe_ipex


class CompileRung(Rung):
    """``torch.compile`` with ``spec``; compiled lazily, at the first forward of each shape."""

    compiles = True

    def __init__(self, name: str, spec: CompileSpec, skip_reason: str | None = None, keep_module_guards: bool = True):
        self.name = name
        self.spec = spec
        self._skip_reason = skip_reason
        # False: the model's attributes stay as they are between forwards, so a frozen compile need not guard them
        self.keep_module_guards = keep_module_guards
        self._guard_filters: dict[DType, module_guards.GuardFilter] = {}
        self.races = name == RungName.COMPILE.value  # the requested compile races openvino; its fallback does not

    def without_module_guards(self) -> CompileRung:
        """This rung, its compiles leaving out dynamo's guards on the model's attributes
        (handlers.rungs.module_guards)."""
        return CompileRung(self.name, self.spec, self._skip_reason, keep_module_guards=False)

    def module_guard_filter(self, dtype: DType) -> module_guards.GuardFilter | None:
        """What left the module guards out of the graphs compiled in ``dtype``; None where none did: every guard is
        kept unless the compile freezes the weights (unfrozen, they are graph inputs, guarded by dtype and shape only,
        which cannot tell two models of one class apart)."""
        return self._guard_filters.get(dtype)

    def unavailable_reason(self) -> str | None:
        if not self.spec.enabled:
            return "pt2.compile.enable is not true"
        if self._skip_reason is None and self.spec.backend == IPEX_BACKEND:
            return probe_ipex()[1]  # importing IPEX registers its backend
        return self._skip_reason

    def runs_in(self, dtype: DType) -> bool:
        return dtype is not DType.INT8 or self.spec.backend != IPEX_BACKEND  # IPEX's backend knows no torchao

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        if self.spec.uses_cuda_graphs and _device_of(module).type == "cuda":
            return _with_cudagraph_steps(self._compiled(module, self.spec.kwargs(), dtype))
        forward = self._compiled(module, self.spec.kwargs(), dtype)
        if self._small_batch_graph(module, dtype):
            # A copy: each graph freezes its own weights, and dynamo keeps the two apart by the module compiled.
            small = self._compiled(copy.deepcopy(module), self.spec.small_batch_kwargs(), dtype)
            return small_batch_graph.SmallBatchForward(forward, small, self.spec.small_batch_tokens)
        return forward

    def _compiled(self, module: torch.nn.Module, kwargs: dict[str, Any], dtype: DType) -> Forward:
        # Shared cores: kernels that follow the thread count, and one graph for every count
        # (handlers.rungs.thread_guard).
        one_graph = (self.spec.threads_follow and self.spec.backend == "inductor"
                     and thread_guard.guard_can_be_left_out())
        filters = [thread_guard.without_global_state_guard] if one_graph else []
        if not self.keep_module_guards and self._freezes(dtype):
            filters.append(self._guard_filters.setdefault(dtype, module_guards.GuardFilter()))
        compiled = torch.compile(module, **_with_guard_filters(kwargs, filters))
        if self.spec.one_graph and unbacked_batch.wanted(module):  # the model's head would give batch 1 a graph
            compiled = unbacked_batch.marking(compiled)
        if one_graph:
            compiled = thread_guard.checked(compiled)
        if self._freezes(dtype):
            compiled = _freezing_while_traced(compiled)
        return compiled

    def _small_batch_graph(self, module: torch.nn.Module, dtype: DType) -> bool:
        # The C++ GEMM template runs on CPUs, on constant (frozen) weights. int8 keeps one graph: autotuned, its small
        # graph took inductor's AVX-512 VNNI int8 template, and MiniLM's answers came out wrong (min cosine ~0 against
        # fp32 eager; torch 2.13, an AVX-512 VNNI EPYC; one int8 linear alone was right), so the gate refused int8
        # altogether and the archive served bf16 (docs/performance.md).
        return (bool(self.spec.small_batch_tokens) and dtype is not DType.INT8 and self._freezes(dtype)
                and _device_of(module).type == "cpu" and small_batch_graph.unsupported_reason() is None)

    def keeps_kernels_per_shape(self, dtype: DType) -> bool:
        # Frozen, inductor prepacks float32 weights for oneDNN too wherever the rows are symbolic (its mkldnn_fusion
        # pass): a shipped fp32 worker at exact lengths grew 36 % in a 640-request soak on an AVX2 EPYC.
        return super().keeps_kernels_per_shape(dtype) or self._freezes(dtype)

    def _freezes(self, dtype: DType) -> bool:
        # int8 always freezes: its int8 linears fuse into oneDNN's qlinear only on constant weights.
        return (self.spec.freezing or dtype is DType.INT8) and self.spec.backend == "inductor"

    def notes(self, device: torch.device) -> list[str]:
        """What the requested compile does not do here, said rather than pretended."""
        notes = []
        if self.spec.enabled and self.spec.uses_cuda_graphs and device.type != "cuda":
            notes.append(f"mode {self.spec.mode}: no CUDA graphs on {device.type}; inductor compiles without them")
        kept_one_graph = small_batch_graph.unsupported_reason()
        if self.spec.enabled and self.spec.small_batch_tokens and device.type == "cpu" and kept_one_graph:
            notes.append(kept_one_graph)
        return notes

    def warmup_context(self, batches: int) -> contextlib.AbstractContextManager:
        from torch._inductor import config as inductor_config  # imports dynamo: not before the cache dir is set

        stack = contextlib.ExitStack()
        # One graph per static warmup shape: past dynamo's recompile limit (8) the rest would run eagerly,
        # silently, both in the warmup and on live traffic.
        # Float attributes (dropout p, layer-norm eps) as constants from the start: dynamic tracing would make
        # them symbols, specialize them after all and trace the whole model a second time.
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=max(torch._dynamo.config.recompile_limit, batches), specialize_float=True))
        # No precompiled C++ headers: inductor keeps them under $TMPDIR, outside the compile cache, and builds
        # them again in every new process whose kernels are not in memory, even when every kernel is already
        # in the cache: +6 s on a new host or container with a warm cache volume. Cold compiles measured no
        # slower without them (``python -m benchmarks.restart``).
        stack.enter_context(inductor_config.patch(cpp_cache_precompile_headers=False))
        # A frozen graph (int8; freezing: true) into the compile cache although oneDNN prepacked its weights. Only
        # here, not around live calls (~60 us each): a graph compiled after READY is not kept for the next worker.
        stack.enter_context(prepacked_cache.keyed_by_metadata())
        if self.spec.one_graph:
            # Only while tracing: the guards it produces then admit batch size 1 to the same graph.
            stack.enter_context(fx_config.patch(backed_size_oblivious=True))
            stack.enter_context(unbacked_batch.while_traced())
        return stack


def _device_of(module: torch.nn.Module) -> torch.device:
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)  # int8 graphs may hold no parameters
    return tensor.device if tensor is not None else torch.device("cpu")


def _with_guard_filters(kwargs: dict[str, Any], filters: list[Callable[[Any], list[bool]]]) -> dict[str, Any]:
    """``torch.compile``'s ``kwargs`` with a ``guard_filter_fn`` keeping the guards every one of ``filters`` keeps.
    Only inductor compiles that set options of their own filter guards (shared cores, freezing), so a mode is
    already spelled out as options (CompileSpec.kwargs)."""
    if not filters:
        return kwargs

    def keep(entries: Any) -> list[bool]:
        return [all(kept) for kept in zip(*(chosen(entries) for chosen in filters), strict=True)]

    return {**kwargs, "options": {**kwargs["options"], "guard_filter_fn": keep}}


def _freezing_while_traced(compiled: Forward) -> Forward:
    """Inductor freezing that takes effect. ``torch.compile(options={"freezing": True})`` alone does nothing
    (torch 2.13): dynamo reads the global ``torch._inductor.config.freezing`` while it traces, before the options
    apply, and lifts the weights to graph inputs, which inductor cannot freeze. The flag is set around every call,
    since any call may trace (the warmup, or a new shape after READY): set and put back directly, 6.5 us a call (p50)
    against 22.7 through ``inductor_config.patch``, which builds a class each time. Like a patch, the flag is the
    calling thread's (a context variable)."""
    from torch._inductor import config as inductor_config  # imports dynamo: not before the cache dir is set

    def forward(*args: Any, **kwargs: Any) -> Any:
        if inductor_config.freezing:  # set already (by the caller, or an outer graph of the same rung)
            return compiled(*args, **kwargs)
        inductor_config.freezing = True
        try:
            return compiled(*args, **kwargs)
        finally:
            inductor_config.freezing = False

    return forward


def _with_cudagraph_steps(compiled: Forward) -> Forward:
    """CUDA-graph trees reuse output buffers across replays: mark each call as a new step and clone the
    outputs, so a batch never reads (or hands a client) buffers the next replay overwrites."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return _cloned(compiled(*args, **kwargs))

    return forward


def _cloned(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, Mapping):
        return {key: _cloned(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(_cloned(value) for value in output)
    return output
