"""Loading plugins: Python modules that register algorithms, PEFT methods, datasets, experiment trackers or
runtimes through the public API (``fedpeft.register_algorithm``, ``fedpeft.register_peft_method``,
``fedpeft.register_dataset``, ``fedpeft.register_tracker``, ``fedpeft.register_runtime``).

A plugin is named in a config (``plugins: [my_package.fl, ./my_plugin.py]``), on the command line
(``fedpeft run CONFIG --plugin ./my_plugin.py``, which adds it to the config) or by an installed package
through the entry-point group ``fedpeft.plugins`` (loaded whenever a config is validated). Since a run's
saved config.yaml lists its plugins, a resumed run and every Flower ServerApp and ClientApp load them too.

A plugin is code, so a file that names one is code too. Only running a config (``fedpeft run CONFIG``,
``fedpeft.run``) or continuing a run (``--resume``, ``fedpeft.resume``) imports the plugins its config lists;
everything that only reads a config, a run directory or an adapter (``fedpeft config``, ``partition``,
``eval``, ``report``, ``fedpeft.load_config``, ``fedpeft.load_adapter``) imports the plugins the user names
(``--plugin``, ``plugins=``), the installed ones, and those a file lists only when the user trusts them
(``--trust-plugins``, ``trust_plugins=True``), as Hugging Face's ``trust_remote_code`` does.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Protocol

from fedpeft.errors import UserError

log = logging.getLogger("fedpeft")

ENTRY_POINT_GROUP = "fedpeft.plugins"
# what fedpeft's pyproject.toml declares in that group for its own methods (a test checks they agree)
BUILT_INS_ENTRY_POINT = "fedpeft.builtins:register"
_installed_loaded = False
_built_ins_loaded = False
_built_ins_lock = threading.RLock()


class PluginError(UserError, ImportError):
    """A plugin that cannot be found or fails while it loads."""


def resolve_plugin(spec: str, base_dir: str | Path | None = None) -> str:
    """A plugin spec as it is kept in a config: a file as an absolute path (relative ones are taken from
    ``base_dir``, else the working directory), a module name as given."""
    if spec.endswith(".py") or "/" in spec or spec.startswith("."):
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = Path(base_dir or ".") / path
        return str(path.resolve())
    return spec


def _file_module_name(path: Path) -> str:
    return f"fedpeft_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def is_loaded(spec: str) -> bool:
    """Whether the plugin ``spec`` (resolved, see :func:`resolve_plugin`) was imported in this process."""
    return (_file_module_name(Path(spec)) if spec.endswith(".py") else spec) in sys.modules


def untrusted_plugins(listed: Iterable[str], named: Iterable[str], trusted: bool) -> list[str]:
    """The plugins a file lists (``listed``) that may not be imported: those the user neither named (``named``)
    nor trusted, and that this process has not imported already (all resolved specs)."""
    if trusted:
        return []
    named = set(named)
    return [spec for spec in listed if spec not in named and not is_loaded(spec)]


def untrusted_hint(specs: Sequence[str], what: str) -> str:
    """What a refusal says of the plugins ``what`` (e.g. "the config") lists and fedpeft did not import."""
    shown = ", ".join(specs[:3]) + (f" and {len(specs) - 3} more" if len(specs) > 3 else "")
    return (f"{what} names plugin(s) {shown}, which fedpeft does not import from a file it only reads (a plugin is "
            f"code): name it yourself (--plugin {specs[0]}, or plugins=[...] in Python), or trust the file's "
            "plugins (--trust-plugins, or trust_plugins=True) if you would run it as a Python script")


def load_plugin(spec: str) -> ModuleType:
    """Import a plugin once per process: a .py file (by path) or an importable module name."""
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise PluginError(f"plugin file {spec!r} does not exist; give a .py file or an importable module name")
        name = _file_module_name(path)
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except UserError:
            del sys.modules[name]
            raise
        except Exception as exc:
            del sys.modules[name]
            raise PluginError(f"plugin {spec}: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name and spec.startswith(exc.name):
            raise PluginError(f"plugin module {spec!r} not found; install it or give the path of a .py file") from None
        raise


def _is_fedpeft_own(entry_point: EntryPoint) -> bool:
    dist = getattr(entry_point, "dist", None)
    return dist is not None and dist.name == "fedpeft"


def _call(entry_point: EntryPoint) -> None:
    try:
        obj = entry_point.load()
        if callable(obj) and not isinstance(obj, ModuleType):
            obj()
    except UserError:
        raise
    except Exception as exc:
        raise PluginError(f"installed plugin {entry_point.name!r} ({entry_point.value}): {type(exc).__name__}: "
                          f"{exc}") from exc


def load_built_ins() -> None:
    """Register (once per process) fedpeft's own algorithms, PEFT methods, datasets, trackers and runtimes: the
    entry point that fedpeft's package itself declares in the ``fedpeft.plugins`` group
    (:data:`BUILT_INS_ENTRY_POINT`), the door an installed plugin package uses too. Importing fedpeft registers
    nothing; this runs when something first needs the registries: a config's validation, a command, the public
    ``register_*`` functions and lookups. Package metadata that lacks it (an install older than this source, or
    a source tree on the path) gets the same entry point, with a warning to reinstall. Thread-safe: another
    thread waits until the registries are complete."""
    global _built_ins_loaded
    with _built_ins_lock:
        if _built_ins_loaded:
            return
        own = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if _is_fedpeft_own(ep)]
        if not own:
            log.warning("fedpeft's package metadata lacks its %s entry point (an install older than this source?): "
                        "registering the built-ins directly; reinstall with bash scripts/install.sh or pip install "
                        "-e .", ENTRY_POINT_GROUP)
            own = [EntryPoint(name="fedpeft", value=BUILT_INS_ENTRY_POINT, group=ENTRY_POINT_GROUP)]
        _built_ins_loaded = True  # before the calls: a built-in's registration calls this again (same thread)
        try:
            for entry_point in own:
                _call(entry_point)
        except BaseException:
            _built_ins_loaded = False  # a later attempt tries again rather than running without built-ins
            raise


def load_installed_plugins() -> list[str]:
    """Load (once per process) every plugin that other installed packages declare in the ``fedpeft.plugins``
    entry-point group: the entry point's object is imported and, when it is a function, called."""
    global _installed_loaded
    load_built_ins()
    if _installed_loaded:
        return []
    _installed_loaded = True
    names = []
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if not _is_fedpeft_own(entry_point):
            _call(entry_point)
            names.append(entry_point.name)
    return names


def load_plugins(specs: list[str]) -> None:
    """Load the installed plugins, then each of ``specs`` (resolved specs, see :func:`resolve_plugin`)."""
    load_installed_plugins()
    for spec in specs:
        load_plugin(spec)


class RunSections(Protocol):
    """The sections of a run's config that name registered methods (fedpeft.config.RunConfig has them)."""

    @property
    def algorithm(self) -> object: ...

    @property
    def peft(self) -> object: ...


def check_reachable_elsewhere(cfg: RunSections) -> None:
    """Refuse a config whose algorithm or PEFT method was registered in the running script itself
    (``__main__``, e.g. a notebook): other processes (Flower's ServerApp and ClientApps, a later
    ``fedpeft run --resume``) find methods only through the config's plugins or installed packages."""
    for section, options in (("algorithm.name", cfg.algorithm), ("peft.method", cfg.peft)):
        if type(options).__module__ == "__main__":
            name = getattr(options, "name", None) or getattr(options, "method", None)
            raise PluginError(f"{section} {name!r} is registered in your script (__main__), which Flower's "
                              "apps in other processes cannot load: move the registration to a .py file or "
                              "module and name it in the config's plugins (or --plugin)")
