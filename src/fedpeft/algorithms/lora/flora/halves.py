"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024): stacking aggregation.

Each round every selected client starts from freshly initialised LoRA factors (A drawn as PEFT draws it,
seeded by (seed, round, client); B zero) on the backbone with every earlier round merged in, trains, and
sends A_i, B_i and the task head. The server stacks them, B_s = [w_1 B_1, ..., w_K B_K] and
A_s = [A_1; ...; A_K] (w_i: the clients' example shares), so B_s A_s = sum_i w_i B_i A_i exactly, and merges
the product into the frozen weights of its model; the head is averaged.

Clients may have different ranks (``rank_groups`` / ``client_ranks``, as hetlora's; the paper's
heterogeneous setting). The model is built at ``peft.r``; a client of rank r_i draws A's first r_i rows and
keeps the others at zero, where they stay (a component whose row of A and column of B are zero gets no
gradient), and sends its first r_i components only: its upload follows its rank, its arithmetic is
``peft.r``'s (the zero components are computed). Every client trains at the scale alpha / ``peft.r``: the
reference's alpha_i = 2 r_i is the scale 2 for every rank, which is fedpeft's default alpha / r (32 / 16). A client receives the stacks of
every round since it last reported (see :mod:`.merge`), so downloads grow with the clients stacked and the
rounds the client missed. The backbone cannot be quantized (the product is added to its weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.common import assign_ranks, pairs_in, round_meta, spec_at_rank
from fedpeft.algorithms.lora.flora.options import NAME, FLoraOptions
from fedpeft.algorithms.lora.merge import (
    MergingServer,
    merge_missing,
)
from fedpeft.algorithms.lora.options import RankGroup
from fedpeft.tuners.lora_factors import stack, sum_norm, truncate_rank
from fedpeft.wire import Arrays


class FLoraServer(MergingServer[FLoraOptions]):
    def __init__(self, options: FLoraOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        full = int(self.global_state[self.pairs[0].a].shape[0])
        self.ranks = assign_ranks(self.num_clients, options.rank_groups or [RankGroup(rank=full, share=1.0)],
                                  self.seed, options.client_ranks)
        self.selected: list[int] = []

    @property
    def heterogeneous(self) -> bool:
        return self.options.rank_groups is not None or bool(self.options.client_ranks)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        self.selected = list(clients)
        out = super().configure(rnd, clients)
        if self.heterogeneous:  # (otherwise every client trains at peft.r, its model's rank)
            for c, payload in out.items():
                payload.meta["rank"] = self.ranks[c]
        return out

    def validate_from(self, rnd: int, client: int, payload: fedpeft.Payload) -> None:
        fedpeft.check_update(payload, spec_at_rank(self.expected, self.pairs, self.ranks[client]), rnd)
        self.check_merged_through(rnd, payload)

    def round_info(self) -> dict[str, Any]:
        if not self.heterogeneous:
            return {}
        return {"client_rank": {str(c): self.ranks[c] for c in self.selected}}

    def sent_state(self) -> dict[str, np.ndarray]:
        """The head only: clients start each round from fresh LoRA factors."""
        return {k: v for k, v in self.global_state.items() if k not in self.factor_names}

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {}
        ids = sorted(updates)
        n = np.asarray([updates[c].meta["num_examples"] for c in ids], dtype=np.float64)
        w = n / n.sum()
        factors, err, ref, width = {}, 0.0, 0.0, 0
        for p in self.pairs:
            blocks = [(float(wi), updates[c].arrays[p.b], updates[c].arrays[p.a]) for wi, c in zip(w, ids)]
            factors[p.b], factors[p.a], e = stack(blocks)
            err, ref, width = err + e * e, ref + sum_norm(blocks) ** 2, factors[p.a].shape[0]
        merge_error = self.record(rnd, factors, updates)
        others = sorted(set(self.global_state) - self.factor_names)
        if others:
            mean = weighted_mean([{k: updates[c].arrays[k] for k in others} for c in ids], list(n))
            self.global_state.update(mean)
        return {"lora_aggregation_error": math.sqrt(err / ref) if ref > 0 else 0.0, "stacked_rank": width,
                "lora_merge_error": merge_error}


class FLoraClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: FLoraOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        params = ctx.tuned.params
        pairs = pairs_in(params, NAME)
        rank = int(payload.meta.get("rank", params[pairs[0].a].shape[0]))
        held = merge_missing(ctx, payload, pairs, NAME)
        head = {k: v for k, v in payload.arrays.items() if not k.startswith("merge/")}
        ctx.tuned.load_state(head, partial=True)
        seed = ctx.resources.get("seed", 0)
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, ctx.round, ctx.client_id, 0xF10]).generate_state(1)[0]))
        with torch.no_grad():  # fresh factors, as PEFT initialises LoRA: A Kaiming-uniform, B zero
            for p in pairs:  # (the bound depends on A's input width only, so a rank-r_i A is its first rows)
                a = torch.empty(params[p.a].shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
                a[rank:] = 0.0
                params[p.a].copy_(a.to(params[p.a].device, params[p.a].dtype))
                params[p.b].zero_()
        ctx.evaluate_personal()  # the merged backbone with the global head: the global model
        result = ctx.train()
        state = ctx.tuned.state()
        for p in pairs:
            state[p.a] = truncate_rank(state[p.a], rank, is_a=True)
            state[p.b] = truncate_rank(state[p.b], rank, is_a=False)
        mine = {"rank": rank} if "rank" in payload.meta else {}
        return fedpeft.Payload(state, round_meta(payload, ctx, result, merged_through=held, **mine))


