"""A fused attention kernel for the graphs torch.compile traces on AVX-512 CPUs (``fused_attention.cpp``).

PyTorch's CPU attention (SDPA's flash kernel) cuts every head into blocks of 32 queries and makes two small GEMM
calls per block; at BERT's head size (32-64) and a few hundred tokens the calls cost more than their arithmetic: in
MiniLM's int8 forward at 8 x 128 tokens, 6 attention calls took 2.66 ms each, a third of the forward. The kernel here
runs a whole (batch, head) at once, in registers and L1, with bf16 dot products where the CPU has them and the
inputs are bf16 already (float32 queries and keys are never rounded): about a third of SDPA's time per call; the int8
archive served 5-25 % more at 16 clients (docs/performance.md). On a CPU with AMX its two products run on AMX tiles, 16
queries at a time (float32 values as two bf16 halves, good to ~2^-16): half the AVX-512 path's time at 8 x 128 tokens;
describe's ``instructions`` says which path runs.

``use_in_compiled_graphs`` builds it with the machine's C++ compiler (kept under a build directory, beside the
compile cache, for the next worker), registers it with torch and transformers, and points the model's attention at
it. Only what torch.compile or torch.export trace calls the kernel: an eager forward (the fp32 reference the quality
gate judges by, the eager rung) still runs transformers' SDPA function, so every rung that uses the kernel passes the
gate against SDPA's answers first. Causal attention, GPUs, float16, grouped heads, a head size that is not a multiple
of 16: SDPA, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

IMPLEMENTATION = "pt2_handlers_fused"  # the model's attn_implementation while the kernel is in use
DIRECTORY = "pt2_handlers_fused_attention"  # the built kernels, inside the compile cache
SOURCE = Path(__file__).with_name("fused_attention.cpp")
BUILD_TIMEOUT_S = 300
NEEDED_CPU_FLAGS = ("avx512f", "avx512bw")
TORCH_BACKENDS = frozenset({"inductor", "eager", "aot_eager"})  # torch.compile backends that run the kernel as is
# Warnings off: torch's headers warn under C++17 with recent compilers. No -ffast-math: masked scores are -inf.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w", "-fno-math-errno",
         "-fno-trapping-math")


@dataclass(frozen=True)
class Outcome:
    """Which attention compiled graphs of this model run, and why (for describe and the load log)."""

    fused: bool
    reason: str
    instructions: str | None = None  # the kernel's for bf16 heads here: amx_bf16, avx512_bf16 or avx512f
    source: str | None = None  # the kernel source's hash

    @property
    def identity(self) -> str:
        """What the compiled forwards' speed depends on here: which kernel, its source, its instructions (races kept
        between loads are keyed by it, so a changed kernel is raced again)."""
        return " ".join(part for part in (IMPLEMENTATION if self.fused else "sdpa", self.source, self.instructions)
                        if part)

    def describe(self) -> dict[str, Any]:
        kernel = {"kernel": IMPLEMENTATION if self.fused else "sdpa", "reason": self.reason}
        return kernel | ({"instructions": self.instructions} if self.instructions else {})

    def summary(self) -> str:
        """One line for the load log: the kernel, on which instructions, and why."""
        on = f" on {self.instructions}" if self.instructions else ""
        return f"{IMPLEMENTATION if self.fused else 'sdpa'}{on} ({self.reason})"


def use_in_compiled_graphs(model: torch.nn.Module, device: torch.device, build_dir: Path | None, *, wanted: bool,
                           causal: bool, backends: Collection[str]) -> Outcome:
    """Point ``model`` (a transformers model using SDPA) at the fused kernel for what is traced from now on, if it
    is ``wanted``, the model's attention is not ``causal``, only torch's own backends compile it (``backends``: those
    of the compile rungs that can run), and the kernel builds into ``build_dir`` and loads here; else leave it."""
    why_not = (_why_not(model, device, wanted, causal) or _why_not_traced(build_dir, backends) or unavailable_here()
               or _why_not_loaded(build_dir))
    if why_not:
        return Outcome(False, why_not)
    _register_with_transformers()
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except (ValueError, AttributeError, NotImplementedError) as exc:  # an architecture without attention functions
        return Outcome(False, f"the model takes no attention function ({_first_line(exc)}): SDPA")
    return Outcome(True, "non-causal attention in compiled graphs runs pt2-handlers' fused kernel; eager forwards "
                         "run SDPA", torch.ops.pt2_handlers.fused_attention_isa(),
                   hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16])


def _why_not(model: torch.nn.Module, device: torch.device, wanted: bool, causal: bool) -> str | None:
    if not wanted:
        return "pt2_handlers.attention is sdpa"
    if causal:
        return "causal attention: SDPA"
    if device.type != "cpu":
        return f"the kernel runs on CPU, this worker on {device.type}: SDPA"
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in ("sdpa", IMPLEMENTATION):
        return f"the model's attention is {implementation!r}, not SDPA: left as it is"
    return None


def _why_not_traced(build_dir: Path | None, backends: Collection[str]) -> str | None:
    if not backends:
        return "no compile rung can run: nothing traced, SDPA"
    if others := sorted(set(backends) - TORCH_BACKENDS):
        return f"compile backend {'/'.join(others)} would trace the kernel too; it is proven with torch's only: SDPA"
    if build_dir is None:
        return "no writable compile cache to build the kernel into: SDPA"
    return None


def unavailable_here() -> str | None:
    """The CPU and torch's kernel level: the kernel is AVX-512 code, and a torch held below it (ATEN_CPU_CAPABILITY,
    as the AVX2-held test stage does) stands for a CPU without it."""
    from handlers.cpu import features

    capability = torch.backends.cpu.get_cpu_capability()
    if capability.upper() in features.ATEN_VECTOR_ISAS_BELOW_AVX512:
        return f"torch dispatches at {capability} here, the kernel needs AVX-512: SDPA"
    if problem := machine_cannot_build():
        return f"{problem}: SDPA"
    return None


def machine_cannot_build() -> str | None:
    """Why this machine cannot build and run the kernel whatever torch dispatches at: AVX-512 code, built with its C++
    compiler. None where it can."""
    from handlers.cpu import features

    missing = [flag for flag in NEEDED_CPU_FLAGS if flag not in features.linux_cpu_flags()]
    if missing:
        return f"the CPU lacks {'/'.join(missing)}"
    return features.cpp_compiler_problem(torch.device("cpu"))


def load(build_dir: Path) -> str | None:
    """Build the kernel into ``build_dir`` (or reuse it) and load it into torch, as a load that uses it does (for
    tests and benchmarks): why that failed, or None."""
    return machine_cannot_build() or _why_not_loaded(build_dir)


def _why_not_loaded(build_dir: Path | None) -> str | None:
    if _registered():
        return None
    try:
        assert build_dir is not None  # _why_not_traced
        library = build(build_dir)
        torch.ops.load_library(str(library))
        for name in ("fused_attention", "fused_attention_avx512"):
            torch.library.register_fake(f"pt2_handlers::{name}")(_shape_of_output)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"the kernel did not build or load ({_first_line(exc)}): SDPA"
    return None


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("pt2_handlers::fused_attention", "CPU")
    except RuntimeError:  # the operator does not exist yet
        return False


def build(build_dir: Path) -> Path:
    """The kernel's shared library for this compiler, torch, CPU and source: built once into ``build_dir``, atomically,
    so workers that start together each build or read a whole one."""
    from torch._inductor import cpp_builder
    from torch.utils import cpp_extension

    from handlers.cpu import features

    compiler = cpp_builder.get_cpp_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = [*FLAGS, abi, *(f"-I{path}" for path in cpp_extension.include_paths()),
             *(f"-L{path}" for path in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    identity = repr((SOURCE.read_bytes(), version, torch.__version__, sys.version_info[:2], flags,
                     sorted(features.linux_cpu_flags()), features.linux_cpu_model()))
    target = build_dir / f"fused_attention-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.so")
    logger.info("fused attention: building %s with %s (once per machine kind; ~10 s)", target.name, compiler)
    started = time.perf_counter()
    try:
        done = subprocess.run([compiler, str(SOURCE), "-o", str(partial), *flags], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-600:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("fused attention: built in %.1f s", time.perf_counter() - started)
    return target


def _shape_of_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    batch, heads, queries, head_size = query.shape
    return query.new_empty(batch, queries, heads, head_size)


def _register_with_transformers() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mask)


_LEFT_OUT = threading.local()


@contextlib.contextmanager
def left_out() -> Iterator[None]:
    """Graphs traced inside run SDPA as the model comes: for a runtime that does not know this package's kernel
    (OpenVINO converts the graph torch.export traces)."""
    before = getattr(_LEFT_OUT, "on", False)
    _LEFT_OUT.on = True
    try:
        yield
    finally:
        _LEFT_OUT.on = before


def _in_traced_graph() -> bool:
    return torch.compiler.is_compiling() and not getattr(_LEFT_OUT, "on", False)


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
         mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """A transformers mask function: SDPA's masks, but while a graph is traced, an encoder's padding mask stays
    one row per text ([batch, 1, 1, keys]) instead of one per query ([batch, 1, queries, keys]), which the graph
    would write out for every layer (6 copies, 1.8 ms of MiniLM's int8 forward at 8 x 128; the kernel broadcasts)."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    if (_in_traced_graph() and mask_function is bidirectional_mask_function and attention_mask is not None
            and attention_mask.dim() == 2 and q_offset == 0 and kv_offset == 0 and not kwargs.get("use_vmap")
            and kwargs.get("local_size") is None and attention_mask.shape[-1] == kv_length):
        return attention_mask.to(torch.bool)[:, None, None, :]
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: the fused kernel while torch.compile or torch.export traces, where it
    fits; else (eager forwards, and what it does not cover) transformers' SDPA function, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _in_traced_graph() and fits(module, query, key, value, attention_mask, dropout, kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return torch.ops.pt2_handlers.fused_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def fits(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> bool:
    """What the kernel computes as SDPA does: non-causal, no dropout, bf16/float32 on CPU, as many key heads as
    query heads, a head size that is a multiple of 16 (at most 512), a bool or float mask of at most 4 dims."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", False)
    tensors = (query, key, value)
    return (not causal and (dropout == 0.0 or not module.training)
            and all(t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32) and t.dim() == 4
                    for t in tensors)
            and key.shape[1] == query.shape[1] == value.shape[1]
            and query.shape[-1] % 16 == 0 and query.shape[-1] <= 512
            and (mask is None or (mask.dim() <= 4 and (mask.dtype == torch.bool or mask.is_floating_point()))))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
