"""Federated algorithms: each one a server half and a client half, registered by name."""

from __future__ import annotations

from typing import Any, Callable

from fedpeft.algorithms.base import (
    ClientAlgorithm,
    ClientContext,
    ServerAlgorithm,
    UpdateRejected,
    check_update,
    random_selection,
)
from fedpeft.algorithms.fedavg import FedAdamServer, FedAvgClient, FedAvgMServer, FedAvgServer, FedYogiServer
from fedpeft.algorithms.fedpeptao import FedPepTAOClient, FedPepTAOServer
from fedpeft.algorithms.fedsp import FedSPClient, FedSPServer
from fedpeft.algorithms.fedprox import FedProxClient, FedProxServer
from fedpeft.algorithms.headprune import HeadPruneClient, HeadPruneServer

# name -> (server class, client factory taking the algorithm options)
REGISTRY: dict[str, tuple[type[ServerAlgorithm], Callable[[Any], ClientAlgorithm]]] = {
    "fedavg": (FedAvgServer, lambda o: FedAvgClient(o.dp)),
    "fedavgm": (FedAvgMServer, lambda o: FedAvgClient(o.dp)),
    "fedadam": (FedAdamServer, lambda o: FedAvgClient(o.dp)),
    "fedyogi": (FedYogiServer, lambda o: FedAvgClient(o.dp)),
    "fedprox": (FedProxServer, lambda o: FedProxClient(o.mu, o.dp)),
    "headprune": (HeadPruneServer, HeadPruneClient),
    "fedpeptao": (FedPepTAOServer, FedPepTAOClient),
    "fedsp": (FedSPServer, FedSPClient),
}


def make_server(options: Any, initial_state, *, num_clients: int, clients_per_round: int, seed: int,
                layout: Any = None, client_lr: float | None = None, server_model: Any = None) -> ServerAlgorithm:
    server_cls, _ = REGISTRY[options.name]
    return server_cls(options, initial_state, num_clients=num_clients, clients_per_round=clients_per_round, seed=seed,
                      layout=layout, client_lr=client_lr, server_model=server_model)


def needs_head_layout(options: Any) -> bool:
    return REGISTRY[options.name][0].needs_head_layout


def needs_prefix_layout(options: Any) -> bool:
    return REGISTRY[options.name][0].needs_prefix_layout


def needs_server_model(options: Any) -> bool:
    return REGISTRY[options.name][0].needs_server_model


def make_client(options: Any) -> ClientAlgorithm:
    return REGISTRY[options.name][1](options)


__all__ = [
    "REGISTRY", "ClientAlgorithm", "ClientContext", "ServerAlgorithm", "UpdateRejected", "check_update",
    "make_client", "make_server", "needs_head_layout", "needs_prefix_layout",
    "needs_server_model", "random_selection",
]
