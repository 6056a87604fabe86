"""Clients with different LoRA ranks: HetLoRA (zero-padding) and FlexLoRA (SVD redistribution).

Every process builds the model at ``peft.r``, the largest rank of the federation. A client of rank
``r_i < peft.r`` receives the first ``r_i`` rows of each A and columns of each B, loads them with the other
components at zero and trains: a component whose row of A and column of B are both zero gets no gradient
(each factor's gradient there is the other factor's component), so it stays exactly zero under SGD, Adam
and weight decay and the client trains a rank-``r_i`` LoRA. It sends back only its ``r_i`` components, so
bytes each way grow with its rank. All ranks use the scale ``alpha / peft.r``.

* ``hetlora`` (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models",
  EMNLP 2024): the server zero-pads every client's factors to ``peft.r`` and averages A and B separately,
  each client weighted by the Frobenius norm of its update B_i A_i per module (the paper's
  sparsity-weighted aggregation; ``weighting: examples`` weighs by training examples instead); a client
  gets the first ``r_i`` components back. The paper's rank self-pruning is not implemented.
* ``flexlora`` (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and
  Client Resources", NeurIPS 2024): the server forms the sample-weighted mean of the clients' products
  sum_i w_i B_i A_i per module, takes its SVD U S V^T and gives each client the best rank-``r_i``
  factorisation, B = U_r sqrt(S_r), A = sqrt(S_r) V_r^T (the global model keeps rank ``peft.r``).

Ranks come from ``rank_groups`` (shares of the federation, assigned to clients by a seeded permutation)
or ``client_ranks`` (client id -> rank, for the clients it names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.common import assign_ranks, pairs_in, round_meta, spec_at_rank
from fedpeft.algorithms.lora.factors import (
    LoraPair,
    aggregation_gap,
    pad_rank,
    sum_norm,
    svd_factors,
    truncate_rank,
    weighted_product,
)
from fedpeft.algorithms.lora.hetero.options import (
    FlexLoraOptions,
    HeteroRankOptions,
    HetLoraOptions,
)
from fedpeft.wire import Arrays

HeteroRankOptionsT = TypeVar("HeteroRankOptionsT", bound=HeteroRankOptions)


class HeteroRankServer(fedpeft.ServerAlgorithm[HeteroRankOptionsT]):
    """Shared by hetlora and flexlora: per-client ranks, truncated payloads, per-client update shapes; the
    tensors that are not LoRA factors (the task head) are averaged by examples."""

    def __init__(self, options: HeteroRankOptionsT, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        self.pairs = pairs_in(self.global_state, options.name)
        self.max_rank = int(self.global_state[self.pairs[0].a].shape[0])
        self.ranks = assign_ranks(self.num_clients, options.rank_groups, self.seed, options.client_ranks)
        if max(self.ranks) > self.max_rank:
            raise ValueError(f"algorithm {options.name}: rank {max(self.ranks)} exceeds the model's LoRA rank "
                             f"{self.max_rank} (peft.r)")
        self.a_names = {p.a for p in self.pairs}
        self.b_names = {p.b for p in self.pairs}
        self.others = sorted(set(self.global_state) - self.a_names - self.b_names)
        self.selected: list[int] = []

    def at_rank(self, state: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """``state`` with every factor cut to its first ``rank`` components."""
        out = {k: state[k] for k in self.others}
        for p in self.pairs:
            out[p.a] = truncate_rank(state[p.a], rank, is_a=True)
            out[p.b] = truncate_rank(state[p.b], rank, is_a=False)
        return out

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        self.selected = list(clients)
        return {c: fedpeft.Payload(self.client_state(c), {"round": rnd, "client": c, "rank": self.ranks[c]})
                for c in clients}

    def client_state(self, client: int) -> dict[str, np.ndarray]:
        """What ``client`` receives: the global state at its rank."""
        return self.at_rank(self.global_state, self.ranks[client])

    def validate_from(self, rnd: int, client: int, payload: fedpeft.Payload) -> None:
        fedpeft.check_update(payload, spec_at_rank(self.expected, self.pairs, self.ranks[client]), rnd)

    def padded(self, update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: update[k] for k in self.others}
        for p in self.pairs:
            out[p.a] = pad_rank(update[p.a], self.max_rank, is_a=True)
            out[p.b] = pad_rank(update[p.b], self.max_rank, is_a=False)
        return out

    def mean_others(self, updates: Mapping[int, fedpeft.Payload]) -> None:
        if self.others:
            ids = sorted(updates)
            self.global_state.update(weighted_mean([{k: updates[c].arrays[k] for k in self.others} for c in ids],
                                                   [updates[c].meta["num_examples"] for c in ids]))

    def round_info(self) -> dict[str, Any]:
        return {"client_rank": {str(c): self.ranks[c] for c in self.selected}}


    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {}
        ids = sorted(updates)
        metrics = self.combine([self.padded(updates[c].arrays) for c in ids],
                               [updates[c].meta["num_examples"] for c in ids])
        self.mean_others(updates)
        return metrics

    def combine(self, states: list[dict[str, np.ndarray]], examples: list[int]) -> dict[str, float]:
        """Set the global LoRA factors from the clients' factors padded to peft.r; the aggregation metrics."""
        raise NotImplementedError


