"""The runtimes of ``runtime.name`` and how they launch: :func:`register_runtime`
(``fedpeft.register_runtime``), the built-in ones registered through it like a plugin's, and :func:`run_config`, the one place where the command line and the
Python API start (or resume) a run in the runtime its config names.

Registering a runtime imports nothing of it: its launch function may be named as ``"package.module:function"``
and is imported when a run starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from fedpeft import registry
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, code_ref, resolve

if TYPE_CHECKING:
    from fedpeft.config import RunConfig
    from fedpeft.observer import RunObserver


class Launch(Protocol):
    """How a runtime runs a config: returns the run's summary (as written to RUN_DIR/summary.json).

    ``run_dir``: the run directory (None: a new one under ``output_dir``; with ``resume``, the run to continue
    with ``cfg``, its saved config). ``observers``: :class:`fedpeft.RunObserver` instances to notify (empty for a
    runtime registered with ``in_process=False``). ``log``: where to write lines for the person who started the
    run (None: the runtime's own choice). ``on_run_dir``: when given, called with the run directory as soon as
    it exists, so that an interrupted run can be named (and resumed)."""

    def __call__(self, cfg: RunConfig, run_dir: str | Path | None, *, resume: bool,
                 observers: Sequence[RunObserver], log: Callable[[str], None] | None,
                 on_run_dir: Callable[[Path], None] | None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RuntimeEntry:
    """A runtime of ``runtime.name``: its launch function and whether the run happens in this process (so that
    observers passed to :func:`fedpeft.run` see its rounds and a method registered in the running script
    works); one that runs its server or clients in other processes (Flower) declares ``in_process=False``."""

    name: str
    launch: Launch | CodeRef
    in_process: bool = True


# the registry of fedpeft.registry, typed with its full entries (the same object)
RUNTIMES = cast("registry.Registry[RuntimeEntry]", registry.RUNTIMES)


def register_runtime(name: str, launch: Launch | CodeRef | str, *, in_process: bool = True) -> RuntimeEntry:
    """Make ``name`` a valid ``runtime.name`` in every config from now on; returns its entry.

    Args:
        name: the name a config gives as ``runtime.name``.
        launch: the function that runs a config (see :class:`Launch`), or ``"package.module:function"``
            (imported when a run first uses it).
        in_process: whether the run's rounds happen in the calling process. False (the server or the
            clients run elsewhere) makes :func:`fedpeft.run` refuse observers and refuse a config whose
            algorithm or PEFT method was registered in the running script rather than in a plugin.

    Registering the same entry again is a no-op; another runtime under a taken name is refused.
    """
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    if not (isinstance(launch, str | CodeRef) or callable(launch)):
        raise TypeError(f"runtime {name!r}: give the launch function or 'package.module:function', not {launch!r}")
    entry = RuntimeEntry(name, code_ref(launch), bool(in_process))
    RUNTIMES.add(name, entry)
    return entry


def run_config(cfg: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False,
               observers: Sequence[RunObserver] = (), log: Callable[[str], None] | None = None,
               on_run_dir: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Run ``cfg`` (or, with ``resume``, continue the run in ``run_dir``) in the runtime ``cfg.runtime.name``
    names; returns the run's summary. The arguments are those of :class:`Launch`."""
    from fedpeft.config import ConfigError

    load_built_ins()
    try:
        entry = RUNTIMES.get(cfg.runtime.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not entry.in_process:
        if observers:
            raise ConfigError(_observers_refused(cfg.runtime.name, resume))
        if not resume:
            from fedpeft.plugins import check_reachable_elsewhere

            check_reachable_elsewhere(cfg)
    launch: Launch = resolve(entry.launch)
    return launch(cfg, run_dir, resume=resume, observers=list(observers), log=log, on_run_dir=on_run_dir)


def _observers_refused(name: str, resume: bool) -> str:
    if resume:
        return f"observers watch a run in this process; this run's runtime is {name}"
    able = " or ".join(n for n, e in RUNTIMES.items() if e.in_process) or "a runtime that runs in this process"
    return (f"observers watch a run in this process; runtime.name {name} runs its server and clients in other "
            f"processes: use runtime.name {able}, or read RUN_DIR/metrics.jsonl")


# --- the built-in runtimes ------------------------------------------------------------------------


def register_built_in_runtimes() -> None:
    """Register the built-in runtimes (fedpeft.builtins.register calls this)."""
    register_runtime("embedded", "fedpeft.runtime.embedded:launch")
    register_runtime("flower", "fedpeft.runtime.flower.launch:launch", in_process=False)
