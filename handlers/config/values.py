"""The frozen values a validated model YAML becomes: what the engine, the ladder and the tasks read.

Plain dataclasses and enums, built by ``handlers.config.load_config`` (from the sections the schema validates) or
by tests; nothing here parses YAML.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from handlers.config.image import ImageSpec
from handlers.config.inputs import TensorSpec
from handlers.config.shapes import ShapePolicy


@dataclass(frozen=True)
class Choice:
    """A setting resolved at load (a precision, a thread count) and why it was chosen (shown in describe)."""

    value: object
    reason: str


IPEX_BACKEND = "ipex"  # the torch.compile backend IPEX registers when imported
# TorchServe users write pt2.compile.backend: openvino (OpenVINO's dynamo backend); pt2-handlers serves it with the
# openvino rung, which converts the module itself (handlers.rungs.openvino)
OPENVINO_BACKEND = "openvino"


class RungName(str, enum.Enum):
    """The optimization ladder's rungs, tried in the configured order."""

    AOT = "aot"  # the AOTInductor package the archive carries (pt2.export.aot_compile), where it fits the host
    OPENVINO = "openvino"  # the module exported, converted and compiled by OpenVINO, CPU only
    COMPILE = "compile"  # exactly what pt2.compile asks for
    SAFE_COMPILE = "safe_compile"  # inductor, default mode: no CUDA graphs, no autotuning, no custom options
    IPEX = "ipex"  # intel_extension_for_pytorch.optimize, CPU only
    EAGER = "eager"  # the plain model; always last, always works


class Pick(str, enum.Enum):
    """Which proven rung serves."""

    FASTEST = "fastest"  # the first rung that proves itself races the next racing rung (openvino, compile)
    FIRST = "first"  # the first rung of the ladder that proves itself: the order is pinned


class DType(str, enum.Enum):
    AUTO = "auto"  # resolved at load from the hardware (handlers.precision.choice.resolve_precisions)
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"  # opt-in (never from auto): static int8 linear layers and convolutions (PT2E), the rest bf16 or fp32

    @property
    def torch(self) -> torch.dtype:
        """The floating dtype the module's parameters and activations are kept in."""
        return torch.float32 if self is DType.INT8 else getattr(torch, self.value)


class TooLong(str, enum.Enum):
    """What a text longer than the model reads (``max_length`` tokens) gets."""

    REJECT = "reject"  # a 400 naming the text and its length: the client decides what to cut
    TRUNCATE = "truncate"  # the first max_length tokens are read, the rest ignored


class ModuleGuards(str, enum.Enum):
    """Whether compiled forwards check dynamo's guards on the model's attributes (handlers.rungs.module_guards)."""

    AUTO = "auto"  # left out where the model's own eager forwards leave its attributes as they were
    KEEP = "keep"  # every guard, always


class Attention(str, enum.Enum):
    """Which attention the graphs torch.compile traces run (eager forwards always run transformers' SDPA)."""

    AUTO = "auto"  # pt2-handlers' fused kernel where it fits and builds (AVX-512 CPUs), else SDPA
    SDPA = "sdpa"  # transformers' SDPA function, as the model comes


