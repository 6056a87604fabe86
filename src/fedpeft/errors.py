"""The errors a user's input can cause. Each is one line naming the problem, the place and the fix; the
command line prints it as ``error: ...`` (exit code 2) instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error about the user's input (config, data, model, run directory, checkpoint)."""
