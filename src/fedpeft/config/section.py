"""The base of every config section: unknown keys refused, numbers that are numbers.

Pydantic's lax mode reads ``true`` as 1 for an integer option and accepts ``inf`` / ``nan`` for a float
one; a config meant for people must not. Every section (built-in or a plugin's options) refuses a boolean
where the option takes no boolean, and a non-finite float anywhere.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def admits_bool(annotation: Any) -> bool:
    """Whether a value of type ``annotation`` may be a boolean (``bool`` or ``Any`` anywhere in it)."""
    if annotation is bool or annotation is Any or annotation is object:
        return True
    if isinstance(annotation, type):
        return False
    if isinstance(annotation, typing.ForwardRef | str):
        return True  # unresolved: leave it to pydantic
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(admits_bool(a) for a in typing.get_args(annotation)
               if a is not Ellipsis and not isinstance(a, typing.ForwardRef | types.NoneType))


def find_bool(value: Any) -> bool:
    """Whether ``value`` is a boolean or a list / tuple / dict value holding one."""
    if isinstance(value, bool):
        return True
    if isinstance(value, list | tuple):
        return any(find_bool(v) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, bool) or (isinstance(v, list | tuple) and find_bool(v)) for v in value.values())
    return False


class OptionValueError(ValueError):
    """A bad value of the option ``key`` of a section (the config loader names it as section.key)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class Section(BaseModel):
    """A config section: unknown keys are refused, assignments validated, non-finite floats refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            field = cls.model_fields.get(key) if isinstance(key, str) else None
            if field is None or not find_bool(value) or admits_bool(field.annotation) or _is_section(field.annotation):
                continue
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise OptionValueError(key, f"got the boolean {shown}, which this option does not take: write a "
                                        "number or a name (YAML reads true / false / yes / no / on / off as booleans)")
        return data


def _is_section(annotation: Any) -> bool:
    """A nested section (or a union of them): its own validators judge its values."""
    if isinstance(annotation, type):
        return issubclass(annotation, BaseModel)
    return any(_is_section(a) for a in typing.get_args(annotation) if a is not Ellipsis)
