"""One table per kind of pluggable thing (algorithms, PEFT methods, datasets, trackers, runtimes).

A :class:`Registry` maps names to entries and says, in one line, which names exist when a lookup fails.
It imports nothing of fedpeft, so that every layer, the config included, may hold or read one. Entries may
point at code lazily with a :class:`CodeRef` ("package.module:attribute"), so that registering a built-in
needs neither torch nor Flower: the code is imported when it is first used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Generic, Protocol, TypeVar

Entry = TypeVar("Entry")
Code = TypeVar("Code")


@dataclass(frozen=True)
class CodeRef:
    """A lazy reference to a module attribute, written ``"package.module:attribute"``."""

    path: str

    def __post_init__(self) -> None:
        module, sep, attribute = self.path.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"code reference {self.path!r}: write it as 'package.module:attribute'")

    def load(self) -> object:
        module, _, attribute = self.path.partition(":")
        target: object = importlib.import_module(module)
        for part in attribute.split("."):
            target = getattr(target, part)
        return target


def code_ref(code: Code | CodeRef | str) -> Code | CodeRef:
    """``code`` as a registry keeps it: a ``"package.module:attribute"`` string becomes a :class:`CodeRef`."""
    return CodeRef(code) if isinstance(code, str) else code


def resolve(code: Code | CodeRef) -> Code:
    """``code`` itself, or what a :class:`CodeRef` points at."""
    return code.load() if isinstance(code, CodeRef) else code  # type: ignore[return-value]


class Registry(Generic[Entry]):
    """Named entries of one kind; ``key`` is where a config names them (e.g. ``"algorithm.name"``). Names are
    listed in alphabetical order, whatever the order they were registered in."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        self._entries: dict[str, Entry] = {}
        self._origins: dict[str, str] = {}  # name -> the module (or plugin file) that registered it

    def add(self, name: str, entry: Entry, *, same: Callable[[Entry, Entry], bool] | None = None) -> None:
        """Register ``entry`` under ``name``. Registering an equal entry again (a plugin module loaded twice)
        is a no-op; another entry under a taken name is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        known = self._entries.get(name)
        if known is not None and not (same or (lambda a, b: a == b))(known, entry):
            raise ValueError(f"{self.key} {name!r} is already registered (by {self._origins[name]}); choose another "
                             "name")
        if known is None:  # (an equal entry registered again keeps its first origin)
            self._origins[name] = _registering_module()
        self._entries[name] = entry

    def find(self, name: str) -> Entry | None:
        """The entry registered under ``name``, or None."""
        return self._entries.get(name)

    def require(self, name: str, what: str) -> Entry:
        """The entry registered under ``name``; a one-line ValueError naming it as ``what`` (e.g. "algorithm")
        and listing the registered names otherwise (for code that looks up a name the config already checked)."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"{what} {name!r} is not registered; registered: {', '.join(self.names()) or 'none'}")
        return entry

    def get(self, name: str) -> Entry:
        """The entry registered under ``name``; a one-line ValueError listing the registered names otherwise."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"{self.key}: unknown choice {name!r}; valid choices: {', '.join(sorted(self._entries)) or 'none'}")
        return entry

    def __getitem__(self, name: str) -> Entry:
        return self.get(name)

    def origin(self, name: str) -> str:
        """The module (or plugin file) that registered ``name``; a one-line ValueError if none did."""
        self.get(name)
        return self._origins[name]

    def names(self) -> list[str]:
        """The registered names, in alphabetical order (how fedpeft lists every kind's choices)."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, Entry]]:
        return [(name, self._entries[name]) for name in self.names()]

    def values(self) -> list[Entry]:
        return [self._entries[name] for name in self.names()]

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests that register a throwaway entry clean up with this)."""
        self._entries.pop(name, None)
        self._origins.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


# fedpeft's public registration functions: the module that registers is the one that called them
_REGISTRATION_FUNCTIONS = frozenset({"register_algorithm", "register_peft_method", "register_robust_rule",
                                     "register_dataset", "register_tracker", "register_runtime"})


def _registering_module() -> str:
    """The module that called a ``register_*`` function (for messages): the first frame outside this module and
    the registration functions; a plugin loaded from a file is named by its path."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_globals.get("__name__") == __name__ or (
            frame.f_code.co_name in _REGISTRATION_FUNCTIONS and str(frame.f_globals.get("__name__")).startswith("fedpeft."))):
        frame = frame.f_back
    if frame is None:
        return "an unknown module"
    module = str(frame.f_globals.get("__name__", "?"))
    return str(frame.f_globals.get("__file__", module)) if module.startswith("fedpeft_plugin_") else module


# What every layer may read of an entry. The full entry types live with their registration functions, in layers
# above this one, which hold the same registries typed with them (fedpeft.algorithms.registry.ALGORITHMS,
# fedpeft.tuners.registry.PEFT_METHODS, fedpeft.data.catalog.DATASETS, fedpeft.tracking.backends.TRACKERS,
# fedpeft.launchers.RUNTIMES): nothing here names a module above it, not even for a type checker.


class NamedEntry(Protocol):
    """A registered tracker or runtime, as the config reads it (that the name exists)."""

    @property
    def name(self) -> str: ...


class MethodEntry(Protocol):
    """A registered algorithm, PEFT method or robust rule, as the config reads it: its name and options model."""

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> type[Any]: ...


class DatasetInfo(Protocol):
    """A registered dataset, as the config reads it: its task type and default metric."""

    @property
    def name(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def default_metric(self) -> str | None: ...


# The registries of fedpeft's kinds; their entries are added by the public registration functions
# (fedpeft.register_algorithm, fedpeft.register_peft_method, fedpeft.register_robust_rule), which fedpeft's
# built-ins call as plugins do.
ALGORITHMS: Registry[MethodEntry] = Registry("algorithm", "algorithm.name")
PEFT_METHODS: Registry[MethodEntry] = Registry("PEFT method", "peft.method")
ROBUST_RULES: Registry[MethodEntry] = Registry("robust rule", "algorithm.robust.rule")

# --- the open seams: registered through fedpeft.register_dataset / register_tracker / register_runtime ---

DATASETS: Registry[DatasetInfo] = Registry("dataset", "task.dataset")
TRACKERS: Registry[NamedEntry] = Registry("tracker", "runtime.loggers")
RUNTIMES: Registry[NamedEntry] = Registry("runtime", "runtime.name")