@dataclass(frozen=True)
class CompileSpec:
    """The ``torch.compile`` arguments of one rung. ``enabled`` False means: do not compile."""

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    options: Mapping[str, Any] | None = None
    freezing: bool = False  # inductor only: weights become constants, prepacked for the CPU kernels
    # dynamic only: size-1 dims stay symbolic (size-oblivious), so batch 1 shares the one graph. Measured:
    # half the cold compile and warm restart of two graphs, same speed.
    one_graph: bool = False
    # inductor's CPU kernels ask OpenMP for the thread count at each call instead of keeping the count they were
    # compiled at: the worker shares its cores forward by forward (handlers.cpu.core_share)
    threads_follow: bool = False
    # inductor, dynamic and frozen only: batches of at most this many tokens run a second graph whose matmuls
    # inductor picks at that size (handlers.rungs.small_batch_graph); 0: one graph
    small_batch_tokens: int = 0

    def kwargs(self) -> dict[str, Any]:
        """Fresh keyword arguments for ``torch.compile`` (the backend resolved to a callable if custom)."""
        kwargs: dict[str, Any] = {
            "backend": resolve_backend(self.backend), "fullgraph": self.fullgraph, "dynamic": self.dynamic,
        }
        ours = {"freezing": True} if self.freezing else {}
        if self.threads_follow:
            ours["cpp.dynamic_threads"] = True
        if ours and self.backend == "inductor":
            # torch.compile takes mode or options, not both: spell the mode out as its options. The freezing option
            # alone does not freeze: the compile rung also sets inductor's global flag while dynamo traces.
            mode_options = torch._inductor.list_mode_options(self.mode, self.dynamic) if self.mode else {}
            kwargs["options"] = {**mode_options, **(self.options or {}), **ours}
        elif self.mode is not None:
            kwargs["mode"] = self.mode
        elif self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.mode in ("reduce-overhead", "max-autotune") or bool((self.options or {}).get("triton.cudagraphs"))

    def small_batch_kwargs(self) -> dict[str, Any]:
        """``kwargs()`` for the small batches' graph: inductor autotunes each matmul at the size it is traced at,
        between its C++ GEMM template and the library kernels (ATEN: oneDNN/MKL)."""
        kwargs = self.kwargs()
        kwargs["options"] = {**kwargs.get("options", {}), "max_autotune": True,
                             "max_autotune_gemm_backends": "CPP,ATEN"}
        return kwargs

    def with_shapes(self, dynamic: bool, freezing: bool, small_batch_tokens: int = 0) -> CompileSpec:
        """This compile as the shape policy and the CPU fast path run it."""
        freezing = freezing and self.backend == "inductor"
        return replace(self, dynamic=dynamic, freezing=freezing, one_graph=dynamic,
                       small_batch_tokens=small_batch_tokens if dynamic and freezing else 0)

    def safer(self) -> CompileSpec:
        """The fallback compile: inductor in default mode, no freezing or custom options, graph breaks allowed,
        torch's own size-1 specialization."""
        return CompileSpec(enabled=self.enabled, backend="inductor", dynamic=self.dynamic,
                           threads_follow=self.threads_follow)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mode": self.mode or "default",
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
            "options": dict(self.options) if self.options is not None else None,
            "freezing": self.freezing,
            "one_graph": self.one_graph,
            "small_batch_tokens": self.small_batch_tokens or None,
        }


@dataclass(frozen=True)
class HandlerSettings:
    """The ``pt2_handlers`` section."""

    task: str = "embeddings"
    model_dir: str = "model"
    max_length: int | None = None
    too_long: TooLong | None = None  # None: the task's own default (embeddings truncate, the others reject)
    # The precisions the model may serve in, fastest first; (AUTO,) resolves from the hardware at load.
    dtype: tuple[DType, ...] = (DType.AUTO,)
    int8_calibration: str | None = None  # a file of texts in the archive; None: the warmup batches
    ladder: tuple[RungName, ...] = (RungName.OPENVINO, RungName.COMPILE, RungName.SAFE_COMPILE, RungName.IPEX,
                                    RungName.EAGER)
    pick: Pick = Pick.FASTEST
    shapes: ShapePolicy = field(default_factory=ShapePolicy)
    quality_gate: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    freezing: bool = False  # faster forwards, slower warm restarts: the model YAML chooses
    attention: Attention = Attention.AUTO
    module_guards: ModuleGuards = ModuleGuards.AUTO
    threads: int | None = None  # None: the cores shared among minWorkers workers
    compile_cache: str | None = None  # None: TORCHINDUCTOR_CACHE_DIR, else torch's default
    compile_artifacts: bool = False  # the archive carries what a load on the packaging host compiled
    max_runtime_failures: int = 3
    max_inputs_per_request: int = 64
    batch_metrics_every_s: float = 1.0  # the per-batch gauges: means of each window this long; 0: every batch
    inputs: tuple[TensorSpec, ...] = ()  # the tensor task's (and a task of one's own) model inputs
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # a task of one's own reads them
    image: ImageSpec = field(default_factory=ImageSpec)  # image-classification's preprocessing and top-k


@dataclass(frozen=True)
class HandlerConfig:
    compile: CompileSpec = field(default_factory=CompileSpec)
    settings: HandlerSettings = field(default_factory=HandlerSettings)
    workers: int = 1  # TorchServe's minWorkers: how many workers share this host's cores
    startup_timeout: int = 120  # TorchServe's startupTimeout: seconds a worker has to load
    warnings: tuple[str, ...] = ()
    aot_compile: bool = False  # pt2.export.aot_compile: the archive carries AOTInductor packages (the aot rung)

    @property
    def served_compile(self) -> CompileSpec:
        """The requested compile with the shape policy's dynamism and the fast path's freezing."""
        return self.compile.with_shapes(self.settings.shapes.dynamic, self.settings.freezing,
                                        self.settings.shapes.small_batch_tokens)


def resolve_backend(name: str) -> str | Callable[..., Any]:
    """A registered backend name stays a string; ``module:function`` is imported and returned."""
    if ":" not in name:
        return name
    module_name, _, attr = name.partition(":")
    module = importlib.import_module(module_name)
    backend = getattr(module, attr)
    if not callable(backend):
        raise TypeError(f"{name} is not callable")
    return backend
