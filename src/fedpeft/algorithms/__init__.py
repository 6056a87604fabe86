"""Federated algorithms: each one a server half and a client half, registered by name.

The built-in algorithms below register through :func:`fedpeft.algorithms.registry.register_algorithm`, the
same function a plugin calls (``fedpeft.register_algorithm``).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedpeft.algorithms.base import (
    ClientAlgorithm,
    ClientContext,
    RuntimeNeeds,
    ServerAlgorithm,
    UpdateMeta,
    UpdateRejected,
    check_update,
    check_update_meta,
    random_selection,
)
from fedpeft.algorithms.fedavg import (
    FedAdamServer,
    FedAvgClient,
    FedAvgMServer,
    FedAvgServer,
    FedYogiServer,
)
from fedpeft.algorithms.fedpeptao import FedPepTAOClient, FedPepTAOServer
from fedpeft.algorithms.fedprox import FedProxClient, FedProxServer
from fedpeft.algorithms.fedsp import FedSPClient, FedSPServer
from fedpeft.algorithms.headprune import HeadPruneClient, HeadPruneServer
from fedpeft.algorithms.registry import ALGORITHMS, register_algorithm, registered_algorithm
from fedpeft.config import schema as S

register_algorithm("fedavg", options=S.FedAvgOptions, server=FedAvgServer, client=lambda o: FedAvgClient(o.dp))
register_algorithm("fedavgm", options=S.FedAvgMOptions, server=FedAvgMServer, client=lambda o: FedAvgClient(o.dp))
register_algorithm("fedadam", options=S.FedAdamOptions, server=FedAdamServer, client=lambda o: FedAvgClient(o.dp))
register_algorithm("fedyogi", options=S.FedYogiOptions, server=FedYogiServer, client=lambda o: FedAvgClient(o.dp))
register_algorithm("fedprox", options=S.FedProxOptions, server=FedProxServer,
                   client=lambda o: FedProxClient(o.mu, o.dp))
register_algorithm("headprune", options=S.HeadPruneOptions, server=HeadPruneServer, client=HeadPruneClient)
register_algorithm("fedpeptao", options=S.FedPepTAOOptions, server=FedPepTAOServer, client=FedPepTAOClient)
register_algorithm("fedsp", options=S.FedSPOptions, server=FedSPServer, client=FedSPClient)
# the federated LoRA methods register themselves through the public API (import fedpeft) when imported
importlib.import_module("fedpeft.algorithms.lora.ffa")
importlib.import_module("fedpeft.algorithms.lora.fedsa")
importlib.import_module("fedpeft.algorithms.lora.hetero")
importlib.import_module("fedpeft.algorithms.lora.flora")
importlib.import_module("fedpeft.algorithms.lora.fedex")


def make_server(options: Any, initial_state, *, num_clients: int, clients_per_round: int, seed: int,
                layout: Any = None, client_lr: float | None = None, server_model: Any = None) -> ServerAlgorithm:
    server_cls = registered_algorithm(options.name).server
    return server_cls(options, initial_state, num_clients=num_clients, clients_per_round=clients_per_round, seed=seed,
                      layout=layout, client_lr=client_lr, server_model=server_model)


def runtime_needs(options: Any) -> RuntimeNeeds:
    """What the algorithm ``options`` names needs from the runtime (its server half's declaration)."""
    return registered_algorithm(options.name).server.runtime_needs(options)


def make_client(options: Any) -> ClientAlgorithm:
    return registered_algorithm(options.name).client(options)


__all__ = [
    "ALGORITHMS",
    "ClientAlgorithm",
    "ClientContext",
    "RuntimeNeeds",
    "ServerAlgorithm",
    "UpdateMeta",
    "UpdateRejected",
    "check_update",
    "check_update_meta",
    "make_client",
    "make_server",
    "random_selection",
    "register_algorithm",
    "registered_algorithm",
    "runtime_needs",
]
