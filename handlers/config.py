"""Typed, validated configuration, read from the model YAML that TorchServe hands the worker.

Two sections matter here; every other top-level key (minWorkers, batchSize, ...) is TorchServe's own.

* ``pt2`` -- TorchServe's format for ``torch.compile`` options (current and legacy forms).
* ``pt2_handlers`` -- this package's settings: task, model directory, dtype, ladder, warmup, parity.

``load_config`` never mutates its input and rejects anything it does not understand with one
``ConfigError`` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from handlers.errors import ConfigError

PT2_SECTION = "pt2"
SETTINGS_SECTION = "pt2_handlers"


class RungName(str, enum.Enum):
    """The optimization ladder's rungs, tried in the configured order."""

    COMPILE = "compile"  # exactly what pt2.compile asks for
    SAFE_COMPILE = "safe_compile"  # inductor, default mode: no CUDA graphs, no autotuning, no custom options
    IPEX = "ipex"  # intel_extension_for_pytorch.optimize, CPU only
    EAGER = "eager"  # the plain model; always last, always works


class DType(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted difference between an optimized rung and eager: |a-b| <= atol + rtol*|b|."""

    atol: float
    rtol: float


# Why these numbers: fp32 kernels reorder sums (~1e-6 here); half types keep 8-11 mantissa bits.
DEFAULT_TOLERANCE = MappingProxyType(
    {
        DType.FLOAT32: Tolerance(atol=1e-4, rtol=1e-3),
        DType.BFLOAT16: Tolerance(atol=5e-2, rtol=5e-2),
        DType.FLOAT16: Tolerance(atol=1e-2, rtol=1e-2),
    }
)


@dataclass(frozen=True)
class CompileSpec:
    """The ``torch.compile`` arguments of one rung. ``enabled`` False means: do not compile."""

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    options: Mapping[str, Any] | None = None

    def kwargs(self) -> dict[str, Any]:
        """Fresh keyword arguments for ``torch.compile`` (the backend resolved to a callable if custom)."""
        kwargs: dict[str, Any] = {
            "backend": resolve_backend(self.backend), "fullgraph": self.fullgraph, "dynamic": self.dynamic,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs

    def safer(self) -> CompileSpec:
        """The fallback compile: inductor in default mode, automatic dynamic shapes, graph breaks allowed."""
        return CompileSpec(enabled=self.enabled, backend="inductor")

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mode": self.mode or "default",
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
            "options": dict(self.options) if self.options is not None else None,
        }


@dataclass(frozen=True)
class WarmupSpec:
    """Input shapes run through every rung at load time: each batch size with each sequence length."""

    batch_sizes: tuple[int, ...] = (1, 2)
    seq_lengths: tuple[int, ...] = (16, 32)

    def shapes(self) -> list[tuple[int, int]]:
        return [(b, s) for b in self.batch_sizes for s in self.seq_lengths]


@dataclass(frozen=True)
class HandlerSettings:
    """The ``pt2_handlers`` section."""

    task: str = "embeddings"
    model_dir: str = "model"
    max_length: int | None = None
    dtype: DType = DType.FLOAT32
    ladder: tuple[RungName, ...] = (RungName.COMPILE, RungName.SAFE_COMPILE, RungName.IPEX, RungName.EAGER)
    warmup: WarmupSpec = field(default_factory=WarmupSpec)
    parity: Tolerance | None = None
    max_runtime_failures: int = 3
    max_inputs_per_request: int = 64

    @property
    def tolerance(self) -> Tolerance:
        return self.parity or DEFAULT_TOLERANCE[self.dtype]


@dataclass(frozen=True)
class HandlerConfig:
    compile: CompileSpec = field(default_factory=CompileSpec)
    settings: HandlerSettings = field(default_factory=HandlerSettings)
    warnings: tuple[str, ...] = ()


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
            allowed = ", ".join(e.value for e in enum_cls)
            raise ConfigError(f"{self.key(key)}: {value!r} is not allowed; use one of: {allowed}") from None

    def key(self, key: str) -> str:
        return f"{self._path}.{key}"

    def finish(self) -> None:
        unknown = sorted(str(k) for k in self._raw if k not in self._seen)
        if unknown:
            raise ConfigError(
                f"{self._path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(self._seen))}"
            )


def load_config(raw: Mapping[str, Any] | None) -> HandlerConfig:
    """Parse the model YAML (TorchServe's ``context.model_yaml_config``) without modifying it."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the model YAML must be a mapping, got {type(raw).__name__}")
    warnings: list[str] = []
    compile_spec = _parse_pt2(raw.get(PT2_SECTION), warnings)
    settings = _parse_settings(raw.get(SETTINGS_SECTION))
    return HandlerConfig(compile=compile_spec, settings=settings, warnings=tuple(warnings))


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
        raise ConfigError(f"{path}.mode: {spec.mode!r} is not a torch.compile mode; use one of: {', '.join(modes)}")
    if spec.options is not None:
        known = set(torch._inductor.list_options())
        unknown = sorted(str(k) for k in spec.options if k not in known)
        if unknown:
            raise ConfigError(f"{path}.options: unknown inductor option(s) {', '.join(unknown)}")
    return spec


def _check_backend(name: str, path: str) -> None:
    if ":" in name:
        try:
            resolve_backend(name)
        except Exception as exc:  # an import error, a missing attribute: all are config errors here
            raise ConfigError(f"{path}: cannot load custom backend {name!r}: {type(exc).__name__}: {exc}") from None
        return
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        allowed = ", ".join(torch._dynamo.list_backends())
        raise ConfigError(
            f"{path}: {name!r} is not a registered torch.compile backend; "
            f"use one of: {allowed}, or 'module:function' for your own"
        )


def _parse_settings(value: Any) -> HandlerSettings:
    if value is None:
        return HandlerSettings()
    section = _Section(value, SETTINGS_SECTION)
    defaults = HandlerSettings()
    settings = HandlerSettings(
        task=section.get("task", (str,), defaults.task),
        model_dir=section.get("model_dir", (str,), defaults.model_dir),
        max_length=_positive(section, "max_length", None),
        dtype=section.choice("dtype", DType, defaults.dtype),
        ladder=_parse_ladder(section, defaults.ladder),
        warmup=_parse_warmup(section),
        parity=_parse_parity(section),
        max_runtime_failures=_positive(section, "max_runtime_failures", defaults.max_runtime_failures),
        max_inputs_per_request=_positive(section, "max_inputs_per_request", defaults.max_inputs_per_request),
    )
    section.finish()
    from handlers.tasks import check_task  # the task registry is the one list of valid task names

    check_task(settings.task, f"{SETTINGS_SECTION}.task")
    return settings


def _positive(section: _Section, key: str, default: int | None) -> int | None:
    value = section.get(key, (int,), default)
    if value is not None and value <= 0:
        raise ConfigError(f"{section.key(key)} must be a positive integer, got {value!r}")
    return value


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
            raise ConfigError(f"{section.key('ladder')}: unknown rung {name!r}; use some of: {allowed}") from None
    if len(set(rungs)) != len(rungs):
        raise ConfigError(f"{section.key('ladder')}: each rung may appear once, got {names!r}")
    if RungName.EAGER in rungs[:-1]:
        raise ConfigError(f"{section.key('ladder')}: eager is the last resort and must come last, got {names!r}")
    if RungName.EAGER not in rungs:
        rungs.append(RungName.EAGER)  # documented: eager always ends the ladder
    return tuple(rungs)


def _parse_warmup(section: _Section) -> WarmupSpec:
    raw = section.get("warmup", (Mapping,))
    if raw is None:
        return WarmupSpec()
    warmup = _Section(raw, section.key("warmup"))
    defaults = WarmupSpec()
    spec = WarmupSpec(
        batch_sizes=warmup.positive_ints("batch_sizes", defaults.batch_sizes),
        seq_lengths=warmup.positive_ints("seq_lengths", defaults.seq_lengths),
    )
    warmup.finish()
    return spec


def _parse_parity(section: _Section) -> Tolerance | None:
    raw = section.get("parity", (Mapping,))
    if raw is None:
        return None
    parity = _Section(raw, section.key("parity"))
    values = {}
    for key in ("atol", "rtol"):
        value = parity.get(key, (float, int))
        if value is None or value < 0:
            raise ConfigError(f"{parity.key(key)} must be a number >= 0, got {value!r}")
        values[key] = float(value)
    parity.finish()
    return Tolerance(**values)
