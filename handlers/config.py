"""Typed, validated configuration, read from the model YAML that TorchServe hands the worker.

Two sections matter here; every other top-level key (minWorkers, batchSize, ...) is TorchServe's own.

* ``pt2`` -- TorchServe's format for ``torch.compile`` options (current and legacy forms).
* ``pt2_handlers`` -- this package's settings: task, model directory, dtype, ladder, shapes, quality gate,
  threads, compile cache.

``load_config`` never mutates its input and rejects anything it does not understand with one
``ConfigError`` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import enum
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from handlers.errors import ConfigError
from handlers.ipex import IPEX_BACKEND
from handlers.shapes import AfterReady, PolicyKind, ShapePolicy

PT2_SECTION = "pt2"
SETTINGS_SECTION = "pt2_handlers"


class RungName(str, enum.Enum):
    """The optimization ladder's rungs, tried in the configured order."""

    COMPILE = "compile"  # exactly what pt2.compile asks for
    SAFE_COMPILE = "safe_compile"  # inductor, default mode: no CUDA graphs, no autotuning, no custom options
    IPEX = "ipex"  # intel_extension_for_pytorch.optimize, CPU only
    EAGER = "eager"  # the plain model; always last, always works


class DType(str, enum.Enum):
    AUTO = "auto"  # resolved at load from the hardware (handlers.hardware.resolve_dtype)
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"  # opt-in only (never from auto): int8 linear layers (torchao), the rest in float32

    @property
    def torch(self) -> torch.dtype:
        """The floating dtype the module's parameters and activations are kept in."""
        return torch.float32 if self is DType.INT8 else getattr(torch, self.value)


class TooLong(str, enum.Enum):
    """What a text longer than the model reads (``max_length`` tokens) gets."""

    REJECT = "reject"  # a 400 naming the text and its length: the client decides what to cut
    TRUNCATE = "truncate"  # the first max_length tokens are read, the rest ignored


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

    def kwargs(self) -> dict[str, Any]:
        """Fresh keyword arguments for ``torch.compile`` (the backend resolved to a callable if custom)."""
        kwargs: dict[str, Any] = {
            "backend": resolve_backend(self.backend), "fullgraph": self.fullgraph, "dynamic": self.dynamic,
        }
        if self.freezing and self.backend == "inductor":
            # torch.compile takes mode or options, not both: spell the mode out as its options.
            mode_options = torch._inductor.list_mode_options(self.mode, self.dynamic) if self.mode else {}
            kwargs["options"] = {**mode_options, **(self.options or {}), "freezing": True}
        elif self.mode is not None:
            kwargs["mode"] = self.mode
        elif self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.mode in ("reduce-overhead", "max-autotune") or bool((self.options or {}).get("triton.cudagraphs"))

    def with_shapes(self, dynamic: bool, freezing: bool) -> CompileSpec:
        """This compile as the shape policy and the CPU fast path run it."""
        return replace(self, dynamic=dynamic, freezing=freezing and self.backend == "inductor", one_graph=dynamic)

    def safer(self) -> CompileSpec:
        """The fallback compile: inductor in default mode, no freezing or custom options, graph breaks allowed,
        torch's own size-1 specialization."""
        return CompileSpec(enabled=self.enabled, backend="inductor", dynamic=self.dynamic)

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mode": self.mode or "default",
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
            "options": dict(self.options) if self.options is not None else None,
            "freezing": self.freezing,
            "one_graph": self.one_graph,
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
    ladder: tuple[RungName, ...] = (RungName.COMPILE, RungName.SAFE_COMPILE, RungName.IPEX, RungName.EAGER)
    shapes: ShapePolicy = field(default_factory=ShapePolicy)
    quality_gate: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    freezing: bool = False  # measured: no gain with bf16 on an AVX512-BF16 CPU, and slower warm restarts
    threads: int | None = None  # None: the cores shared among minWorkers workers
    compile_cache: str | None = None  # None: TORCHINDUCTOR_CACHE_DIR, else torch's default
    max_runtime_failures: int = 3
    max_inputs_per_request: int = 64


