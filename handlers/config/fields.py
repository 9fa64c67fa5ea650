"""The building blocks of the config schema: a YAML section as a pydantic model, and problems worded for people.

A message leaves out its path, which ``handlers.config`` puts in front: one starting with "must " or "is " reads on
from it ("pt2_handlers.threads must be ..."), any other follows a colon.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, StrictFloat, StrictInt, ValidationError,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError


def nearest(word: Any, choices: Any) -> str | None:
    """The closest of ``choices`` to a misspelt ``word``, if any is close."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: Any, choices: Any) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a misspelt ``word``, else ``""``."""
    close = nearest(word, choices)
    return f" (did you mean {close}?)" if close else ""


def shown(value: Any) -> str:
    """A value as an error message shows it: its YAML type and its repr."""
    return f"{type(value).__name__} {value!r}"


def problem(message: str) -> PydanticCustomError:
    # Passed as context, not as the template: braces in a user's value must not be read as placeholders.
    return PydanticCustomError("config", "{message}", {"message": message})


def problems(found: list[tuple[tuple[str | int, ...], str, Any]]) -> ValidationError:
    """Several problems at once under the field being validated: (where under it, message, value) each."""
    return ValidationError.from_exception_data("config", [
        InitErrorDetails(type=problem(message), loc=where, input=value) for where, message, value in found])


def choose(enum_cls: type, value: Any, hint_words: Mapping[str, str] = MappingProxyType({})) -> Any:
    """``enum_cls(value)``, or a problem listing the allowed values and the nearest one."""
    if isinstance(value, enum_cls):
        return value
    if not isinstance(value, str):
        raise problem(f"must be str, got {shown(value)}")
    try:
        return enum_cls(value)
    except ValueError:
        allowed = [member.value for member in enum_cls]
        hint = f" (did you mean {hint_words[value]}?)" if value in hint_words else did_you_mean(value, allowed)
        raise problem(f"{value!r} is not allowed{hint}; use one of: {', '.join(allowed)}") from None


def one_of(enum_cls: type) -> Any:
    """The annotation of a field holding one of ``enum_cls``'s values."""
    return Annotated[enum_cls, PlainValidator(lambda value: choose(enum_cls, value), json_schema_input_type=enum_cls)]


PositiveInt = Annotated[StrictInt, Field(gt=0)]
PositiveInts = Annotated[list[PositiveInt], Field(min_length=1)]
Seconds = Annotated[StrictFloat, Field(ge=0)]  # an int is read as a float; a bool or a string is refused


class Section(BaseModel):
    """A mapping of the YAML: unknown keys are errors, a key left empty means its default, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_default(cls, data: Any) -> Any:
        """A new dict without the keys left empty (``key:`` in YAML is null): never the caller's mapping."""
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, Mapping) else data
