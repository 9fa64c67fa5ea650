"""Typed, validated configuration, read from the model YAML that TorchServe hands the worker.

Two sections matter here; every other top-level key (minWorkers, batchSize, ...) is TorchServe's own.

* ``pt2`` -- TorchServe's format for ``torch.compile`` options (current and legacy forms).
* ``pt2_handlers`` -- this package's settings: task, model directory, dtype, ladder, shapes, quality gate,
  threads, compile cache.

``load_config`` checks both against the schema (handlers/config/schema.py), never mutates its input, and raises
one ``ConfigError`` listing every problem, each naming its key, the value, what is allowed and the nearest valid
name. The values it returns are the frozen ones of handlers/config/values.py, importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from handlers.config.image import ImageSection
from handlers.config.problems import problems_of
from handlers.config.schema import ModelYaml, validate_model_yaml
from handlers.config.settings import SettingsSection, shape_policy
from handlers.config.shapes import ShapePolicy
from handlers.config.task_facts import TASK_FACTS
from handlers.config.values import (IPEX_BACKEND, OPENVINO_BACKEND, Attention, Choice, CompileSpec, DType,
                                    HandlerConfig, HandlerSettings, ModuleGuards, Pick, RungName, TooLong,
                                    resolve_backend)
from handlers.errors import ConfigError

__all__ = ["IPEX_BACKEND", "OPENVINO_BACKEND", "Attention", "Choice", "CompileSpec", "DType", "HandlerConfig",
           "HandlerSettings", "ModuleGuards", "Pick", "RungName", "TooLong", "load_config", "load_config_file",
           "resolve_backend"]


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
    try:
        parsed = validate_model_yaml(raw)
    except ValidationError as exc:
        found = problems_of(exc, raw)
        message = found[0] if len(found) == 1 else f"{len(found)} problems:" + "".join(f"\n  {line}" for line in found)
        raise ConfigError(message, found) from None
    return HandlerConfig(compile=_compile_spec(parsed),
                         settings=_settings(parsed.pt2_handlers, parsed.pt2.compile.dynamic),
                         workers=parsed.minWorkers, startup_timeout=parsed.startupTimeout,
                         warnings=pt2_warnings(raw.get("pt2")), aot_compile=parsed.pt2.export.aot_compile)


def _compile_spec(parsed: ModelYaml) -> CompileSpec:
    section = parsed.pt2.compile
    return CompileSpec(enabled=section.enable, backend=section.backend, mode=section.mode, dynamic=section.dynamic,
                       fullgraph=section.fullgraph,
                       options=MappingProxyType(dict(section.options)) if section.options is not None else None)


def _settings(section: SettingsSection, compile_dynamic: bool | None) -> HandlerSettings:
    return HandlerSettings(
        task=section.task, model_dir=section.model_dir, max_length=section.max_length, too_long=section.too_long,
        dtype=section.dtype, int8_calibration=section.int8_calibration, ladder=section.ladder, pick=section.pick,
        shapes=shape_policy(section.shapes, _default_shapes(section.task), compile_dynamic),
        quality_gate=section.quality_gate, freezing=section.freezing, attention=section.attention,
        module_guards=section.module_guards, threads=section.threads,
        compile_cache=section.compile_cache, compile_artifacts=section.compile_artifacts,
        max_runtime_failures=section.max_runtime_failures,
        max_inputs_per_request=section.max_inputs_per_request, batch_metrics_every_s=section.batch_metrics_every_s,
        inputs=tuple(item.spec() for item in section.inputs or ()),
        options=MappingProxyType(dict(section.options)),
        image=(section.image or ImageSection()).spec(),
    )


def _default_shapes(task: str) -> ShapePolicy:
    facts = TASK_FACTS.get(task)  # a task of one's own: the package's default buckets
    return facts.default_shapes if facts else ShapePolicy()


def pt2_warnings(value: Any) -> tuple[str, ...]:
    """What a valid ``pt2`` section is warned about: the deprecated forms, and compile left off by omission."""
    if isinstance(value, str):
        return (f"pt2: {value!r} is deprecated; write pt2: {{compile: {{enable: true, backend: {value}}}}}",)
    if not isinstance(value, Mapping):
        return ()
    if "compile" not in value and "export" in value:
        return ("pt2.compile is not set: where no AOT package fits the host, the ladder does not compile (openvino "
                "or eager serve); add pt2.compile for a compiled fallback",)
    if "compile" not in value:
        return ("pt2 with compile options at its top level is deprecated; move them under pt2.compile",)
    if not isinstance(value["compile"], Mapping) or value["compile"].get("enable") is None:
        return ("pt2.compile has no 'enable' key: compile stays off (set enable: true to turn it on)",)
    if value["compile"].get("backend") == OPENVINO_BACKEND:
        return (f"pt2.compile.backend: {OPENVINO_BACKEND} is served by the openvino rung (OpenVINO converts the "
                "exported module at load and the quality gate proves it before READY); dynamo's openvino backend is "
                "not used",)
    return ()
