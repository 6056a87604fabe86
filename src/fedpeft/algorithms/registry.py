"""The registered federated algorithms: a name, its options model, its server half and its client half.

Built-in algorithms register here exactly as a user's plugin does (``fedpeft.register_algorithm``), each from
its own package (``fedpeft/algorithms/<name>/__init__.py``); the runtimes look algorithms up by the config's
``algorithm.name`` and never name one themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedpeft.algorithms.base import ClientAlgorithm, RuntimeNeeds, ServerAlgorithm
from fedpeft.config.schema import AlgorithmOptions, check_options_model, refresh_choices
from fedpeft.registry import ALGORITHMS, CodeRef, resolve

if TYPE_CHECKING:
    from fedpeft.heads.layout import HeadLayout

ClientFactory = Callable[[Any], ClientAlgorithm]  # the algorithm's options -> its client half


@dataclass(frozen=True)
class RegisteredAlgorithm:
    """One registered algorithm (see :func:`register_algorithm`); ``server`` and ``client`` may be lazy
    :class:`~fedpeft.registry.CodeRef` references, resolved on first use."""

    name: str
    options: type[AlgorithmOptions]
    server_code: type[ServerAlgorithm] | CodeRef
    client_code: type[ClientAlgorithm] | ClientFactory | CodeRef

    @property
    def server(self) -> type[ServerAlgorithm]:
        return resolve(self.server_code)  # type: ignore[return-value]

    @property
    def client(self) -> ClientFactory:
        return resolve(self.client_code)  # type: ignore[return-value]


def _code(value: object, what: str, name: str) -> Any:
    if isinstance(value, str):
        try:
            return CodeRef(value)
        except ValueError as exc:
            raise ValueError(f"register_algorithm({name!r}): {what}: {exc}") from None
    return value


def register_algorithm(name: str, *, options: type[AlgorithmOptions],
                       server: type[ServerAlgorithm] | CodeRef | str,
                       client: type[ClientAlgorithm] | ClientFactory | CodeRef | str) -> None:
    """Register a federated algorithm under ``name``: ``options`` is its pydantic options model (a subclass of
    AlgorithmOptions with ``name: Literal[name] = name``), ``server`` its ServerAlgorithm subclass, and
    ``client`` its ClientAlgorithm subclass (called with the options) or a factory options -> client half.
    ``server`` and ``client`` may also be given as ``"package.module:attribute"`` (imported on first use, so
    that validating a config that names the algorithm imports none of its code).
    From then on ``algorithm: {name: NAME, ...}`` is a valid config section."""
    check_options_model(options, "algorithm", name)
    server = _code(server, "server", name)
    client = _code(client, "client", name)
    if not isinstance(server, CodeRef) and not (isinstance(server, type) and issubclass(server, ServerAlgorithm)):
        raise TypeError(f"register_algorithm({name!r}): server must subclass fedpeft.ServerAlgorithm")
    if not isinstance(client, CodeRef) and not callable(client):
        raise TypeError(f"register_algorithm({name!r}): client must be a ClientAlgorithm subclass or a factory")
    entry = RegisteredAlgorithm(name, options, server, client)
    ALGORITHMS.add(name, entry, same=_same_options)
    refresh_choices("algorithm")


def _same_options(a: RegisteredAlgorithm, b: RegisteredAlgorithm) -> bool:
    """The same algorithm registered again (a plugin module loaded twice, or its file imported anew)."""
    return (a.options.__module__, a.options.__qualname__) == (b.options.__module__, b.options.__qualname__)


def registered_algorithm(name: str) -> RegisteredAlgorithm:
    """The algorithm registered under ``name``; a one-line ValueError listing the registered ones otherwise."""
    entry = ALGORITHMS.find(name)
    if entry is None:
        raise ValueError(f"algorithm {name!r} is not registered; registered: {', '.join(sorted(ALGORITHMS)) or 'none'}")
    return entry


def make_server(options: AlgorithmOptions, initial_state: dict[str, Any], *, num_clients: int,
                clients_per_round: int, seed: int, layout: HeadLayout | None = None,
                client_lr: float | None = None, server_model: Any = None) -> ServerAlgorithm:
    """The server half of the algorithm ``options`` names, started from ``initial_state``."""
    server_cls = registered_algorithm(options.name).server
    return server_cls(options, initial_state, num_clients=num_clients, clients_per_round=clients_per_round, seed=seed,
                      layout=layout, client_lr=client_lr, server_model=server_model)


def runtime_needs(options: AlgorithmOptions) -> RuntimeNeeds:
    """What the algorithm ``options`` names needs from the runtime (its server half's declaration)."""
    return registered_algorithm(options.name).server.runtime_needs(options)


def make_client(options: AlgorithmOptions) -> ClientAlgorithm:
    """The client half of the algorithm ``options`` names."""
    return registered_algorithm(options.name).client(options)
