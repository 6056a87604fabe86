"""The code samples of README.md and docs/**/*.md, for the tests that run them.

Every ```python block is named by the HTML comment on the line above it,
``<!-- sample NAME: run by tests/test_x.py -->``; a test runs it with ``exec(docs_sample("NAME"))``.
tests/test_docs.py checks that every block has such a name and that the test it names fetches it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- sample (?P<name>[a-z0-9-]+): run by (?P<test>tests/test_[a-z0-9_]+\.py) -->")


@dataclass(frozen=True)
class Sample:
    page: Path  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # the line above the fence (blank lines skipped), when it is an HTML comment

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    """README.md and every page of the documentation site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def code_blocks(page: Path) -> list[Sample]:
    """The fenced code blocks of one page, in order."""
    lines = page.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        blocks.append(Sample(page.relative_to(REPO), i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             above if above.startswith("<!--") else None))
        i = end + 1
    return blocks


def all_blocks(language: str) -> list[Sample]:
    return [b for page in doc_pages() for b in code_blocks(page) if b.language == language]


def named_python_samples() -> dict[str, tuple[Sample, str]]:
    """name -> (the sample, the test file its marker names), for every marked ```python block."""
    out: dict[str, tuple[Sample, str]] = {}
    for block in all_blocks("python"):
        found = MARKER.fullmatch(block.marker or "")
        if found:
            out.setdefault(found.group("name"), (block, found.group("test")))
    return out


def docs_sample(name: str) -> str:
    """The code of the ```python block named ``name`` (see the module's docstring)."""
    samples = named_python_samples()
    assert name in samples, f"no ```python block in README.md or docs/ is marked <!-- sample {name}: ... -->"
    return samples[name][0].code
