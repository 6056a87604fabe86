"""MkDocs hook: fill the method tables and the options reference from fedpeft's registries at build time, so
that a registered method (a new built-in, in its own folder) appears in the docs without editing them.

A page writes ``<!-- fedpeft:methods peft -->`` (or ``algorithm``) where the table of registered methods goes
and ``<!-- fedpeft:options peft -->`` (or ``algorithm``) where their options models' reference goes.

It also turns the equations that pymdownx.arithmatex marks (``\\( ... \\)`` inline, ``\\[ ... \\]`` displayed)
into MathML with latex2mathml, which browsers draw themselves: the pages load no script or font from another
site, so the docs work offline. An equation latex2mathml cannot read, or would show in part as text (an
environment or a command it does not know), fails the build, naming the page.
"""

from __future__ import annotations

import html
import re
from typing import Any

from latex2mathml.converter import convert

from fedpeft import listing  # (its tables register fedpeft's built-ins first)

MARKER = re.compile(r"<!-- fedpeft:(methods|options) (peft|algorithm|robust) -->")
# what arithmatex writes in generic mode: <span class="arithmatex">\(...\)</span>, <div class="arithmatex">\[...\]</div>
EQUATION = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.DOTALL)


def _fill(match: re.Match[str]) -> str:
    what, kind = match.group(1), match.group(2)
    return listing.markdown_table(kind) if what == "methods" else listing.options_reference(kind)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(_fill, markdown)


def as_mathml(page_html: str, where: str = "a page") -> str:
    """``page_html`` with each arithmatex equation as MathML (a displayed one as a block)."""

    def one(match: re.Match[str]) -> str:
        latex = html.unescape(match.group(2)).strip()
        try:
            mathml = convert(latex, display="block" if match.group(1) == "div" else "inline")
        except Exception as exc:
            raise ValueError(f"{where}: latex2mathml cannot read the equation {latex!r} ({exc}); write it "
                             "in the LaTeX it reads") from exc
        if "<mi>&</mi>" in mathml or "<mi>\\" in mathml:  # (an environment or a command it passes through as text)
            raise ValueError(f"{where}: latex2mathml does not know an environment or command of the equation "
                             f"{latex!r} (it would show as text); write it in the LaTeX it reads (e.g. align* "
                             "for aligned)")
        return mathml

    return EQUATION.sub(one, page_html)


def on_page_content(page_html: str, page: Any, **_: Any) -> str:
    return as_mathml(page_html, page.file.src_path)
