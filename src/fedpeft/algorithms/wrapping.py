"""Wrappers around an algorithm's halves, as Flower's strategy wrappers go around any strategy.

A :class:`ServerWrapper` is a server half that holds another and passes every call to it; a subclass changes what
it must (which clients are sampled, which updates are accepted, what is reported, checkpointed or stops the run).
A wrapper that aggregates differently takes the place of the wrapped server's weighted mean of the clients'
changes (:meth:`ServerAlgorithm.combine`), so that the algorithm's own server step (FedAvg's, FedAdam's, a LoRA
method's) then steps on the wrapper's aggregate. A :class:`ClientWrapper` does the same for the client half.

Which wrappers a run gets is its algorithm options' business: every option holding a
:class:`~fedpeft.config.wrapping.WrapperOptions` section that is set (``algorithm.robust``, ``algorithm.dp``)
names its wrappers (``server_wrapper``, ``client_wrapper``); :func:`wrap_server` and :func:`wrap_client` apply them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedpeft.algorithms.base import ClientAlgorithm, ClientContext, ServerAlgorithm
from fedpeft.config.schema import AlgorithmOptions
from fedpeft.config.wrapping import WrapperOptions
from fedpeft.registry import CodeRef
from fedpeft.wire import Arrays, Payload


class ServerWrapper(ServerAlgorithm[Any]):
    """A server half around ``inner``: every method and attribute of ``inner`` through this one (a test checks
    that every public method of :class:`ServerAlgorithm` is passed on), ``settings`` the wrapper's options."""

    def __init__(self, inner: ServerAlgorithm[Any], settings: WrapperOptions) -> None:  # (no super().__init__: the
        self.inner = inner  # state is inner's)
        self.settings = settings

    def __getattr__(self, name: str) -> Any:  # the wrapped server's attributes (options, layout, expected, ...)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def innermost(self) -> ServerAlgorithm[Any]:
        """The algorithm's own server half, below every wrapper."""
        server = self.inner
        while isinstance(server, ServerWrapper):
            server = server.inner
        return server

    # whether the wrapped server handed this wrapper the mean in the aggregation under way (set by
    # ServerAlgorithm.combine, when this wrapper took the mean's place: take_mean)
    combined = False

    def take_mean(self) -> None:
        """Put this wrapper's :meth:`combine` in the place of the algorithm's weighted mean of the clients'
        changes (a wrapper that aggregates calls this once)."""
        server = self.innermost
        if server.combiner is not None:
            raise ValueError(f"{self.settings.key}: another wrapper already takes the place of the weighted mean")
        server.combiner = self

    # the state the wrapped server holds (read and written through)
    @property
    def global_state(self) -> Arrays:
        return self.inner.global_state

    @global_state.setter
    def global_state(self, value: Arrays) -> None:
        self.inner.global_state = value

    @property
    def online(self) -> Sequence[int] | None:
        return self.inner.online

    @online.setter
    def online(self, value: Sequence[int] | None) -> None:
        self.inner.online = value

    @property
    def update_meta(self) -> Any:
        return self.inner.update_meta

    @update_meta.setter
    def update_meta(self, value: Any) -> None:
        self.inner.update_meta = value

    @property
    def state_attrs(self) -> tuple[str, ...]:
        return self.inner.state_attrs

    @state_attrs.setter
    def state_attrs(self, value: tuple[str, ...]) -> None:
        self.inner.state_attrs = value

    # every method, passed on
    def select(self, rnd: int) -> list[int]:
        return self.inner.select(rnd)

    def select_among(self, rnd: int, candidates: Sequence[int], k: int) -> list[int]:
        return self.inner.select_among(rnd, candidates, k)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Payload]:
        return self.inner.configure(rnd, clients)

    def validate(self, rnd: int, payload: Payload) -> None:
        self.inner.validate(rnd, payload)

    def validate_from(self, rnd: int, client: int, payload: Payload) -> None:
        self.inner.validate_from(rnd, client, payload)

    def accept(self, rnd: int, updates: dict[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]:
        return self.inner.accept(rnd, updates)

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        self.inner.observe_failures(rnd, failures)

    def observe_evaluation(self, rnd: int, metrics: dict[str, Any]) -> None:
        self.inner.observe_evaluation(rnd, metrics)

    def stop_reason(self) -> str | None:
        return self.inner.stop_reason()

    def round_info(self) -> dict[str, Any]:
        return self.inner.round_info()

    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        self.combined = False
        out = self.inner.aggregate(rnd, updates)
        if self.innermost.combiner is self and updates and not self.combined:  # the option would do nothing, silently
            raise RuntimeError(f"{self.settings.key}: the server half of algorithm {self.innermost.options.name} "
                               "aggregated without ServerAlgorithm.combine, whose place this wrapper takes; an "
                               "algorithm that offers the option takes its mean of the clients' changes through it")
        return out

    def aggregate_mean(self, rnd: int, mean_update: dict[str, Any]) -> dict[str, float]:
        return self.inner.aggregate_mean(rnd, mean_update)

    def combine(self, rnd: int, deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays:
        return self.inner.combine(rnd, deltas, weights, clients)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)


class ClientWrapper(ClientAlgorithm):
    """A client half around ``inner``, ``settings`` the wrapper's options; a subclass changes :meth:`fit`."""

    def __init__(self, inner: ClientAlgorithm, settings: WrapperOptions) -> None:
        self.inner = inner
        self.settings = settings
        self.trains_batched = inner.trains_batched  # type: ignore[misc]  # (as the wrapped half declares)

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        return self.inner.fit(payload, ctx)

    def personal_state(self, global_state: Arrays, state: dict[str, Any]) -> Arrays | None:
        return self.inner.personal_state(global_state, state)


def wrap_server(options: AlgorithmOptions, server: ServerAlgorithm[Any]) -> ServerAlgorithm[Any]:
    """``server`` inside the server wrappers ``options`` turn on (the first set option innermost)."""
    for settings in options.wrappers():
        server = CodeRef(settings.server_wrapper).load()(server, settings)  # type: ignore[operator]
    return server


def wrap_client(options: AlgorithmOptions, client: ClientAlgorithm) -> ClientAlgorithm:
    """``client`` inside the client wrappers ``options`` turn on (those that have one)."""
    for settings in options.wrappers():
        if settings.client_wrapper is not None:
            client = CodeRef(settings.client_wrapper).load()(client, settings)  # type: ignore[operator]
    return client