@dataclass(frozen=True)
class HandlerConfig:
    compile: CompileSpec = field(default_factory=CompileSpec)
    settings: HandlerSettings = field(default_factory=HandlerSettings)
    workers: int = 1  # TorchServe's minWorkers: how many workers share this host's cores
    warnings: tuple[str, ...] = ()

    @property
    def served_compile(self) -> CompileSpec:
        """The requested compile with the shape policy's dynamism and the fast path's freezing."""
        return self.compile.with_shapes(self.settings.shapes.dynamic, self.settings.freezing)


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


class _Section:
    """Reads one YAML mapping, checking types and remembering which keys were used."""

    def __init__(self, raw: Any, path: str):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {type(raw).__name__} {raw!r}")
        self._raw = raw
        self._path = path
        self._seen: set[str] = set()

    @property
    def path(self) -> str:
        return self._path

    def get(self, key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
        self._seen.add(key)
        if key not in self._raw or self._raw[key] is None:
            return default
        value = self._raw[key]
        # bool is an int in Python; an int field must not accept `true`.
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            allowed = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.key(key)} must be {allowed}, got {type(value).__name__} {value!r}")
        return value

    def positive_ints(self, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        values = self.get(key, (list,), list(default))
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ConfigError(f"{self.key(key)} must be a non-empty list of positive integers, got {values!r}")
        return tuple(values)

    def choice(self, key: str, enum_cls: type[enum.Enum], default: Any) -> Any:
        value = self.get(key, (str,))
        if value is None:
            return default
        try:
            return enum_cls(value)
        except ValueError:
            allowed = [e.value for e in enum_cls]
            raise ConfigError(f"{self.key(key)}: {value!r} is not allowed{did_you_mean(value, allowed)}; "
                              f"use one of: {', '.join(allowed)}") from None

    def key(self, key: str) -> str:
        return f"{self._path}.{key}"

    def finish(self) -> None:
        unknown = sorted(str(k) for k in self._raw if k not in self._seen)
        if unknown:
            hints = "".join(did_you_mean(key, self._seen) for key in unknown)
            raise ConfigError(
                f"{self._path}: unknown key(s) {', '.join(unknown)}{hints}; allowed: {', '.join(sorted(self._seen))}"
            )


def did_you_mean(word: str, choices: Any) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a misspelt ``word``, else ``""``."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def load_config_file(path: Path) -> HandlerConfig:
    """``load_config`` of a model YAML file; a ConfigError also for a file that is missing or not YAML."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return load_config(raw)


def load_config(raw: Mapping[str, Any] | None) -> HandlerConfig:
    """Parse the model YAML (TorchServe's ``context.model_yaml_config``) without modifying it."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the model YAML must be a mapping, got {type(raw).__name__}")
    warnings: list[str] = []
    compile_spec = _parse_pt2(raw.get(PT2_SECTION), warnings)
    settings = _parse_settings(raw.get(SETTINGS_SECTION), compile_spec)
    workers = raw.get("minWorkers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"minWorkers must be a positive integer, got {workers!r}")
    return HandlerConfig(compile=compile_spec, settings=settings, workers=workers, warnings=tuple(warnings))


def _parse_pt2(value: Any, warnings: list[str]) -> CompileSpec:
    if value is None:
        return CompileSpec()
    if isinstance(value, str):
        warnings.append(
            f"pt2: {value!r} is deprecated; write pt2: {{compile: {{enable: true, backend: {value}}}}}"
        )
        return _validated(CompileSpec(enabled=True, backend=value), PT2_SECTION)
    if not isinstance(value, Mapping):
        raise ConfigError(f"pt2 must be a mapping or a backend name, got {type(value).__name__} {value!r}")
    if "export" in value:
        raise ConfigError("pt2.export (AOT-compiled .so models) is not supported by pt2-handlers; use pt2.compile")
    if "compile" in value:
        pt2 = _Section(value, PT2_SECTION)
        spec = _parse_compile(_Section(pt2.get("compile", (Mapping,), {}), "pt2.compile"), enabled_default=False)
        pt2.finish()
        if not spec.enabled and "enable" not in value["compile"]:
            warnings.append("pt2.compile has no 'enable' key: compile stays off (set enable: true to turn it on)")
        return spec
    warnings.append("pt2 with compile options at its top level is deprecated; move them under pt2.compile")
    return _parse_compile(_Section(value, PT2_SECTION), enabled_default=True)


def _parse_compile(section: _Section, enabled_default: bool) -> CompileSpec:
    options = section.get("options", (Mapping,))
    spec = CompileSpec(
        enabled=section.get("enable", (bool,), enabled_default),
        backend=section.get("backend", (str,), "inductor"),
        mode=section.get("mode", (str,)),
        dynamic=section.get("dynamic", (bool,)),
        fullgraph=section.get("fullgraph", (bool,), False),
        options=MappingProxyType(dict(options)) if options is not None else None,
    )
    section.finish()
    return _validated(spec, section.path)


def _validated(spec: CompileSpec, path: str) -> CompileSpec:
    _check_backend(spec.backend, f"{path}.backend")
    if spec.mode is not None and spec.options is not None:
        raise ConfigError(f"{path}: set either mode or options, not both (torch.compile accepts only one)")
    if (spec.mode is not None or spec.options is not None) and spec.backend != "inductor":
        raise ConfigError(f"{path}: mode and options apply only to backend 'inductor', not {spec.backend!r}")
    modes = list(torch._inductor.list_mode_options())
    if spec.mode is not None and spec.mode not in modes:
        raise ConfigError(f"{path}.mode: {spec.mode!r} is not a torch.compile mode{did_you_mean(spec.mode, modes)}; "
                          f"use one of: {', '.join(modes)}")
    if spec.options is not None:
        known = set(torch._inductor.list_options())
        unknown = sorted(str(k) for k in spec.options if k not in known)
        if unknown:
            hints = "".join(did_you_mean(key, known) for key in unknown)
            raise ConfigError(f"{path}.options: unknown inductor option(s) {', '.join(unknown)}{hints}")
    return spec


def _check_backend(name: str, path: str) -> None:
    if ":" in name:
        try:
            resolve_backend(name)
        except Exception as exc:  # an import error, a missing attribute: all are config errors here
            raise ConfigError(f"{path}: cannot load custom backend {name!r}: {type(exc).__name__}: {exc}") from None
        return
    if name == IPEX_BACKEND:
        return  # registered only once IPEX is imported; the compile rung probes it and says why not
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        allowed = ", ".join(torch._dynamo.list_backends())
        raise ConfigError(
            f"{path}: {name!r} is not a registered torch.compile backend; "
            f"use one of: {allowed}, or 'module:function' for your own"
        )


def _parse_settings(value: Any, compile_spec: CompileSpec) -> HandlerSettings:
    if value is None:
        value = {}
    section = _Section(value, SETTINGS_SECTION)
    defaults = HandlerSettings()
    from handlers.tasks import check_task  # the task registry is the one list of valid task names

    task = section.get("task", (str,), defaults.task)
    task_class = check_task(task, f"{SETTINGS_SECTION}.task")
    settings = HandlerSettings(
        task=task,
        model_dir=section.get("model_dir", (str,), defaults.model_dir),
        max_length=_positive(section, "max_length", None),
        too_long=section.choice("too_long", TooLong, None),
        dtype=_parse_dtype(section, defaults.dtype),
        ladder=_parse_ladder(section, defaults.ladder),
        shapes=_parse_shapes(section, compile_spec, task_class),
        quality_gate=_parse_gate(section, task_class),
        freezing=section.get("freezing", (bool,), defaults.freezing),
        threads=_positive(section, "threads", None) if section.get("threads", (str, int)) != "auto" else None,
        compile_cache=section.get("compile_cache", (str,)),
        max_runtime_failures=_positive(section, "max_runtime_failures", defaults.max_runtime_failures),
        max_inputs_per_request=_positive(section, "max_inputs_per_request", defaults.max_inputs_per_request),
    )
    section.finish()
    if task_class.float32_only and settings.dtype not in ((DType.AUTO,), (DType.FLOAT32,)):
        raise ConfigError(f"{section.key('dtype')}: {task} serves float32 ({task_class.float32_only}); "
                          f"use auto or float32, got {', '.join(d.value for d in settings.dtype)}")
    if task_class.static_shapes_only and settings.shapes.dynamic:
        raise ConfigError(f"{section.key('shapes')}: {task} compiles static shapes only "
                          f"({task_class.static_shapes_only}); use policy: buckets and leave pt2.compile.dynamic unset")
    return settings


def _positive(section: _Section, key: str, default: int | None) -> int | None:
    value = section.get(key, (int,), default)
    if value is not None and value <= 0:
        raise ConfigError(f"{section.key(key)} must be a positive integer, got {value!r}")
    return value


def _parse_dtype(section: _Section, default: tuple[DType, ...]) -> tuple[DType, ...]:
    """``dtype``: one precision, ``auto``, or a list of precisions to try in order (fastest first)."""
    raw = section.get("dtype", (str, list))
    if raw is None:
        return default
    if isinstance(raw, str):
        return (section.choice("dtype", DType, default[0]),)
    allowed = [d.value for d in DType if d is not DType.AUTO]
    precisions = []
    for name in raw:
        if name not in allowed:
            raise ConfigError(f"{section.key('dtype')}: {name!r} is not a precision{did_you_mean(str(name), allowed)}; "
                              f"a list takes some of: {', '.join(allowed)} (auto stands alone)")
        precisions.append(DType(name))
    if not precisions or len(set(precisions)) != len(precisions):
        raise ConfigError(f"{section.key('dtype')}: a list names each precision once, at least one, got {raw!r}")
    return tuple(precisions)


def _parse_ladder(section: _Section, default: tuple[RungName, ...]) -> tuple[RungName, ...]:
    names = section.get("ladder", (list,))
    if names is None:
        return default
    allowed = ", ".join(r.value for r in RungName)
    rungs = []
    for name in names:
        try:
            rungs.append(RungName(name))
        except ValueError:
            hint = did_you_mean(str(name), [r.value for r in RungName])
            raise ConfigError(f"{section.key('ladder')}: unknown rung {name!r}{hint}; use some of: {allowed}") from None
    if len(set(rungs)) != len(rungs):
        raise ConfigError(f"{section.key('ladder')}: each rung may appear once, got {names!r}")
    if RungName.EAGER in rungs[:-1]:
        raise ConfigError(f"{section.key('ladder')}: eager is the last resort and must come last, got {names!r}")
    if RungName.EAGER not in rungs:
        rungs.append(RungName.EAGER)  # documented: eager always ends the ladder
    return tuple(rungs)


def _parse_shapes(section: _Section, compile_spec: CompileSpec, task_class: Any) -> ShapePolicy:
    """``shapes``; without a ``policy``, ``pt2.compile.dynamic: true`` means dynamic, anything else buckets.
    Buckets not configured are the task's defaults."""
    shapes = _Section(section.get("shapes", (Mapping,), {}), section.key("shapes"))
    implied = PolicyKind.DYNAMIC if compile_spec.dynamic else PolicyKind.BUCKETS
    defaults = task_class.default_shapes
    policy = ShapePolicy(
        kind=shapes.choice("policy", PolicyKind, implied),
        batch_sizes=shapes.positive_ints("batch_sizes", defaults.batch_sizes),
        seq_lengths=shapes.positive_ints("seq_lengths", defaults.seq_lengths),
        after_ready=shapes.choice("after_ready", AfterReady, defaults.after_ready),
        seq_multiple=_positive(shapes, "seq_multiple", None),
    )
    shapes.finish()
    if compile_spec.dynamic is not None and compile_spec.dynamic != policy.dynamic:
        raise ConfigError(
            f"pt2.compile.dynamic: {str(compile_spec.dynamic).lower()} contradicts {shapes.path}.policy: "
            f"{policy.kind.value}; drop one of them (buckets compile static shapes, dynamic compiles symbolic ones)"
        )
    if policy.kind is PolicyKind.DYNAMIC and (1 not in policy.batch_sizes or policy.max_batch < 2):
        raise ConfigError(
            f"{shapes.key('batch_sizes')}: the dynamic policy warms batch size 1 and one >= 2 "
            f"(torch specializes size 1), got {list(policy.batch_sizes)}"
        )
    return policy


def _parse_gate(section: _Section, task_class: Any) -> Mapping[str, float]:
    """``quality_gate``: the task's own thresholds (e.g. ``min_cosine`` for embeddings), checked by the task."""
    raw = section.get("quality_gate", (Mapping,), {})
    gate = _Section(raw, section.key("quality_gate"))
    values = {}
    for key in task_class.gate_keys:
        value = gate.get(key, (float, int))
        if value is not None:
            values[key] = float(value)
    gate.finish()
    task_class.quality_gate(DType.FLOAT32, values)  # raises ConfigError for values out of range
    return MappingProxyType(values)
