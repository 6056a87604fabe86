"""The registered federated algorithms: a name, its options model, its server half and its client half.

Built-in algorithms register here exactly as a user's plugin does (``fedpeft.register_algorithm``), each from
its own package (``fedpeft/algorithms/<name>/__init__.py``); the runtimes look algorithms up by the config's
``algorithm.name`` and never name one themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from fedpeft import registry
from fedpeft.algorithms.base import ClientAlgorithm, OptionsT, RuntimeNeeds, ServerAlgorithm
from fedpeft.algorithms.wrapping import wrap_client, wrap_server
from fedpeft.config.schema import AlgorithmOptions, check_options_model
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, resolve
from fedpeft.wire import Arrays

if TYPE_CHECKING:
    from fedpeft.training.server import ServerModel

# The algorithm's options -> its client half (a ClientAlgorithm subclass whose __init__ takes the options is one)
ClientFactory = Callable[[OptionsT], ClientAlgorithm]
Code = TypeVar("Code")


@dataclass(frozen=True)
class RegisteredAlgorithm(Generic[OptionsT]):
    """One registered algorithm (see :func:`register_algorithm`); ``server`` and ``client`` may be lazy
    :class:`~fedpeft.registry.CodeRef` references, resolved on first use."""

    name: str
    options: type[OptionsT]
    server_code: type[ServerAlgorithm[OptionsT]] | CodeRef
    client_code: ClientFactory[OptionsT] | CodeRef

    @property
    def server(self) -> type[ServerAlgorithm[OptionsT]]:
        return resolve(self.server_code)

    @property
    def client(self) -> ClientFactory[OptionsT]:
        return resolve(self.client_code)


# the registry of fedpeft.registry, typed with its full entries (the same object)
ALGORITHMS = cast("registry.Registry[RegisteredAlgorithm[Any]]", registry.ALGORITHMS)


def _code(value: Code | str, what: str, name: str) -> Code | CodeRef:
    if isinstance(value, str):
        try:
            return CodeRef(value)
        except ValueError as exc:
            raise ValueError(f"register_algorithm({name!r}): {what}: {exc}") from None
    return value


def register_algorithm(name: str, *, options: type[OptionsT],
                       server: type[ServerAlgorithm[OptionsT]] | CodeRef | str,
                       client: ClientFactory[OptionsT] | CodeRef | str) -> None:
    """Register a federated algorithm under ``name``: ``options`` is its pydantic options model (a subclass of
    AlgorithmOptions with ``name: Literal[name] = name``), ``server`` its ServerAlgorithm subclass, and
    ``client`` its ClientAlgorithm subclass (called with the options) or a factory options -> client half.
    ``server`` and ``client`` may also be given as ``"package.module:attribute"`` (imported on first use, so
    that validating a config that names the algorithm imports none of its code).
    From then on ``algorithm: {name: NAME, ...}`` is a valid config section."""
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    check_options_model(options, "algorithm", name)
    server_code = _code(server, "server", name)
    client_code = _code(client, "client", name)
    if not isinstance(server_code, CodeRef) and not (isinstance(server_code, type)
                                                     and issubclass(server_code, ServerAlgorithm)):
        raise TypeError(f"register_algorithm({name!r}): server must subclass fedpeft.ServerAlgorithm")
    if not isinstance(client_code, CodeRef) and not callable(client_code):
        raise TypeError(f"register_algorithm({name!r}): client must be a ClientAlgorithm subclass or a factory")
    entry = RegisteredAlgorithm(name, options, server_code, client_code)
    ALGORITHMS.add(name, entry, same=_same_options)


def _same_options(a: RegisteredAlgorithm[Any], b: RegisteredAlgorithm[Any]) -> bool:
    """The same algorithm registered again (a plugin module loaded twice, or its file imported anew)."""
    return (a.options.__module__, a.options.__qualname__) == (b.options.__module__, b.options.__qualname__)


def registered_algorithm(name: str) -> RegisteredAlgorithm[Any]:
    """The algorithm registered under ``name`` (fedpeft's built-ins registered first); a one-line ValueError
    listing the registered ones otherwise."""
    load_built_ins()
    return ALGORITHMS.require(name, "algorithm")


def make_server(options: OptionsT, initial_state: Arrays, *, num_clients: int, clients_per_round: int, seed: int,
                layout: object | None = None, client_lr: float | None = None,
                server_model: ServerModel | None = None) -> ServerAlgorithm[OptionsT]:
    """The server half of the algorithm ``options`` names, started from ``initial_state``, inside the wrappers its
    options turn on (``algorithm.robust``, ``algorithm.dp``)."""
    server_cls: type[ServerAlgorithm[OptionsT]] = registered_algorithm(options.name).server
    return wrap_server(options, server_cls(options, initial_state, num_clients=num_clients,
                                           clients_per_round=clients_per_round, seed=seed, layout=layout,
                                           client_lr=client_lr, server_model=server_model))


def runtime_needs(options: AlgorithmOptions) -> RuntimeNeeds:
    """What the algorithm ``options`` names needs from the runtime (its server half's declaration)."""
    return registered_algorithm(options.name).server.runtime_needs(options)


def make_client(options: AlgorithmOptions) -> ClientAlgorithm:
    """The client half of the algorithm ``options`` names."""
    return wrap_client(options, registered_algorithm(options.name).client(options))
