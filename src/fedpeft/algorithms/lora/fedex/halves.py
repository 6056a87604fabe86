"""FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient Fine-Tuning of
Foundation Models", 2024/2025): FedAvg of A and B, plus the residual the averages miss,
sum_i w_i B_i A_i - (sum_i w_i B_i)(sum_i w_i A_i), added to the frozen weights, so that the global model
is exactly the mean of the clients' models.

The residual travels in low rank: stacked as [w_1 B_1, ..., w_K B_K, -B_mean] times [A_1; ...; A_K; A_mean]
(rank (K+1) r), kept per round and sent to each client with the rounds its model lacks (see :mod:`.merge`).
"""

from __future__ import annotations

import math

import numpy as np

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.common import pairs_in, round_meta
from fedpeft.algorithms.lora.fedex.options import NAME, FedExLoraOptions
from fedpeft.algorithms.lora.merge import (
    MergingServer,
    merge_missing,
)
from fedpeft.tuners.lora_factors import aggregation_error, stack, sum_norm


class FedExLoraServer(MergingServer[FedExLoraOptions]):
    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {}
        ids = sorted(updates)
        n = [updates[c].meta["num_examples"] for c in ids]
        w = np.asarray(n, dtype=np.float64) / sum(n)
        mean = weighted_mean([updates[c].arrays for c in ids], n)
        residual, err, ref = {}, 0.0, 0.0
        for p in self.pairs:
            blocks = [(float(wi), updates[c].arrays[p.b], updates[c].arrays[p.a]) for wi, c in zip(w, ids)]
            blocks.append((-1.0, mean[p.b], mean[p.a]))
            residual[p.b], residual[p.a], e = stack(blocks)
            err, ref = err + e * e, ref + sum_norm(blocks[:-1]) ** 2
        gap = aggregation_error([updates[c].arrays for c in ids], n, self.pairs)  # what FedAvg alone would miss
        self.global_state = mean
        merge_error = self.record(rnd, residual, updates)
        return {"lora_aggregation_error": math.sqrt(err / ref) if ref > 0 else 0.0, "lora_residual": gap,
                "lora_merge_error": merge_error}


class FedExLoraClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: FedExLoraOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        pairs = pairs_in(ctx.tuned.params, NAME)
        held = merge_missing(ctx, payload, pairs, NAME)
        ctx.tuned.load_state({k: v for k, v in payload.arrays.items() if not k.startswith("merge/")})
        ctx.evaluate_personal()  # the global model: merged residuals plus the averaged factors
        result = ctx.train()
        return fedpeft.Payload(ctx.tuned.state(), round_meta(payload, ctx, result, merged_through=held))