class HetLoraServer(HeteroRankServer[HetLoraOptions]):
    def combine(self, states: list[dict[str, np.ndarray]], examples: list[int]) -> dict[str, float]:
        err = ref = 0.0
        for p in self.pairs:
            if self.options.weighting == "norm":
                w = np.asarray([sum_norm([(1.0, s[p.b], s[p.a])]) for s in states])
                w = w if w.sum() > 0 else np.ones(len(states))  # no client moved this module yet
            else:
                w = np.asarray(examples, dtype=np.float64)
            w = w / w.sum()
            e, r = aggregation_gap(states, w, p)  # with the weights this module is averaged with
            err, ref = err + e, ref + r
            self.global_state[p.a] = np.asarray(sum(wi * s[p.a].astype(np.float64) for wi, s in zip(w, states)),
                                                dtype=np.float32)
            self.global_state[p.b] = np.asarray(sum(wi * s[p.b].astype(np.float64) for wi, s in zip(w, states)),
                                                dtype=np.float32)
        return {"lora_aggregation_error": float(np.sqrt(err / ref)) if ref > 0 else 0.0}


class FlexLoraServer(HeteroRankServer[FlexLoraOptions]):
    def combine(self, states: list[dict[str, np.ndarray]], examples: list[int]) -> dict[str, float]:
        err = ref = 0.0
        for p in self.pairs:
            product = weighted_product(states, examples, p)
            b, a = svd_factors(product, self.max_rank)
            self.global_state[p.a], self.global_state[p.b] = a, b
            err += float(np.sum((product - b.astype(np.float64) @ a.astype(np.float64)) ** 2))
            ref += float(np.sum(product ** 2))
        # a client's share is the first r_i SVD components (sorted by singular value): the best rank-r_i
        # factorisation of the mean product. The error reported: the global rank's relative truncation error
        return {"lora_aggregation_error": float(np.sqrt(err / ref)) if ref > 0 else 0.0}


class HeteroRankClient(fedpeft.ClientAlgorithm):
    """Load the received rank-r_i factors with the remaining components at zero, train, send r_i back."""

    def __init__(self, options: HeteroRankOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        rank = int(payload.meta["rank"])
        pairs: list[LoraPair] = pairs_in(ctx.tuned.params, self.options.name)
        full = int(ctx.tuned.params[pairs[0].a].shape[0])
        arrays = dict(payload.arrays)
        for p in pairs:
            arrays[p.a] = pad_rank(arrays[p.a], full, is_a=True)
            arrays[p.b] = pad_rank(arrays[p.b], full, is_a=False)
        ctx.tuned.load_state(arrays)
        ctx.evaluate_personal()  # the global model at the client's rank
        result = ctx.train()
        state = ctx.tuned.state()
        out = {k: state[k] for k in payload.arrays}
        for p in pairs:
            out[p.a] = truncate_rank(state[p.a], rank, is_a=True)
            out[p.b] = truncate_rank(state[p.b], rank, is_a=False)
        return fedpeft.Payload(out, round_meta(payload, ctx, result, rank=rank))


