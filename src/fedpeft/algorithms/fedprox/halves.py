"""FedProx (Li et al. 2020): FedAvg on the server, a proximal term on the client.

Each client minimises ``loss + mu/2 * ||w - w_global||^2`` over its trainable parameters, where
``w_global`` is the state it received this round.
"""

from __future__ import annotations

import torch

from fedpeft.algorithms.base import ClientContext
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedprox.options import FedProxOptions
from fedpeft.wire import Payload


class FedProxServer(FedAvgServer[FedProxOptions]):
    pass


class FedProxClient(FedAvgClient):
    def __init__(self, mu: float):
        self.mu = mu

    def extra_loss(self, payload: Payload, ctx: ClientContext):
        if self.mu == 0:
            return None
        params = ctx.tuned.params
        anchors = {n: torch.from_numpy(payload.arrays[n]).to(p.device, p.dtype) for n, p in params.items()}

        def proximal() -> torch.Tensor:
            return 0.5 * self.mu * sum(torch.sum((p - anchors[n]) ** 2) for n, p in params.items())

        return proximal


def fedprox_client(options: FedProxOptions) -> FedProxClient:
    """FedProx's client half: local training with the proximal term of weight ``options.mu``."""
    return FedProxClient(options.mu)
