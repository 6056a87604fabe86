"""LoRA products merged into the frozen backbone (FLoRA, FedEx-LoRA): the server keeps, per round, the
stacked factors whose product it merged into its own model, and sends each client the rounds its model may
lack; a model records the last round it holds, so that every process (the embedded runtime's one shared
model, each Flower SuperNode's) merges each round once, in order.

Payload arrays ``merge/<round>/<factor name>`` carry round ``<round>``'s stacked B (out x k) and A (k x in)
under the names of the module's LoRA factors; the payload's meta lists them (``merge_rounds``) and says
which round the model must hold afterwards (``merged_upto``). A client reports ``merged_through`` with its
update, which is where the server starts the next time it serves that client; a client that has failed once (it
may have lost its merged backbone: a restarted process, or a ClientApp process per message) gets the whole
history from then on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

import fedpeft
from fedpeft.algorithms.lora.common import pairs_in
from fedpeft.algorithms.lora.options import (
    MERGED_ADAPTER,  # noqa: F401 (re-exported)
    MergingOptions,
)
from fedpeft.tuners.lora_factors import LoraPair
from fedpeft.wire import Arrays

MERGED_ATTR = "_fedpeft_merged_through"  # on the torch module: the last round merged into its backbone
PREFIX = "merge/"


def merged_through(tuned: Any) -> int:
    return int(getattr(tuned.module, MERGED_ATTR, 0))


def array_name(rnd: int, factor: str) -> str:
    return f"{PREFIX}{rnd}/{factor}"


def merge_round(tuned: Any, pairs: list[LoraPair], factors: Mapping[str, np.ndarray], rnd: int) -> float:
    """Add scale x B_s A_s of round ``rnd`` to each adapted module's frozen weight (transposed where the
    layer stores it in x out, e.g. GPT-2's Conv1D); ``factors`` maps factor names to the stacked factors.
    Returns ||what the weights changed by - the product||_F / ||the product||_F: the rounding of adding a
    small update to float32 weights (about 1e-5 here), the part of the merge that is not exact."""
    err = ref = 0.0
    with torch.no_grad():
        for p in pairs:
            layer = tuned.module.get_submodule(p.module)
            adapter = p.adapter
            delta = np.asarray(factors[p.b], np.float64) @ np.asarray(factors[p.a], np.float64)
            delta *= float(layer.scaling[adapter])
            weight = layer.base_layer.weight
            update = torch.from_numpy(delta.T if getattr(layer, "fan_in_fan_out", False) else delta)
            before = weight.detach().to("cpu", torch.float64)
            weight.add_(update.to(device=weight.device, dtype=weight.dtype))
            err += float(((weight.detach().to("cpu", torch.float64) - before) - update).square().sum())
            ref += float(update.square().sum())
    setattr(tuned.module, MERGED_ATTR, rnd)
    return math.sqrt(err / ref) if ref > 0 else 0.0


MergingOptionsT = TypeVar("MergingOptionsT", bound=MergingOptions)


class MergingServer(fedpeft.ServerAlgorithm[MergingOptionsT]):
    """Keeps the history of merged rounds, merges each into the server's model, serves clients the rounds
    they lack; subclasses say what each round stacks (:meth:`round_stack`) and what else travels."""

    state_attrs = ("global_state", "history", "synced", "stateless")

    @classmethod
    def runtime_needs(cls, options: MergingOptionsT) -> fedpeft.RuntimeNeeds:
        return fedpeft.RuntimeNeeds(server_model=True)  # the global model is the merged backbone

    def __init__(self, options: MergingOptionsT, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        if self.server_model is None:
            raise ValueError(f"{options.name} needs the server's model (the runtime passes it as server_model)")
        self.pairs = pairs_in(self.global_state, options.name)
        self.factor_names = {n for p in self.pairs for n in (p.a, p.b)}
        self.history: dict[int, dict[str, np.ndarray]] = {}  # round -> stacked factors by factor name
        self.synced: dict[int, int] = {}  # client -> the last round its model reported holding
        # clients that have failed: sent the whole history from then on (a ClientApp process per message, or
        # a replaced node, holds none of it)
        self.stateless: list[int] = []

    def sent_state(self) -> dict[str, np.ndarray]:
        """What every selected client receives besides the merges (default: the global state)."""
        return self.global_state

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        """The sent state and the stacks of every round since the client last reported."""
        state, last = self.sent_state(), max(self.history, default=0)
        out = {}
        for c in clients:
            start = 0 if c in self.stateless else self.synced.get(c, 0)
            rounds = [r for r in sorted(self.history) if r > start]
            merges = {array_name(r, k): v for r in rounds for k, v in self.history[r].items()}
            out[c] = fedpeft.Payload({**state, **merges}, {"round": rnd, "client": c, "merge_rounds": rounds,
                                                            "merged_upto": last})
        return out

    def validate(self, rnd: int, payload: fedpeft.Payload) -> None:
        super().validate(rnd, payload)
        self.check_merged_through(rnd, payload)

    @staticmethod
    def check_merged_through(rnd: int, payload: fedpeft.Payload) -> None:
        m = payload.meta.get("merged_through")
        # up to the previous round: a node that outlived a server restart may hold rounds the server runs again
        # (seeded, they merge the same stacks)
        if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < rnd:
            raise fedpeft.UpdateRejected(f"merged_through {m!r} is not a round before round {rnd}")

    def record(self, rnd: int, factors: dict[str, np.ndarray], updates: Mapping[int, fedpeft.Payload]) -> float:
        """Keep round ``rnd``'s stacked factors, merge them into the server's model, note what clients hold;
        returns the merge's rounding error (see :func:`merge_round`)."""
        self.history[rnd] = factors
        model = self.server_model.tuned
        error = 0.0
        if merged_through(model) < rnd:  # (the embedded runtime's clients share this model)
            error = merge_round(model, self.pairs, factors, rnd)
        for c, p in updates.items():
            self.synced[c] = int(p.meta["merged_through"])
        return error

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        for c in failures:  # it may have lost its merged backbone: send it everything from now on
            self.synced.pop(c, None)
            if c not in self.stateless:
                self.stateless = sorted([*self.stateless, c])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.history = {int(r): dict(f) for r, f in self.history.items()}
        self.synced = {int(c): int(r) for c, r in self.synced.items()}
        self.stateless = [int(c) for c in self.stateless]
        model = self.server_model.tuned
        for r in sorted(self.history):  # a rebuilt model holds none of them
            if r > merged_through(model):
                merge_round(model, self.pairs, self.history[r], r)


def merge_missing(ctx: fedpeft.ClientContext, payload: fedpeft.Payload, pairs: list[LoraPair], name: str) -> int:
    """Merge the rounds of ``payload`` the client's model lacks; returns the last round it then holds."""
    have = merged_through(ctx.tuned)
    for r in payload.meta["merge_rounds"]:
        if r <= have:
            continue  # merged already (the embedded runtime's shared model, or another client of this process)
        if r != have + 1:
            break
        merge_round(ctx.tuned, pairs, {k: payload.arrays[array_name(r, k)] for p in pairs for k in (p.a, p.b)}, r)
        have = r
    if have < payload.meta["merged_upto"]:
        raise ValueError(f"{name}: client {ctx.client_id}'s model holds the merged rounds up to {have} but the server "
                         f"sent rounds {payload.meta['merge_rounds']} (it lost its merged backbone, e.g. a restarted "
                         "process); the server sends the whole history the next time")
    return have
