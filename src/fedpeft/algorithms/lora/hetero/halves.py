"""Clients with different LoRA ranks: HetLoRA (zero-padding) and FlexLoRA (SVD redistribution).

Every process builds the model at ``peft.r``, the largest rank of the federation. A client of rank
``r_i < peft.r`` receives the first ``r_i`` rows of each A and columns of each B, loads them with the other
components at zero and trains: a component whose row of A and column of B are both zero gets no gradient
(each factor's gradient there is the other factor's component), so it stays exactly zero under SGD, Adam
and weight decay and the client trains a rank-``r_i`` LoRA. It sends back only its ``r_i`` components, so
bytes each way grow with its rank; the server reads the rank from the update's shapes.

* ``hetlora`` (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models",
  EMNLP 2024): the server zero-pads every client's factors to ``peft.r`` and averages A and B separately,
  each client weighted by the Frobenius norm of its update B_i A_i per module (the paper's
  sparsity-weighted aggregation; ``weighting: examples`` weighs by training examples instead); a client
  gets the first ``r_i`` components back. Rank self-pruning (``self_pruning``): local training penalises the
  trailing components, and a client whose trailing components shrank prunes its rank (:class:`HetLoraClient`).
  All ranks train at the scale ``alpha / peft.r``.
* ``flexlora`` (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and
  Client Resources", NeurIPS 2024): the server forms the sample-weighted mean of the clients' effective
  updates per module, takes its SVD U S V^T and gives each client the best rank-``r_i`` factorisation;
  ``factorization`` says how the factors and scales are set (:class:`FlexLoraServer`).

Ranks come from ``rank_groups`` (shares of the federation, assigned to clients by a seeded permutation)
or ``client_ranks`` (client id -> rank, for the clients it names)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.common import assign_ranks, pairs_in, round_meta, spec_at_rank
from fedpeft.algorithms.lora.hetero.options import (
    FlexLoraOptions,
    HeteroRankOptions,
    HetLoraOptions,
)
from fedpeft.tuners.lora_factors import (
    LoraPair,
    aggregation_gap,
    pad_rank,
    sum_norm,
    svd_factors,
    truncate_rank,
    weighted_product,
)
from fedpeft.wire import Arrays

HeteroRankOptionsT = TypeVar("HeteroRankOptionsT", bound=HeteroRankOptions)


class HeteroRankServer(fedpeft.ServerAlgorithm[HeteroRankOptionsT]):
    """Shared by hetlora and flexlora: per-client ranks, truncated payloads, per-client update shapes; the
    tensors that are not LoRA factors (the task head) are averaged by examples. A client's rank is read from the
    shapes of its update; one it may not send (:meth:`ranks_allowed`) is rejected."""

    state_attrs = ("global_state", "ranks")

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
        self.sent: dict[int, int] = {}  # this round's clients -> the rank they were served at

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "ranks" not in state:
            raise ValueError(f"the checkpoint of this {self.options.name} run was written before its clients' ranks "
                             "were saved (and before hetlora's self-pruning and flexlora's reference factorization, "
                             "which its config would now turn on): finish it with the fedpeft version that started "
                             "it, or start it again")
        ranks = [int(r) for r in state["ranks"]]
        if len(ranks) != self.num_clients or not all(1 <= r <= self.max_rank for r in ranks):
            raise ValueError(f"the checkpoint's client ranks {ranks} do not fit {self.num_clients} clients of rank "
                             f"1..{self.max_rank} (peft.r): it belongs to another federation")
        super().load_state_dict({**state, "ranks": ranks})

    def at_rank(self, state: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """``state`` with every factor cut to its first ``rank`` components."""
        out = {k: state[k] for k in self.others}
        for p in self.pairs:
            out[p.a] = truncate_rank(state[p.a], rank, is_a=True)
            out[p.b] = truncate_rank(state[p.b], rank, is_a=False)
        return out

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        self.sent = {c: self.ranks[c] for c in clients}
        return {c: fedpeft.Payload(self.client_state(c), {"round": rnd, "client": c, "rank": self.ranks[c]})
                for c in clients}

    def client_state(self, client: int) -> dict[str, np.ndarray]:
        """What ``client`` receives: the global state at its rank."""
        return self.at_rank(self.global_state, self.ranks[client])

    def ranks_allowed(self, client: int) -> list[int]:
        """The ranks ``client``'s update may have: the one it was served at."""
        return [self.ranks[client]]

    def update_rank(self, payload: fedpeft.Payload) -> int | None:
        """The rank of an update, read from its first A factor (every factor is then checked against it)."""
        a = payload.arrays.get(self.pairs[0].a)
        return int(a.shape[0]) if a is not None and a.ndim == 2 else None

    def validate_from(self, rnd: int, client: int, payload: fedpeft.Payload) -> None:
        rank, allowed = self.update_rank(payload), self.ranks_allowed(client)
        if rank is None:  # no readable A: check_update names what is missing or misshapen
            rank = self.ranks[client]
        elif rank not in allowed:
            raise fedpeft.UpdateRejected(f"{self.pairs[0].a}: an update of rank {rank} from client {client}, "
                                         f"which may send rank {' or '.join(map(str, allowed))}")
        fedpeft.check_update(payload, spec_at_rank(self.expected, self.pairs, rank), rnd)

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
        info: dict[str, Any] = {"client_rank": {str(c): r for c, r in self.sent.items()}}
        pruned = {str(c): self.ranks[c] for c, r in self.sent.items() if self.ranks[c] != r}
        if pruned:
            info["pruned_rank"] = pruned
        return info

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {}
        ids = sorted(updates)
        for c in ids:  # accepted, so a rank the client may send: it keeps it from now on
            self.ranks[c] = int(updates[c].arrays[self.pairs[0].a].shape[0])
        metrics = self.combine_factors([self.padded(updates[c].arrays) for c in ids],
                               [updates[c].meta["num_examples"] for c in ids], [self.ranks[c] for c in ids])
        self.mean_others(updates)
        return metrics

    def combine_factors(self, states: list[dict[str, np.ndarray]], examples: list[int], ranks: list[int]
                        ) -> dict[str, float]:
        """Set the global LoRA factors from the clients' factors padded to peft.r (trained at ``ranks``); the
        aggregation metrics."""
        raise NotImplementedError


