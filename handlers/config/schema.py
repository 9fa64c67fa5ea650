"""The model YAML as one pydantic model, ``ModelYaml``: the one statement of the keys, types, defaults, allowed
values and rules of its two sections, ``pt2`` (handlers/config/pt2.py) and ``pt2_handlers`` (settings.py).

``handlers.config.load_config`` validates with ``validate_model_yaml`` and words pydantic's errors; ``json_schema``
is what ``scripts/gen_schema.py`` ships as schema/model-config.schema.json and renders as the configuration
reference.

Every check sits on the field it is about, so one run reports every problem: a field is checked even when its
neighbours are wrong. A check that needs another field reads it from ``info.data`` (earlier fields that passed),
and is skipped when that field is itself wrong, which is reported instead; ``pt2_handlers`` is told pt2's
``dynamic`` through the validation context.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, WrapValidator, field_validator

from handlers.config.fields import PositiveInt, Section, problem
from handlers.config.pt2 import (LegacyBackendName, LegacyCompileSection, Pt2Section, declared_dynamic,
                                 read_pt2)
from handlers.config.settings import SettingsSection, read_settings


class ModelYaml(Section):
    """The model YAML TorchServe hands each worker (`torch-model-archiver --config-file`). Its other top-level keys
    (`maxWorkers`, `batchSize`, `maxBatchDelay`, `responseTimeout`, `startupTimeout`, ...) are TorchServe's own."""

    model_config = ConfigDict(extra="allow", title="pt2-handlers model YAML")  # TorchServe's keys pass

    pt2: Annotated[Pt2Section, WrapValidator(read_pt2, json_schema_input_type=(
        Pt2Section | LegacyCompileSection | LegacyBackendName))] = Field(default_factory=Pt2Section)
    """TorchServe's compile section: `pt2: {compile: {...}, export: {aot_compile: true}}`. The older forms, a backend
    name alone or the compile options at the top of `pt2`, are still read (checked as strictly) with a deprecation
    warning."""
    pt2_handlers: Annotated[SettingsSection, WrapValidator(read_settings, json_schema_input_type=SettingsSection)] = \
        Field(default_factory=SettingsSection)
    """This package's settings."""
    minWorkers: PositiveInt = 1  # TorchServe's spelling
    """TorchServe's worker count. With `threads: auto` the workers on the same cores load in turn, whatever their
    model, each on every core, then share the cores forward by forward; one that waited half of `startupTimeout` for
    the others' loads loads beside them, on the cores divided by `minWorkers`."""
    startupTimeout: PositiveInt = 120  # TorchServe's default
    """TorchServe's limit, in seconds, for a worker to load. A worker that finds another worker loading on the same
    cores (of any model) waits for it at most half of this, then loads beside it."""
    batchSize: PositiveInt = 1
    """TorchServe's server-side batching: up to this many requests per forward."""
    maxBatchDelay: Annotated[StrictInt, Field(ge=0)] = 100
    """TorchServe's wait, in ms, for a batch to fill (its default: 100). With `batchSize` above 1, 0 is refused:
    TorchServe 0.12 reads it as unset and holds each lone request for its default 100 ms (measured: p50 119 ms
    against 10.6 with 1)."""

    asyncCommunication: StrictBool = Field(False, json_schema_extra={"const": False})  # editors flag true
    """TorchServe's asynchronous worker, which awaits each request's answer from the handler as it comes. Not
    supported: pt2-handlers answers synchronously, in the batches TorchServe forms (`batchSize`, `maxBatchDelay`).
    Tried as a worker batching itself, it served lone requests at 50-77 % of the shipped rate (docs/performance.md)."""

    @field_validator("asyncCommunication")
    @classmethod
    def _synchronous_worker(cls, value: bool) -> bool:
        if value:
            raise problem("is true, which has TorchServe 0.12 await each request's answer from the handler; "
                          "pt2-handlers answers synchronously, in the batches TorchServe forms (batchSize, "
                          "maxBatchDelay): remove asyncCommunication")
        return value

    @field_validator("maxBatchDelay")
    @classmethod
    def _zero_reads_as_unset(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and info.data.get("batchSize", 1) > 1:
            raise problem("is 0, which TorchServe 0.12 reads as unset: it would hold each lone request for its "
                          "default 100 ms, waiting for a batch to fill; use 1, or batchSize: 1 for no batching")
        return value


def validate_model_yaml(raw: Mapping[str, Any]) -> ModelYaml:
    """The model YAML validated; a ValidationError holding every problem. ``pt2_handlers.shapes`` is checked against
    pt2's ``dynamic`` (which implies or contradicts the policy) whenever that is a bool, even if the rest of pt2 is
    wrong: one run, every problem."""
    return ModelYaml.model_validate(raw, context={"compile_dynamic": declared_dynamic(raw.get("pt2"))})


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the model YAML, as shipped in schema/model-config.schema.json: independent of torch's
    version (backends and modes are examples there, checked at load)."""
    schema = ModelYaml.model_json_schema()
    _tidy(schema)
    # maxBatchDelay's rule, as ModelYaml checks it: 0 is refused where requests are batched
    schema.setdefault("allOf", []).append({
        "if": {"properties": {"batchSize": {"minimum": 2}}, "required": ["batchSize"]},
        "then": {"properties": {"maxBatchDelay": {"minimum": 1}}}})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def _tidy(node: Any) -> None:
    """Drop the titles pydantic gives each property (its name respelt, "Max Length": noise in an editor's hover),
    and unwrap descriptions (docstrings keep their line breaks)."""
    if isinstance(node, dict):
        for prop in node.get("properties", {}).values():
            prop.pop("title", None)
        if isinstance(node.get("description"), str):
            node["description"] = " ".join(node["description"].split())
        children = node.values()
    else:
        children = node if isinstance(node, list) else ()
    for child in children:
        _tidy(child)
