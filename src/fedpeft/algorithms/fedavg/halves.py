"""FedAvg and its server-optimizer family: FedAvgM, FedAdam, FedYogi (Reddi et al. 2021).

FedAvg -> FedOpt(server optimizer over the pseudo-gradient) -> FedAvgM / FedAdam / FedYogi.
The client half sends its updated trainable parameters; the server forms the sample-weighted mean
delta (paper 000, Eq. 5) and applies its optimizer.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms.aggregate import l2_norm
from fedpeft.algorithms.base import (
    Arrays,
    ClientAlgorithm,
    ClientContext,
    ServerAlgorithm,
    check_arrays,
)
from fedpeft.algorithms.fedavg.options import FedAdamOptions, FedAvgMOptions, FedAvgOptions
from fedpeft.config.schema import AlgorithmOptions
from fedpeft.tuners.lora_factors import aggregation_error, lora_pairs
from fedpeft.wire import Payload

# The options of a FedAvg-family algorithm (server_lr, dp, robust): FedAvg's, FedAvgM's, FedAdam's, FedProx's, ...
FedAvgFamilyT = TypeVar("FedAvgFamilyT", bound=AlgorithmOptions)


class FedAvgServer(ServerAlgorithm[FedAvgFamilyT]):
    """The server step on the clients' sample-weighted mean change (:meth:`combine`, which the ``robust`` and
    ``dp`` wrappers replace)."""

    def __init__(self, options: FedAvgFamilyT, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        self.lora_pairs = lora_pairs(self.global_state)  # LoRA factors, when the PEFT method is LoRA

    def pseudo_gradient(self, rnd: int, updates: dict[int, Payload]) -> A.Arrays:
        ids = sorted(updates)
        ds = [A.deltas(self.global_state, updates[c].arrays) for c in ids]
        return self.combine(rnd, ds, [updates[c].meta["num_examples"] for c in ids], ids)

    def step(self, d: A.Arrays, rnd: int) -> None:
        self.global_state = A.fedavg_step(self.global_state, d, self.options.server_lr)

    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        if not updates:
            return {"update_norm": 0.0}
        d = self.pseudo_gradient(rnd, updates)
        self.step(d, rnd)
        out = {"update_norm": l2_norm(d)}
        # the gap between averaging factors and averaging products is FedAvg's: not reported when a wrapper takes
        # the mean's place (under DP the clients' own updates are not reported on; a robust rule does not average)
        if self.lora_pairs and self.combiner is None:
            ids = sorted(updates)
            out["lora_aggregation_error"] = aggregation_error(
                [updates[c].arrays for c in ids], [updates[c].meta["num_examples"] for c in ids], self.lora_pairs)
        return out

    def aggregate_mean(self, rnd: int, mean_update: dict[str, np.ndarray]) -> dict[str, float]:
        check_arrays(mean_update, self.expected)
        self.step(mean_update, rnd)
        return {"update_norm": l2_norm(mean_update)}


class FedAvgMServer(FedAvgServer[FedAvgMOptions]):
    state_attrs = ("global_state", "momentum_buffer")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.momentum_buffer: A.Arrays | None = None

    def step(self, d: A.Arrays, rnd: int) -> None:
        self.global_state, self.momentum_buffer = A.fedavgm_step(
            self.global_state, d, self.momentum_buffer, self.options.server_lr, self.options.momentum
        )


class FedAdamServer(FedAvgServer[FedAdamOptions]):
    rule = staticmethod(A.fedadam_step)
    state_attrs = ("global_state", "m", "v")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.m: A.Arrays | None = None
        self.v: A.Arrays | None = None

    def step(self, d: A.Arrays, rnd: int) -> None:
        o = self.options
        lr = o.server_lr
        if o.bias_correction:  # Flower's form: the exponent is the round number plus one
            lr *= np.sqrt(1 - o.beta2 ** (rnd + 1)) / (1 - o.beta1 ** (rnd + 1))
        self.global_state, self.m, self.v = self.rule(
            self.global_state, d, self.m, self.v, lr, o.beta1, o.beta2, o.tau,
            0.0 if o.initial_v == "zero" else None)


class FedYogiServer(FedAdamServer):
    rule = staticmethod(A.fedyogi_step)


class FedAvgClient(ClientAlgorithm):
    """Load the global state, train locally, send the new trainable parameters back (under ``dp`` its wrapper
    clips the change first)."""

    def extra_loss(self, payload: Payload, ctx: ClientContext):
        return None

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        ctx.tuned.load_state(payload.arrays)
        ctx.evaluate_personal()  # the personalized model of the FedAvg family: the global one
        result = ctx.train(extra_loss=self.extra_loss(payload, ctx))
        meta = {"round": payload.meta["round"], "client": ctx.client_id, "num_examples": ctx.num_examples,
                **result.as_meta()}
        return Payload(ctx.tuned.state(), meta)


def fedavg_client(options: FedAvgOptions | FedAvgMOptions | FedAdamOptions) -> FedAvgClient:
    """The client half of the FedAvg family: plain local training."""
    return FedAvgClient()
