"""FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024).

Every client's A factors stay frozen at the initialisation all processes draw from the run's seed; only B
(and the task head) train and travel, both ways. With one A for everyone, averaging B averages the
clients' updates exactly: sum_i w_i B_i A = (sum_i w_i B_i) A. The server sends a digest of its A with
every payload and a client whose own A differs (another seed, model or LoRA option) refuses to train.
"""

from __future__ import annotations

from typing import Any

import fedpeft
from fedpeft.algorithms.lora.common import (
    MeanStepServer,
    digest,
    pairs_in,
    round_meta,
)
from fedpeft.algorithms.lora.ffa.options import NAME, FfaLoraOptions
from fedpeft.tuners.lora_factors import aggregation_error
from fedpeft.wire import Arrays


class FfaLoraServer(MeanStepServer[FfaLoraOptions]):
    def __init__(self, options: FfaLoraOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        self.pairs = pairs_in(self.global_state, NAME)
        self.frozen = {p.a for p in self.pairs}
        self.travel = {k: spec for k, spec in self.expected.items() if k not in self.frozen}
        self.frozen_digest = digest({k: self.global_state[k] for k in self.frozen})

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        arrays = {k: self.global_state[k] for k in self.travel}
        return {c: fedpeft.Payload(arrays, {"round": rnd, "client": c, "frozen_a_sha256": self.frozen_digest})
                for c in clients}

    def validate(self, rnd: int, payload: fedpeft.Payload) -> None:
        fedpeft.check_update(payload, self.travel, rnd)

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {"update_norm": 0.0}
        out: dict[str, float] = {}
        if self.combiner is None:  # the error describes the weighted mean, whose place a wrapper may take
            ids = sorted(updates)
            states = [{**self.global_state, **updates[c].arrays} for c in ids]  # the frozen A with each client's B
            out["lora_aggregation_error"] = aggregation_error(
                states, [updates[c].meta["num_examples"] for c in ids], self.pairs)
        return {"update_norm": self.step_on(rnd, updates, self.travel), **out}


class FfaLoraClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: FfaLoraOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        params = ctx.tuned.params
        frozen = {p.a for p in pairs_in(params, NAME)}
        mine = digest({k: params[k].detach().float().cpu().numpy() for k in frozen})
        if mine != payload.meta.get("frozen_a_sha256"):
            raise ValueError(f"ffa_lora: client {ctx.client_id}'s frozen LoRA A differs from the server's; every "
                             "process must build the model from the same model.name, peft options and seed")
        for name in frozen:
            params[name].requires_grad_(False)  # no gradient: the optimizer skips it
        ctx.tuned.load_state(payload.arrays, partial=True)
        ctx.evaluate_personal()  # the global model (nothing is kept)
        result = ctx.train()
        state = ctx.tuned.state()
        return fedpeft.Payload({k: state[k] for k in payload.arrays}, round_meta(payload, ctx, result))