class HetLoraServer(HeteroRankServer[HetLoraOptions]):
    def ranks_allowed(self, client: int) -> list[int]:
        """Its rank, or under self-pruning the rank it may prune to this round."""
        pruned = self.options.pruned_rank(self.ranks[client])
        return [self.ranks[client]] + ([pruned] if pruned is not None else [])

    def combine_factors(self, states: list[dict[str, np.ndarray]], examples: list[int], ranks: list[int]
                        ) -> dict[str, float]:
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
    """Under ``factorization: reference`` a client of rank r_i trains at the scale alpha / r_i, i.e. (R / r_i) times
    the model's alpha / R (R = peft.r): its effective update is (R / r_i) s_R B_i A_i. The server averages those,
    M = sum_i w_i (R / r_i) B_i A_i (in units of s_R), keeps the global B = U_R S_R, A = V_R^T, and serves client i
    A = V_{r_i}^T and B = (r_i / R) U_{r_i} S_{r_i}, so that its scaled product is the rank-r_i truncation of M.
    Under ``balanced`` every rank trains at alpha / R and the singular values are split as sqrt(S) into both
    factors."""

    def reference(self) -> bool:
        return self.options.factorization == "reference"

    def client_state(self, client: int) -> dict[str, np.ndarray]:
        state = super().client_state(client)
        if self.reference():
            ratio = np.float32(self.ranks[client] / self.max_rank)  # 1 / (R / r_i): the client's larger scale
            for p in self.pairs:
                state[p.b] = state[p.b] * ratio
        return state

    def combine_factors(self, states: list[dict[str, np.ndarray]], examples: list[int], ranks: list[int]
                        ) -> dict[str, float]:
        err = ref = 0.0
        scales = [self.max_rank / r for r in ranks] if self.reference() else None
        for p in self.pairs:
            product = weighted_product(states, examples, p, scales)
            b, a = svd_factors(product, self.max_rank, split="b" if self.reference() else "sqrt")
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
        with self.scaled(ctx, pairs, full / rank):
            ctx.evaluate_personal()  # the global model at the client's rank
            result, rank = self.train(ctx, pairs, rank)
        state = ctx.tuned.state()
        out = {k: state[k] for k in payload.arrays}
        for p in pairs:
            out[p.a] = truncate_rank(state[p.a], rank, is_a=True)
            out[p.b] = truncate_rank(state[p.b], rank, is_a=False)
        return fedpeft.Payload(out, round_meta(payload, ctx, result, rank=rank))

    def scaled(self, ctx: fedpeft.ClientContext, pairs: list[LoraPair], ratio: float) -> contextlib.AbstractContextManager:
        """The LoRA scale a client of this rank trains at (here: the model's own, alpha / peft.r)."""
        return contextlib.nullcontext()

    def train(self, ctx: fedpeft.ClientContext, pairs: list[LoraPair], rank: int) -> tuple[Any, int]:
        """Local training; (its result, the rank the client sends back)."""
        return ctx.train(), rank


