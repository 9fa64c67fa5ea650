"""Pydantic's errors for a model YAML as one line per problem, in people's words and in the YAML's order: the path,
the value, what is allowed, the nearest valid name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from handlers.config.fields import Section, nearest
from handlers.config.pt2 import pt2_section_model
from handlers.config.schema import ModelYaml

# pydantic's own errors, for the checks its types make (ours come worded: handlers/config/fields.py)
TYPE_WORDS = {"bool_type": "bool", "int_type": "int", "string_type": "str", "float_type": "a number",
              "dict_type": "a mapping", "model_type": "a mapping", "list_type": "a list"}


def problems_of(error: ValidationError, raw: Mapping[str, Any]) -> list[str]:
    """One line per problem, in the YAML's order; the unknown keys of one mapping share a line."""
    found: list[tuple[tuple[Any, ...], str]] = []
    unknown: dict[tuple[Any, ...], list[str]] = {}  # mapping's location -> its unknown keys
    for detail in error.errors():
        where = detail["loc"]
        if detail["type"] == "extra_forbidden":
            unknown.setdefault(where[:-1], []).append(str(where[-1]))
        else:
            found.append((where, _worded(path_of(where), detail)))
    # where an unknown key sits, not its mapping: that is where the eye finds it
    found += [(where + (keys[0],), _unknown_keys(where, keys, raw)) for where, keys in unknown.items()]
    return [text for where, text in sorted(found, key=lambda problem: _position(problem[0], raw))]


def _position(where: tuple[Any, ...], raw: Any) -> tuple[int, ...]:
    """Where ``where`` is in the YAML, as the index of each key (or item) on the way to it."""
    position, node = [], raw
    for part in where:
        if isinstance(node, Mapping):
            keys = list(node)
            position.append(keys.index(part) if part in keys else len(keys))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            position.append(part)
            node = node[part]
        else:
            position.append(0)
    return tuple(position)


def path_of(where: tuple[Any, ...]) -> str:
    """``("pt2_handlers", "shapes", "seq_lengths", 1)`` -> ``pt2_handlers.shapes.seq_lengths[1]``."""
    path = ""
    for part in where:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or "the model YAML"


def _worded(path: str, detail: Any) -> str:
    kind, value = detail["type"], detail["input"]
    if kind == "config":
        text = detail["msg"]
    elif kind in TYPE_WORDS:
        text = f"must be {TYPE_WORDS[kind]}, got {type(value).__name__} {value!r}"
    elif kind == "greater_than" and detail["ctx"]["gt"] == 0:
        text = f"must be a positive integer, got {value!r}"
    elif kind == "greater_than_equal" and detail["ctx"]["ge"] == 0:
        text = f"must be 0 or more, got {value!r}"
    elif kind == "too_short":
        text = f"must be a non-empty list, got {value!r}"
    else:  # a check pydantic words itself
        text = f"{detail['msg']}, got {value!r}"
    # "must ..." and "is ..." read on from the path; anything else follows a colon
    return f"{path} {text}" if text.startswith(("must ", "is ")) else f"{path}: {text}"


def _unknown_keys(where: tuple[Any, ...], keys: list[str], raw: Mapping[str, Any]) -> str:
    model = _model_at(where, raw)
    hints = "".join(_nearest_key(key, model) for key in keys)
    allowed = ", ".join(sorted(model.model_fields))
    return f"{path_of(where)}: unknown key(s) {', '.join(keys)}{hints}; allowed: {allowed}"


def _model_at(where: tuple[Any, ...], raw: Mapping[str, Any]) -> type[BaseModel]:
    """The model that read the mapping at ``where``; under ``pt2``, the one its form chose."""
    model: Any = ModelYaml
    for part in where:
        model = pt2_section_model(raw.get("pt2")) if model is ModelYaml and part == "pt2" else \
            _section_in(model.model_fields[part].annotation)
    return model


def _section_in(annotation: Any) -> type[BaseModel] | None:
    """The section model in a field's annotation (``ShapesSection``, ``ShapesSection | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return next((section for section in map(_section_in, get_args(annotation)) if section is not None), None)


def _nearest_key(key: str, model: type[BaseModel]) -> str:
    """`` (did you mean X?)`` among the model's keys, and one level down (``shapes.batch_sizes``)."""
    names = {name: name for name in model.model_fields}
    for name, field in model.model_fields.items():
        nested = _section_in(field.annotation)
        if nested is not None:
            names.update({sub: f"{name}.{sub}" for sub in nested.model_fields if sub not in names})
    close = nearest(key, names)
    return f" (did you mean {names[close]}?)" if close else ""
