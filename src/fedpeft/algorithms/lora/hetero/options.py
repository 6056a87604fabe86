"""The options of the hetero federated LoRA methods (hetlora, flexlora)."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field

from fedpeft.algorithms.lora.options import (
    RankGroup,
    check_ranks,
    require_lora,
)
from fedpeft.config.schema import AlgorithmOptions


class HeteroRankOptions(AlgorithmOptions):
    """The resource profile shared by hetlora and flexlora."""
    asynchronous_unavailable: ClassVar[str | None] = (
        "it re-factorizes the products of one round's clients of different ranks")

    supports_personalized_eval: ClassVar[bool] = True
    robust_unavailable: ClassVar[str] = "its clients send factors of different ranks, which no coordinate-wise rule compares"

    rank_groups: list[RankGroup] = Field(
        default_factory=lambda: [RankGroup(rank=r, share=1 / 3) for r in (4, 8, 16)], min_length=1,
        description="Ranks and the share of clients at each (default: ranks 4, 8 and 16 in thirds, with peft.r's "
        "default 16); shares sum to 1; assigned to clients by a seeded permutation.")
    client_ranks: dict[int, int] = Field(default_factory=dict,
                                         description="Client id -> rank, overriding rank_groups for those clients.")

    def check(self, run: Any) -> None:
        require_lora(run, self.name)
        check_ranks(run, self.name, self.rank_groups, self.client_ranks)


class HetLoraOptions(HeteroRankOptions):
    """HetLoRA: clients of different LoRA ranks, zero-padded and averaged with norm weights; each client may prune
    its own rank (self-pruning).

    algorithm: {name: hetlora, rank_groups: [...], weighting: norm, self_pruning: true, decay: 0.99}"""

    name: Literal["hetlora"] = "hetlora"
    weighting: Literal["norm", "examples"] = Field(
        "norm", description="norm: each client weighted by ||B_i A_i||_F per module (HetLoRA's sparsity-weighted "
        "aggregation); examples: by its training examples.")
    self_pruning: bool = Field(
        True, description="Rank self-pruning: local training penalises the trailing components "
        "floor(decay r)..r of a rank-r client, and a client whose trailing components end the round smaller than "
        "they started (or below `threshold`) prunes to rank floor(decay r) for good (never below 1).")
    decay: float = Field(0.99, gt=0, lt=1, description="HetLoRA's decay factor gamma: the share of the rank kept "
                         "when a client prunes.")
    regularization: float = Field(1e-3, ge=0, description="HetLoRA's lambda: the weight of the trailing "
                                  "components' size, sum over modules of ||B_tail||_F ||A_tail||_F, in the loss.")
    threshold: float | None = Field(
        None, ge=0, description="When a client prunes: null, when its trailing components' size ends local training "
        "below where it started (the model the previous round produced); a number, when that size ends below it.")

    def pruned_rank(self, rank: int) -> int | None:
        """The rank a client of ``rank`` prunes to, or None when it cannot prune (self-pruning off, or rank 1)."""
        pruned = math.floor(self.decay * rank + 1e-9)  # (0.29 x 100 is 28.999... in floating point)
        return pruned if self.self_pruning and 1 <= pruned < rank else None


class FlexLoraOptions(HeteroRankOptions):
    """FlexLoRA: clients of different LoRA ranks; the averaged product is redistributed by SVD.

    algorithm: {name: flexlora, rank_groups: [...], factorization: reference}"""

    name: Literal["flexlora"] = "flexlora"
    factorization: Literal["reference", "balanced"] = Field(
        "reference", description="reference (FlexLoRA's code): a rank-r_i client trains at the scale alpha / r_i; "
        "the server averages the scaled products and gives B the singular values (A = V^T, orthonormal rows). "
        "balanced: every rank trains at alpha / peft.r and B and A each get sqrt(S). The products agree; the "
        "factors, and so local training, differ. Under reference a fused pass cannot mix scales: the clients "
        "train one at a time.")
