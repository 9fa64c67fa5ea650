"""The ways to run a model that the ladder can try: compile (as requested), safe_compile, ipex, eager.

Each rung says whether it can run here (``unavailable_reason``) and wraps a module at a precision (``apply``);
``apply`` may be lazy, so the ladder proves every rung by running it. Pure torch; no TorchServe import.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from handlers.config import IPEX_BACKEND, CompileSpec, DType, HandlerConfig, RungName
from handlers.rungs import module_guards, prepacked_cache
from handlers.rungs import small_batch_graph as small_batches
from handlers.rungs import thread_guard as global_state
from handlers.rungs import unbacked_batch as unbacked_rows
from handlers.rungs.ipex import probe_ipex

Forward = Callable[..., Any]


class Rung(ABC):
    """One way to run the model. ``apply`` may be lazy; the ladder proves it with warmup + the quality gate."""

    name: str

    def unavailable_reason(self) -> str | None:
        """Why this rung cannot be tried here, or None when it can."""
        return None

    def runs_in(self, dtype: DType) -> bool:
        """Whether this rung takes a model in ``dtype`` at all. int8 is for compile rungs alone: inductor fuses
        the activations' quantization and rescaling around each int8 matmul; run eagerly or by IPEX, int8 is
        slower than the float precisions."""
        return dtype is not DType.INT8

    @abstractmethod
    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        """``module`` (already in ``dtype``) run this way."""

    def follows_threads(self) -> bool:
        """Whether what ``apply`` builds runs at any intra-op thread count as it was proven (handlers.cpu.core_share);
        else at the count it was built at, unless the ladder proves it at others too."""
        return False

    def keeps_kernels_per_shape(self, dtype: DType) -> bool:
        """Whether what ``apply`` builds in ``dtype`` runs its matmuls through oneDNN, which keeps a primitive per
        input shape (handlers.config.shapes: the lengths it sees are then rounded). Half precisions and int8 do; float32
        goes through MKL, which keeps nothing per shape."""
        return dtype is not DType.FLOAT32

    def notes(self, device: torch.device) -> list[str]:
        """Things the configured rung cannot do on this device, for describe."""
        return []

    def warmup_context(self, batches: int) -> contextlib.AbstractContextManager:
        """Settings the warmup of ``batches`` batches runs under (for compile rungs: while graphs are traced)."""
        return contextlib.nullcontext()


class CompileRung(Rung):
    def __init__(self, name: str, spec: CompileSpec, skip_reason: str | None = None, keep_module_guards: bool = True):
        self.name = name
        self.spec = spec
        self._skip_reason = skip_reason
        # False: the model's attributes stay as they are between forwards, so a frozen compile need not guard them
        self.keep_module_guards = keep_module_guards
        self._guard_filters: dict[DType, module_guards.GuardFilter] = {}

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
            return small_batches.SmallBatchForward(forward, small, self.spec.small_batch_tokens)
        return forward

    def _compiled(self, module: torch.nn.Module, kwargs: dict[str, Any], dtype: DType) -> Forward:
        # Shared cores: kernels that follow the thread count, and one graph for every count
        # (handlers.rungs.thread_guard).
        one_graph = (self.spec.threads_follow and self.spec.backend == "inductor"
                     and global_state.guard_can_be_left_out())
        filters = [global_state.without_global_state_guard] if one_graph else []
        if not self.keep_module_guards and self._freezes(dtype):
            filters.append(self._guard_filters.setdefault(dtype, module_guards.GuardFilter()))
        compiled = torch.compile(module, **_with_guard_filters(kwargs, filters))
        if self.spec.one_graph and unbacked_rows.wanted(module):  # the model's head would give batch 1 a graph
            compiled = unbacked_rows.marking(compiled)
        if one_graph:
            compiled = global_state.checked(compiled)
        if self._freezes(dtype):
            compiled = _freezing_while_traced(compiled)
        return compiled

    def _small_batch_graph(self, module: torch.nn.Module, dtype: DType) -> bool:
        # The C++ GEMM template runs on CPUs, on constant (frozen) weights. int8 keeps one graph: autotuned, its small
        # graph took inductor's AVX-512 VNNI int8 template, and MiniLM's answers came out wrong (min cosine ~0 against
        # fp32 eager; torch 2.13, an AVX-512 VNNI EPYC; one int8 linear alone was right), so the gate refused int8
        # altogether and the archive served bf16 (docs/performance.md: Small batches on an AVX-512 EPYC).
        return (bool(self.spec.small_batch_tokens) and dtype is not DType.INT8 and self._freezes(dtype)
                and _device_of(module).type == "cpu" and small_batches.unsupported_reason() is None)

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
        kept_one_graph = small_batches.unsupported_reason()
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
        # slower without them (bench_restart.py, docs/performance.md: Restarts).
        stack.enter_context(inductor_config.patch(cpp_cache_precompile_headers=False))
        # A frozen graph (int8; freezing: true) into the compile cache although oneDNN prepacked its weights. Only
        # here, not around live calls (~60 us each): a graph compiled after READY is not kept for the next worker.
        stack.enter_context(prepacked_cache.keyed_by_metadata())
        if self.spec.one_graph:
            # Only while tracing: the guards it produces then admit batch size 1 to the same graph.
            stack.enter_context(fx_config.patch(backed_size_oblivious=True))
            stack.enter_context(unbacked_rows.while_traced())
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
    since any call may trace (the warmup, or a new shape after READY): set and put back directly, 6.5 us a call (p50,
    an AVX2 EPYC, scripts/bench_wrappers.py) against 22.7 through ``inductor_config.patch``, which builds a class
    each time. Like a patch, the flag is the calling thread's (a context variable)."""
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


