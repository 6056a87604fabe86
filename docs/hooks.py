"""MkDocs hook: fill the method tables and the options reference from fedpeft's registries at build time, so
that a registered method (a new built-in, in its own folder) appears in the docs without editing them.

A page writes ``<!-- fedpeft:methods peft -->`` (or ``algorithm``) where the table of registered methods goes
and ``<!-- fedpeft:options peft -->`` (or ``algorithm``) where their options models' reference goes.
"""

from __future__ import annotations

import re
from typing import Any

import fedpeft.config  # noqa: F401 (registers the built-in methods)
from fedpeft import listing

MARKER = re.compile(r"<!-- fedpeft:(methods|options) (peft|algorithm) -->")


def _fill(match: re.Match[str]) -> str:
    what, kind = match.group(1), match.group(2)
    return listing.markdown_table(kind) if what == "methods" else listing.options_reference(kind)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(_fill, markdown)
