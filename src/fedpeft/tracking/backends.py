"""The experiment trackers a config may name in ``runtime.loggers``: :func:`register_tracker`
(``fedpeft.register_tracker``) and the built-in ones, registered through it like a plugin's.

Registering one imports nothing of its backend: the Tracker class is named as ``"package.module:Class"`` and
imported when a run opens it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from fedpeft import registry
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, code_ref

if TYPE_CHECKING:
    from fedpeft.tracking.base import Tracker


@dataclass(frozen=True)
class TrackerEntry:
    """A logger of ``runtime.loggers``: its :class:`fedpeft.tracking.Tracker` subclass, the package it needs
    (checked before a run starts; None: none beyond fedpeft's own) and the extra of fedpeft that installs it."""

    name: str
    tracker: type[Tracker] | CodeRef
    package: str | None = None
    extra: str | None = None

    def install_command(self) -> str:
        """How to install the package it needs."""
        return f"pip install 'fedpeft[{self.extra}]'" if self.extra else f"pip install {self.package}"


# the registry of fedpeft.registry, typed with its full entries (the same object)
TRACKERS = cast("registry.Registry[TrackerEntry]", registry.TRACKERS)


def register_tracker(name: str, tracker: type[Tracker] | CodeRef | str, *, package: str | None = None,
                     extra: str | None = None) -> TrackerEntry:
    """Make ``name`` a valid logger of ``runtime.loggers`` in every config from now on; returns its entry.

    Args:
        name: the name a config lists in ``runtime.loggers``.
        tracker: a subclass of :class:`fedpeft.tracking.Tracker` (constructed as
            ``tracker(cfg, run_dir, saved, start_round=...)`` for each run that lists ``name``), or
            ``"package.module:Class"`` (imported when a run first opens it).
        package: the importable package it needs; a config that names ``name`` while it is missing is refused
            before the run starts, with the command that installs it.
        extra: the extra of fedpeft that installs ``package`` (the message then says
            ``pip install 'fedpeft[extra]'``, else ``pip install package``).

    Registering the same entry again is a no-op; another tracker under a taken name is refused.
    """
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    if isinstance(tracker, str | CodeRef):
        entry_tracker: type[Tracker] | CodeRef = code_ref(tracker)
    elif isinstance(tracker, type) and getattr(tracker, "log_row", None) is not None:
        entry_tracker = tracker
    else:
        raise TypeError(f"tracker {name!r}: give a subclass of fedpeft.tracking.Tracker or 'package.module:Class', "
                        f"not {tracker!r}")
    if extra is not None and package is None:
        raise ValueError(f"tracker {name!r}: extra {extra!r} installs a package: name it as package too")
    entry = TrackerEntry(name, entry_tracker, package, extra)
    TRACKERS.add(name, entry)
    return entry


# --- the built-in trackers ------------------------------------------------------------------------


def register_built_in_trackers() -> None:
    """Register the built-in trackers (fedpeft.builtins.register calls this)."""
    register_tracker("tensorboard", "fedpeft.tracking.tensorboard_tracker:TensorBoardTracker", package="tensorboard",
                     extra="tensorboard")
    register_tracker("mlflow", "fedpeft.tracking.mlflow_tracker:MlflowTracker", package="mlflow", extra="mlflow")
    register_tracker("wandb", "fedpeft.tracking.wandb_tracker:WandbTracker", package="wandb", extra="wandb")
