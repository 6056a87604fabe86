"""The options of the hetero federated LoRA methods (hetlora, flexlora)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from fedpeft.algorithms.lora.options import (
    require_lora,
)
from fedpeft.config.schema import AlgorithmOptions


class RankGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=1, description="LoRA rank of the clients in this group.")
    share: float = Field(gt=0, le=1, description="Share of the federation's clients in this group.")


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
        total = sum(g.share for g in self.rank_groups)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"algorithm.rank_groups: the shares sum to {total:g}; make them sum to 1")
        ranks = [g.rank for g in self.rank_groups] + list(self.client_ranks.values())
        if max(ranks) > run.peft.r or min(ranks) < 1:
            raise ValueError(f"algorithm {self.name}: ranks {sorted(set(ranks))} must lie in 1..peft.r "
                             f"({run.peft.r}); set peft.r to the largest rank of the federation")
        n = run.federation.num_clients
        bad = sorted(c for c in self.client_ranks if not 0 <= c < n)
        if bad:
            raise ValueError(f"algorithm.client_ranks: client {bad[0]} does not exist "
                             f"(federation.num_clients is {n}: ids 0..{n - 1})")


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
