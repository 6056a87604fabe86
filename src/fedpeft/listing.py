"""The registered methods (and robust rules) as rows: what ``fedpeft methods`` prints and what the docs' method tables are built
from (``docs/hooks.py``), so that a method registered anywhere (built-in or plugin) is listed everywhere.
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from fedpeft.plugins import load_built_ins
from fedpeft.registry import ALGORITHMS, PEFT_METHODS, ROBUST_RULES, Registry

Kind = Literal["peft", "algorithm", "robust"]
KINDS: tuple[Kind, ...] = ("peft", "algorithm", "robust")
# a kind's registry; its key is the config key that names a method (peft.method, algorithm.name,
# algorithm.robust.rule)
REGISTRIES: dict[Kind, Registry[Any]] = {"peft": PEFT_METHODS, "algorithm": ALGORITHMS, "robust": ROBUST_RULES}


@dataclass(frozen=True)
class MethodRow:
    """One registered method: its kind and name, what it is (one line), its options model and the
    package or module it lives in."""

    kind: Kind
    name: str
    summary: str
    options: str  # "package.module.OptionsClass"
    where: str  # the method's package (built-ins: fedpeft/algorithms/<name>/ or fedpeft/tuners/<name>/) or module
    options_fields: tuple[str, ...]



def _home(options: type[BaseModel]) -> str:
    """The package a method's options live in: ``pkg`` for ``pkg.options``, else the options' own module."""
    module = options.__module__
    return module.rsplit(".", 1)[0] if module.endswith(".options") else module


def _first_line(text: str | None) -> str:
    """The first paragraph of a docstring, without its Sphinx cross-references."""
    lines = [line.strip() for line in (text or "").strip().splitlines()]
    paragraph = " ".join(itertools.takewhile(bool, lines))
    paragraph = re.sub(r"\s*\(:\w+:`[^`]*`\)", "", paragraph)  # "(:mod:`.apply`)"
    paragraph = re.sub(r":\w+:`~?([^`]*)`", r"\1", paragraph).replace("``", "`")
    return paragraph


def _summary(options: type[BaseModel]) -> str:
    """The options class's own docstring (first paragraph), else its package's or module's."""
    own = options.__dict__.get("__doc__")
    if own:
        return _first_line(own)
    module = sys.modules.get(_home(options))
    return _first_line(getattr(module, "__doc__", None))


def method_rows(kind: Kind) -> list[MethodRow]:
    """Every registered method of ``kind`` ("peft", "algorithm" or "robust"), by name (fedpeft's built-ins
    registered first)."""
    load_built_ins()
    registry = REGISTRIES[kind]
    tag = registry.key.rsplit(".", 1)[1]  # "method" of peft.method, "name" of algorithm.name, "rule"
    rows = []
    for name, entry in registry.items():
        options = entry.options
        rows.append(MethodRow(kind, name, _summary(options), f"{options.__module__}.{options.__qualname__}",
                              _home(options), tuple(f for f in options.model_fields if f != tag)))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(kind: Kind) -> str:
    """A markdown table of the registered methods of ``kind``: name, what it is, options, where it lives."""
    lines = [f"| `{REGISTRIES[kind].key}` | what it is | options | lives in |", "|---|---|---|---|"]
    for row in method_rows(kind):
        options = ", ".join(f"`{f}`" for f in row.options_fields) or "none"
        lines.append(f"| `{row.name}` | {_cell(row.summary)} | {options} | `{row.where}` |")
    return "\n".join(lines)


def options_reference(kind: Kind) -> str:
    """mkdocstrings directives (``::: path``) for the options model of every registered method of ``kind``."""
    return "\n\n".join(f"::: {row.options}" for row in method_rows(kind))  # each name has its own options class


def text_table(kinds: tuple[Kind, ...] = KINDS) -> str:
    """The plain-text listing ``fedpeft methods`` prints."""
    out = []
    for kind in kinds:
        rows = method_rows(kind)
        out.append(f"{REGISTRIES[kind].key} ({len(rows)} registered)")
        width = max((len(r.name) for r in rows), default=0)
        for row in rows:
            out.append(f"  {row.name:<{width}}  {row.summary}  [{row.where}]")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
