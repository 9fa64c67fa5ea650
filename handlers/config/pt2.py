"""``pt2``: TorchServe's compile section, in each of its forms (handlers/config/schema.py says how it is read)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from pydantic import ConfigDict, Field, StrictBool, StrictStr, ValidationInfo, WithJsonSchema, field_validator

from handlers.config.fields import Section, did_you_mean, nearest, problem, shown
from handlers.config.values import IPEX_BACKEND, OPENVINO_BACKEND, resolve_backend


class CompileSection(Section):
    """TorchServe's `pt2.compile`: the arguments of `torch.compile`."""

    enable: StrictBool = False
    """Compile at all. Left out, compile stays off, with a warning (TorchServe itself raises KeyError there)."""
    backend: StrictStr = Field("inductor", examples=["inductor", "eager", "aot_eager", "ipex", "openvino",
                                                     "my_module:my_backend"])
    """A name in `torch._dynamo.list_backends()`, `ipex` (the ipex profile), `openvino` (served by the openvino rung,
    not through dynamo: the compile rung is skipped, with the reason), or `module:function` to import your own, e.g.
    from a file packed at the archive root with `python -m handlers package --extra-file my_module.py`."""
    mode: StrictStr | None = Field(None, examples=["default", "reduce-overhead", "max-autotune",
                                                   "max-autotune-no-cudagraphs"])
    """An inductor mode (`torch._inductor.list_mode_options()`); inductor only, and not together with `options`."""
    dynamic: StrictBool | None = None
    """`true` compiles symbolic shapes, `false` static ones; left out, torch's automatic dynamic shapes. It implies
    `pt2_handlers.shapes.policy` when that is not given."""
    fullgraph: StrictBool = False
    """Fail the compile on any graph break instead of splitting the graph."""
    options: dict[str, Any] | None = None
    """Inductor options (`torch._inductor.list_options()`); inductor only, and not together with `mode`."""

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, name: str) -> str:
        if ":" in name:
            try:
                resolve_backend(name)
            except Exception as exc:  # an import error, a missing attribute: all are config errors here
                raise problem(f"cannot load custom backend {name!r}: {type(exc).__name__}: {exc}") from None
        elif name not in (IPEX_BACKEND, OPENVINO_BACKEND) and name not in torch._dynamo.list_backends(exclude_tags=()):
            # ipex registers only once imported; the compile rung probes it and says why not
            listed = torch._dynamo.list_backends()
            raise problem(f"{name!r} is not a registered torch.compile backend"
                          f"{did_you_mean(name, torch._dynamo.list_backends(exclude_tags=()))}; "
                          f"use one of: {', '.join(listed)}, or 'module:function' for your own")
        return name

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, mode: str, info: ValidationInfo) -> str:
        modes = list(torch._inductor.list_mode_options())
        if mode not in modes:
            raise problem(f"{mode!r} is not a torch.compile mode{did_you_mean(mode, modes)}; "
                          f"use one of: {', '.join(modes)}")
        _inductor_only(info)
        return mode

    @field_validator("options")
    @classmethod
    def _known_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        known = set(torch._inductor.list_options())
        unknown = sorted(str(key) for key in options if key not in known)
        if unknown:
            hints = "".join(did_you_mean(key, known) for key in unknown)
            raise problem(f"unknown inductor option(s) {', '.join(unknown)}{hints}")
        if info.data.get("mode") is not None:
            raise problem("set either mode or options, not both (torch.compile accepts only one)")
        _inductor_only(info)
        return options


def _inductor_only(info: ValidationInfo) -> None:
    backend = info.data.get("backend", "inductor")
    if backend != "inductor":
        raise problem(f"mode and options apply only to backend 'inductor', not {backend!r}")


class LegacyCompileSection(CompileSection):
    """Deprecated: the compile options at the top of `pt2` (TorchServe's older form); compile is on unless
    `enable: false`. Move them under `pt2.compile`."""

    model_config = ConfigDict(json_schema_extra={"deprecated": True})

    enable: StrictBool = True
    """Compile at all; in this older form, on unless `false`."""


class ExportSection(Section):
    """TorchServe's `pt2.export`: the model compiled ahead of time, when the archive is built."""

    aot_compile: StrictBool = False
    """Build AOTInductor packages into the archive (`python -m handlers package`): the task's module exported with
    `torch.export` (batch and sequence axes dynamic) and compiled for each float precision `dtype` allows on the
    packaging host, each proven against fp32 eager on the warmup batches before it is written, with a fingerprint
    (torch version, device, CPU instruction sets, precision, what the gate measured). The `aot` rung, first in the
    ladder, loads a package only where its fingerprint fits the worker's host, checked before any of its code is
    loaded; elsewhere, or if it fails its warmup or gate, the ladder compiles at load as without it, and describe
    says why. The eager weights stay in the archive for the gate and the fallback."""


class Pt2Section(Section):
    """TorchServe's compile section."""

    compile: CompileSection = Field(default_factory=CompileSection)
    """`torch.compile`'s arguments."""
    export: ExportSection = Field(default_factory=ExportSection)
    """Compiled ahead of time, when the archive is built: AOTInductor packages the `aot` rung serves."""


LegacyBackendName = Annotated[str, WithJsonSchema({
    "type": "string", "deprecated": True,
    "description": "Deprecated: a backend name alone, as `pt2: inductor`; write `pt2: {compile: {enable: true, "
                   "backend: inductor}}`."})]


def read_pt2(value: Any, _handler: Any) -> Pt2Section:
    """Any of TorchServe's pt2 forms, as the section it means (each form checked as strictly); an older form's
    options become its compile section."""
    if isinstance(value, str):
        return Pt2Section(compile=LegacyCompileSection.model_validate({"backend": value}))
    if not isinstance(value, Mapping):
        raise problem(f"must be a mapping or a backend name, got {shown(value)}")
    section = pt2_section_model(value).model_validate(value)
    return section if isinstance(section, Pt2Section) else Pt2Section(compile=section)


def pt2_section_model(value: Mapping[str, Any]) -> type[Section]:
    """The model a mapping under ``pt2`` is read with: the current form where it has ``compile`` or ``export``, or a
    key that misspells one (``compil`` is then an unknown key, not an older form's), else the older form."""
    current = ("compile", "export")
    return Pt2Section if any(key in current or nearest(key, current) for key in value) else LegacyCompileSection


def declared_dynamic(pt2: Any) -> bool | None:
    """``dynamic`` of any pt2 form, where it is a bool (whatever else in pt2 is wrong)."""
    section = pt2.get("compile") if isinstance(pt2, Mapping) and "compile" in pt2 else pt2
    dynamic = section.get("dynamic") if isinstance(section, Mapping) else None
    return dynamic if isinstance(dynamic, bool) else None
