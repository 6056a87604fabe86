"""The options of the hetero federated LoRA methods (hetlora, flexlora)."""

from __future__ import annotations

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
    """HetLoRA: clients of different LoRA ranks, zero-padded and averaged with norm weights.

    algorithm: {name: hetlora, rank_groups: [...], weighting: norm}"""

    name: Literal["hetlora"] = "hetlora"
    weighting: Literal["norm", "examples"] = Field(
        "norm", description="norm: each client weighted by ||B_i A_i||_F per module (HetLoRA's sparsity-weighted "
        "aggregation); examples: by its training examples.")


class FlexLoraOptions(HeteroRankOptions):
    """FlexLoRA: clients of different LoRA ranks; the averaged product is redistributed by SVD.

    algorithm: {name: flexlora, rank_groups: [...]}"""

    name: Literal["flexlora"] = "flexlora"