class IpexRung(Rung):
    name = RungName.IPEX.value

    def __init__(self, device: torch.device):
        self.device = device

    def unavailable_reason(self) -> str | None:
        if self.device.type != "cpu":
            return f"IPEX runs on CPU only; this worker uses {self.device}"
        return probe_ipex()[1]

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        ipex, reason = probe_ipex()
        if ipex is None:
            raise RuntimeError(reason)
        # No channels_last: it suits convolutions, and these are transformers.
        return ipex.optimize(module.eval(), dtype=None if dtype is DType.FLOAT32 else dtype.torch, inplace=False)


class EagerRung(Rung):
    name = RungName.EAGER.value

    def apply(self, module: torch.nn.Module, dtype: DType) -> Forward:
        return module

    def follows_threads(self) -> bool:
        return True


def build_ladder(config: HandlerConfig, device: torch.device,
                 compile_unavailable: str | None = None, inductor_unavailable: str | None = None,
                 threads_follow: bool = False) -> list[Rung]:
    """The rungs named in ``pt2_handlers.ladder``, in order; eager is always last. ``compile_unavailable``
    skips the compile rungs with that reason (e.g. no writable compile cache); ``inductor_unavailable`` skips
    those that compile with inductor (e.g. no C++ compiler for a CPU worker). ``threads_follow``: the compiled
    kernels take the thread count each call runs at (the worker shares its cores: handlers.cpu.core_share)."""
    requested = replace(config.served_compile, threads_follow=threads_follow)
    rungs: list[Rung] = []

    def unavailable(spec: CompileSpec) -> str | None:
        return compile_unavailable or (inductor_unavailable if spec.backend == "inductor" else None)

    for name in config.settings.ladder:
        if name is RungName.COMPILE:
            rungs.append(CompileRung(name.value, requested, skip_reason=unavailable(requested)))
        elif name is RungName.SAFE_COMPILE:
            same = "identical to the compile rung" if requested.safer() == requested else None
            rungs.append(CompileRung(name.value, requested.safer(), skip_reason=unavailable(requested.safer()) or same))
        elif name is RungName.IPEX:
            rungs.append(IpexRung(device))
        else:
            rungs.append(EagerRung())
    return rungs
