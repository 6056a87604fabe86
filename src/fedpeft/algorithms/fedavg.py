"""FedAvg and its server-optimizer family: FedAvgM, FedAdam, FedYogi (Reddi et al. 2021).

FedAvg -> FedOpt(server optimizer over the pseudo-gradient) -> FedAvgM / FedAdam / FedYogi.
The client half sends its updated trainable parameters; the server forms the sample-weighted mean
delta (paper 000, Eq. 5) and applies its optimizer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms.base import ClientAlgorithm, ClientContext, ServerAlgorithm
from fedpeft.wire import Payload


class FedAvgServer(ServerAlgorithm):
    def pseudo_gradient(self, updates: dict[int, Payload]) -> A.Arrays:
        ids = sorted(updates)
        ds = [A.deltas(self.global_state, updates[c].arrays) for c in ids]
        return A.weighted_mean(ds, [updates[c].meta["num_examples"] for c in ids])

    def step(self, d: A.Arrays) -> None:
        self.global_state = A.fedavg_step(self.global_state, d, self.options.server_lr)

    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        if not updates:
            return {"update_norm": 0.0}
        d = self.pseudo_gradient(updates)
        self.step(d)
        return {"update_norm": float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in d.values())))}


class FedAvgMServer(FedAvgServer):
    state_attrs = ("global_state", "momentum_buffer")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.momentum_buffer: A.Arrays | None = None

    def step(self, d: A.Arrays) -> None:
        self.global_state, self.momentum_buffer = A.fedavgm_step(
            self.global_state, d, self.momentum_buffer, self.options.server_lr, self.options.momentum
        )


class FedAdamServer(FedAvgServer):
    rule = staticmethod(A.fedadam_step)
    state_attrs = ("global_state", "m", "v")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.m: A.Arrays | None = None
        self.v: A.Arrays | None = None

    def step(self, d: A.Arrays) -> None:
        o = self.options
        self.global_state, self.m, self.v = self.rule(
            self.global_state, d, self.m, self.v, o.server_lr, o.beta1, o.beta2, o.tau
        )


class FedYogiServer(FedAdamServer):
    rule = staticmethod(A.fedyogi_step)


class FedAvgClient(ClientAlgorithm):
    """Load the global state, train locally, send the new trainable parameters back."""

    def extra_loss(self, payload: Payload, ctx: ClientContext):
        return None

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        ctx.tuned.load_state(payload.arrays)
        result = ctx.train(extra_loss=self.extra_loss(payload, ctx))
        meta = {"round": payload.meta["round"], "client": ctx.client_id, "num_examples": ctx.num_examples,
                **result.as_meta()}
        return Payload(ctx.tuned.state(), meta)
