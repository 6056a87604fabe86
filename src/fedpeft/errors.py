"""The errors a user's input can cause. Each is one line naming the problem, the place and the fix; the
command line prints it as ``error: ...`` (exit code 2) instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error about the user's input (config, data, model, run directory, checkpoint)."""


def first_line(text: object, limit: int = 300) -> str:
    """A reason someone else wrote (an exception's text, a client's or Flower's message) as one line of at most
    ``limit`` characters, for a one-line error or a logged refusal."""
    lines = str(text).strip().splitlines()
    return lines[0][:limit] if lines else "(no reason given)"


def unprintable(text: str) -> str | None:
    """The first character of ``text`` that would break the one line it is printed on (a control or format
    character, Unicode category C*, or a line or paragraph separator), or None."""
    import unicodedata

    return next((c for c in text if unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp")),
                None)
