"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025).

The A factors are shared and averaged; each client keeps its own B, and by default its own task head
(``local_head``: the reference code keeps ``lora_B`` and ``classifier`` local for classification; the
paper's text speaks of B only), which never leave it. They live in the client's per-client state
(``ctx.state``, as FedPepTAO keeps its personal prompt layers): one float32 copy per client that has trained.
Until the server has accepted an update of a client, it sends that client the initial B and head (the seeded
initialisation) with the shared part; a client trains on its own whenever it has them.

The global model the server evaluates is the shared part with the initial B (and head); the method's own
score is each client's model with its own (``eval.personalized``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import fedpeft
from fedpeft.algorithms.lora.common import (
    MeanStepServer,
    pairs_in,
    round_meta,
)
from fedpeft.algorithms.lora.fedsa.options import KEPT, NAME, FedSaLoraOptions
from fedpeft.wire import Arrays


def kept_names(names: Iterable[str], options: FedSaLoraOptions) -> set[str]:
    """The tensors that stay on each client: every LoRA B, and under ``local_head`` the task head (the modules
    peft trains whole, ``modules_to_save``)."""
    names = list(names)
    kept = {p.b for p in pairs_in(names, NAME)}
    if options.local_head:
        kept |= {n for n in names if "modules_to_save" in n.split(".")}
    return kept


class FedSaLoraServer(MeanStepServer[FedSaLoraOptions]):
    state_attrs = ("global_state", "served")

    def __init__(self, options: FedSaLoraOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        self.kept = kept_names(self.global_state, options)
        self.shared = {k: spec for k, spec in self.expected.items() if k not in self.kept}
        self.served: list[int] = []  # clients whose update was accepted, so they hold a B of their own

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        shared = {k: self.global_state[k] for k in self.shared}
        out = {}
        for c in clients:
            first = c not in self.served
            arrays = {**shared, **{k: self.global_state[k] for k in self.kept}} if first else shared
            out[c] = fedpeft.Payload(arrays, {"round": rnd, "client": c})
        return out

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        # it may have lost its B (a replaced node): it gets the initial one again (one it still has wins)
        self.served = [c for c in self.served if c not in failures]

    def validate(self, rnd: int, payload: fedpeft.Payload) -> None:
        fedpeft.check_update(payload, self.shared, rnd)  # a B in the update is refused as unknown

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {"update_norm": 0.0}
        self.served = sorted(set(self.served) | set(updates))
        return {"update_norm": self.step_on(rnd, updates, self.shared)}


class FedSaLoraClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: FedSaLoraOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        names = kept_names(ctx.tuned.params, self.options)
        shared = {k: v for k, v in payload.arrays.items() if k not in names}
        kept = ctx.state.get(KEPT)  # its own B (and head), when it has trained before
        if kept is None:
            if not names <= set(payload.arrays):
                raise ValueError(f"fedsa_lora: client {ctx.client_id} holds no LoRA B (and task head) of its own "
                                 "(its state was lost, e.g. a restarted client process) and the server did not send "
                                 "the initial ones; it gets them with its next payload")
            kept = {k: payload.arrays[k] for k in names}
        ctx.tuned.load_state({**shared, **kept})
        ctx.evaluate_personal()  # the global A with the client's own B (and head)
        result = ctx.train()
        state = ctx.tuned.state()
        ctx.state[KEPT] = {k: state[k] for k in names}
        return fedpeft.Payload({k: state[k] for k in shared}, round_meta(payload, ctx, result))

    def personal_state(self, global_state: Arrays, state: dict[str, Any]) -> Arrays | None:
        kept = state.get(KEPT)  # None: it never trained, so its model is the shared part with the initial B
        return None if kept is None else {**global_state, **kept}


