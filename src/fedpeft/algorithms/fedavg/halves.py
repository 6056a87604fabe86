"""FedAvg and its server-optimizer family: FedAvgM, FedAdam, FedYogi (Reddi et al. 2021).

FedAvg -> FedOpt(server optimizer over the pseudo-gradient) -> FedAvgM / FedAdam / FedYogi.
The client half sends its updated trainable parameters; the server forms the sample-weighted mean
delta (paper 000, Eq. 5) and applies its optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms.base import (
    Arrays,
    ClientAlgorithm,
    ClientContext,
    ServerAlgorithm,
    UpdateRejected,
    check_arrays,
)
from fedpeft.algorithms.fedavg.options import FedAdamOptions, FedAvgMOptions, FedAvgOptions
from fedpeft.algorithms.privacy import PrivateMean, clip, l2_norm
from fedpeft.algorithms.robust import robust_aggregate, round_report
from fedpeft.config.schema import AlgorithmOptions
from fedpeft.tuners.lora_factors import aggregation_error, lora_pairs
from fedpeft.wire import Payload

# The options of a FedAvg-family algorithm (server_lr, dp, robust): FedAvg's, FedAvgM's, FedAdam's, FedProx's, ...
FedAvgFamilyT = TypeVar("FedAvgFamilyT", bound=AlgorithmOptions)


class FedAvgServer(ServerAlgorithm[FedAvgFamilyT]):
    def __init__(self, options: FedAvgFamilyT, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        dp = getattr(options, "dp", None)
        self.private = (PrivateMean(dp, num_clients=self.num_clients, clients_per_round=self.clients_per_round)
                        if dp is not None else None)
        self.lora_pairs = lora_pairs(self.global_state)  # LoRA factors, when the PEFT method is LoRA
        self.robust = getattr(options, "robust", None)  # a Byzantine-robust rule in place of the weighted mean
        self.robust_report: dict[str, Any] = {}

    def validate(self, rnd: int, payload: Payload) -> None:
        super().validate(rnd, payload)
        p = self.private
        if p is not None and p.options.clipping == "client":
            norm = l2_norm(A.deltas(self.global_state, payload.arrays))
            if norm > p.options.clipping_norm * (1 + 1e-4) + 1e-6:
                raise UpdateRejected(f"update norm {norm:.6g} exceeds algorithm.dp.clipping_norm "
                                     f"{p.options.clipping_norm:g} (clients must clip)")

    def pseudo_gradient(self, updates: dict[int, Payload]) -> A.Arrays:
        ids = sorted(updates)
        ds = [A.deltas(self.global_state, updates[c].arrays) for c in ids]
        if self.private is not None:  # clipped, unweighted, fixed denominator, Gaussian noise
            return self.private.mean(ds)
        weights = [updates[c].meta["num_examples"] for c in ids]
        if self.robust is not None:
            result = robust_aggregate(ds, weights, self.robust)
            self.robust_report = round_report(result, ids)
            return result.aggregate
        return A.weighted_mean(ds, weights)

    def select(self, rnd: int) -> list[int]:
        if self.private is None:
            return super().select(rnd)
        # under differential privacy the sample must be secret from clients (who know the seed)
        return sorted(int(c) for c in self.private.sampler.choice(self.num_clients, self.clients_per_round,
                                                                   replace=False))

    def stop_reason(self) -> str | None:
        if self.private is not None and not self.private.budget_left():
            return (f"one more round would exceed algorithm.dp.max_epsilon={self.private.options.max_epsilon:g} "
                    f"(spent: epsilon {self.private.spent()['dp_epsilon']} at delta {self.private.options.target_delta:g})")
        return None

    def round_info(self) -> dict[str, Any]:
        info, self.robust_report = self.robust_report, {}
        return {**info, **(self.private.spent() if self.private is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.private is not None:
            state["privacy"] = self.private.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.private is not None:
            self.private.load_state_dict(state.get("privacy") or {})

    def step(self, d: A.Arrays, rnd: int) -> None:
        self.global_state = A.fedavg_step(self.global_state, d, self.options.server_lr)

    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        if not updates:
            return {"update_norm": 0.0}
        d = self.pseudo_gradient(updates)
        self.step(d, rnd)
        out = {"update_norm": l2_norm(d)}
        # the gap between averaging factors and averaging products is FedAvg's: not reported under DP (the clients'
        # own updates are not reported on) nor under a robust rule (which does not average)
        if self.lora_pairs and self.private is None and self.robust is None:
            ids = sorted(updates)
            out["lora_aggregation_error"] = aggregation_error(
                [updates[c].arrays for c in ids], [updates[c].meta["num_examples"] for c in ids], self.lora_pairs)
        return out

    def aggregate_mean(self, rnd: int, mean_update: dict[str, np.ndarray]) -> dict[str, float]:
        if self.private is not None or self.robust is not None:
            raise UpdateRejected("differential privacy and robust aggregation need each client's update, not their mean")
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
    """Load the global state, train locally, send the new trainable parameters back (with client-side
    differential privacy: the update clipped to algorithm.dp.clipping_norm first)."""

    def __init__(self, dp: Any = None):
        self.clip_norm = dp.clipping_norm if dp is not None and dp.clipping == "client" else None

    def extra_loss(self, payload: Payload, ctx: ClientContext):
        return None

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        ctx.tuned.load_state(payload.arrays)
        ctx.evaluate_personal()  # the personalized model of the FedAvg family: the global one
        result = ctx.train(extra_loss=self.extra_loss(payload, ctx))
        meta = {"round": payload.meta["round"], "client": ctx.client_id, "num_examples": ctx.num_examples,
                **result.as_meta()}
        state = ctx.tuned.state()
        if self.clip_norm is not None:
            delta = clip(A.deltas(payload.arrays, state), self.clip_norm)
            state = {k: (payload.arrays[k].astype(np.float32) + delta[k]).astype(np.float32) for k in payload.arrays}
        return Payload(state, meta)


def fedavg_client(options: FedAvgOptions | FedAvgMOptions | FedAdamOptions) -> FedAvgClient:
    """The client half of the FedAvg family: plain local training, clipped when ``options.dp`` asks."""
    return FedAvgClient(options.dp)