@contextlib.contextmanager
def lora_scale(tuned: Any, pairs: list[LoraPair], ratio: float) -> Iterator[None]:
    """Every adapted layer of ``tuned`` at ``ratio`` times its configured scale (peft's ``set_scale``), restored
    afterwards."""
    saved = []
    for p in pairs:
        layer = tuned.module.get_submodule(p.module)
        adapter = p.adapter
        saved.append((layer, adapter, layer.scaling[adapter]))
        layer.set_scale(adapter, ratio)
    try:
        yield
    finally:
        for layer, adapter, scale in saved:
            layer.scaling[adapter] = scale


class FlexLoraClient(HeteroRankClient):
    """FlexLoRA's reference scale: a client of rank r_i trains at alpha / r_i. The scale is an attribute of the
    shared model's layers, so clients of different ranks cannot share a fused pass."""

    trains_batched = False

    def scaled(self, ctx: fedpeft.ClientContext, pairs: list[LoraPair], ratio: float) -> contextlib.AbstractContextManager:
        return lora_scale(ctx.tuned, pairs, ratio)


def flexlora_client(options: FlexLoraOptions) -> HeteroRankClient:
    """FlexLoRA's client half: per-rank scale under ``factorization: reference``, the model's own otherwise."""
    return FlexLoraClient(options) if options.factorization == "reference" else HeteroRankClient(options)


def tail_norm(params: Mapping[str, torch.Tensor], pairs: list[LoraPair], start: int, rank: int) -> torch.Tensor:
    """sum over modules of ||B[:, start:rank]||_F ||A[start:rank, :]||_F: the size of the trailing components
    (HetLoRA's self-pruning regulariser, an upper bound on sum ||B_tail A_tail||_F)."""
    return sum((torch.linalg.vector_norm(params[p.b][:, start:rank]) * torch.linalg.vector_norm(params[p.a][start:rank])
                for p in pairs), torch.zeros(()))


class HetLoraClient(HeteroRankClient):
    """HetLoRA's rank self-pruning (``self_pruning: true``): local training adds ``regularization`` times the
    trailing components' size (:func:`tail_norm`, components floor(decay r) .. r); if that size ends the round
    below where it started (or below ``threshold``), the client prunes to rank floor(decay r) and sends only
    those components."""

    options: HetLoraOptions

    def train(self, ctx: fedpeft.ClientContext, pairs: list[LoraPair], rank: int) -> tuple[Any, int]:
        pruned = self.options.pruned_rank(rank)
        if pruned is None:
            return ctx.train(), rank
        params = ctx.tuned.params
        start = float(tail_norm(params, pairs, pruned, rank).detach())
        lam = self.options.regularization

        def regulariser() -> torch.Tensor:
            return lam * tail_norm(params, pairs, pruned, rank)

        result = ctx.train(extra_loss=regulariser if lam > 0 else None)
        end = float(tail_norm(ctx.tuned.params, pairs, pruned, rank).detach())
        limit = start if self.options.threshold is None else self.options.threshold
        return result, (pruned if end < limit else rank)
