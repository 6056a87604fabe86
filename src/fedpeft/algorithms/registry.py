"""The registered federated algorithms: a name, its options model, its server half and its client half.

Built-in algorithms register here exactly as a user's plugin does (``fedpeft.register_algorithm``); the
runtimes look algorithms up by the config's ``algorithm.name`` and never name one themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedpeft.algorithms.base import ClientAlgorithm, ServerAlgorithm
from fedpeft.config.schema import ALGORITHM_OPTIONS, AlgorithmOptions, register_options


@dataclass(frozen=True)
class RegisteredAlgorithm:
    name: str
    options: type[AlgorithmOptions]
    server: type[ServerAlgorithm]
    client: Callable[[Any], ClientAlgorithm]  # options -> a client half


ALGORITHMS: dict[str, RegisteredAlgorithm] = {}


def register_algorithm(name: str, *, options: type[AlgorithmOptions], server: type[ServerAlgorithm],
                       client: type[ClientAlgorithm] | Callable[[Any], ClientAlgorithm]) -> None:
    """Register a federated algorithm under ``name``: ``options`` is its pydantic options model (a subclass of
    AlgorithmOptions with ``name: Literal[name] = name``), ``server`` its ServerAlgorithm subclass, and
    ``client`` its ClientAlgorithm subclass (called with the options) or a factory options -> client half.
    From then on ``algorithm: {name: NAME, ...}`` is a valid config section."""
    if not (isinstance(options, type) and issubclass(options, AlgorithmOptions)):
        raise TypeError(f"register_algorithm({name!r}): options must subclass fedpeft.AlgorithmOptions")
    if options.model_fields["name"].default != name:
        raise ValueError(f"register_algorithm({name!r}): {options.__name__}.name must default to {name!r}, e.g. "
                         f"name: Literal[{name!r}] = {name!r}")
    if not (isinstance(server, type) and issubclass(server, ServerAlgorithm)):
        raise TypeError(f"register_algorithm({name!r}): server must subclass fedpeft.ServerAlgorithm")
    if not callable(client):
        raise TypeError(f"register_algorithm({name!r}): client must be a ClientAlgorithm subclass or a factory")
    register_options(options)
    ALGORITHMS[name] = RegisteredAlgorithm(name, options, server, client)


def registered_algorithm(name: str) -> RegisteredAlgorithm:
    entry = ALGORITHMS.get(name)
    if entry is None:
        known = ", ".join(ALGORITHMS) or "none"
        hint = "" if name not in ALGORITHM_OPTIONS else " (its options are registered but not its halves)"
        raise ValueError(f"algorithm {name!r} is not registered{hint}; registered: {known}")
    return entry
