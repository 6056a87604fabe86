"""The config's registered choices: a section whose value is one of the options models registered for it.

``peft`` (by ``method``), ``algorithm`` (by ``name``) and ``algorithm.robust`` (by ``rule``) take exactly the
options models registered at the moment a config is validated (fedpeft's built-ins first), told apart by their
tag. Registering a choice changes no class: the union type and its validator are built on request, once per set
of models. A field declares that it takes registered choices with :func:`registered_field`.
"""

from __future__ import annotations

import functools
import operator
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field, PlainValidator, SerializeAsAny, TypeAdapter

from fedpeft.plugins import load_built_ins
from fedpeft.registry import ALGORITHMS, PEFT_METHODS, ROBUST_RULES, Registry

# the registry of each kind of choice and the tag its options models are told apart by
SECTIONS: dict[str, tuple[Registry[Any], str]] = {
    "peft": (PEFT_METHODS, "method"),
    "algorithm": (ALGORITHMS, "name"),
    "robust": (ROBUST_RULES, "rule"),
}


def _choice_union(models: Any, tag: str) -> Any:
    """The config type of a section with registered choices: their options models, told apart by ``tag``, in
    the alphabetical order of their names (which is how errors list the choices)."""
    models = sorted(models, key=lambda model: model.model_fields[tag].default)
    if len(models) == 1:
        return models[0]
    return Annotated[functools.reduce(operator.or_, models), Field(discriminator=tag)]  # A | B | ...


def registered(section: str) -> tuple[str, frozenset[type[BaseModel]]]:
    """The tag of the choices of ``section`` (a key of :data:`SECTIONS`) and the options models registered for
    it now (fedpeft's built-ins registered first; a one-line error if none is)."""
    load_built_ins()
    registry, tag = SECTIONS[section]
    models = frozenset(entry.options for entry in registry.values())
    if not models:
        raise ValueError(f"{registry.key}: no {registry.kind} is registered (fedpeft's built-ins did not register: "
                         "reinstall fedpeft with bash scripts/install.sh)")
    return tag, models


@functools.lru_cache(maxsize=16)
def _choices(tag: str, models: frozenset[type[BaseModel]]) -> tuple[Any, TypeAdapter[Any]]:
    """The union type of ``models`` told apart by ``tag`` and its validator (built once per set of models)."""
    union = _choice_union(models, tag)
    return union, TypeAdapter(union)


def section_choices(section: str) -> Any:
    """The type of the choices of ``section``: the options models registered for it now, built on request."""
    return _choices(*registered(section))[0]


def validate_choice(section: str, value: Any) -> Any:
    """``value`` validated by the options model registered under its tag (errors keep the nested location, e.g.
    ``peft.lora.r``, and list the registered choices)."""
    return _choices(*registered(section))[1].validate_python(value)


@dataclass(frozen=True)
class RegisteredChoices:
    """Field metadata: the field takes one of the options models registered for ``section``."""

    section: str


def registered_field(section: str, base: type[BaseModel]) -> Any:
    """The type of a field that takes one of the options models registered for ``section`` (all subclasses of
    ``base``): validated by the one its tag names, dumped with that model's fields."""
    serialized: Any = SerializeAsAny[base]  # type: ignore[misc, valid-type]
    return Annotated[serialized, RegisteredChoices(section), PlainValidator(functools.partial(validate_choice, section))]


def registered_section(annotation: Any) -> str | None:
    """The section whose registered choices a field annotation takes (through ``| None`` too), or None."""
    if typing.get_origin(annotation) is Annotated:
        return next((m.section for m in typing.get_args(annotation)[1:] if isinstance(m, RegisteredChoices)), None)
    return next((s for a in typing.get_args(annotation) if (s := registered_section(a)) is not None), None)
