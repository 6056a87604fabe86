"""The options of the flora federated LoRA method."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from fedpeft.algorithms.lora.options import (
    MERGED_ADAPTER,
    MergingOptions,
    RankGroup,
    check_ranks,
)

NAME = "flora"


class FLoraOptions(MergingOptions):
    """algorithm: {name: flora}: stacking aggregation, merged into the backbone every round."""

    name: Literal["flora"] = "flora"
    adapter_incomplete: ClassVar[str | None] = MERGED_ADAPTER.format(name="flora")
    update_poisoning_unavailable: ClassVar[str | None] = (
        "its clients train fresh LoRA factors the server never sends, so there is no received tensor to change")
    rank_groups: list[RankGroup] | None = Field(
        None, min_length=1, description="Ranks and the share of clients at each, as hetlora's (assigned by a seeded "
        "permutation); default: every client at peft.r (the paper's homogeneous setting).")
    client_ranks: dict[int, int] = Field(
        default_factory=dict, description="Client id -> rank, overriding rank_groups for those clients (the "
        "reference's --heter: {0: 64, 1: 32, 2: 16, 3: 16, 4: 8, 5: 8, 6: 4, 7: 4, 8: 4, 9: 4} with peft.r 64 "
        "and peft.alpha 128).")

    def check(self, run: Any) -> None:
        super().check(run)
        check_ranks(run, self.name, self.rank_groups or [], self.client_ranks)
