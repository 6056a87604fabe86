"""The options of the flora federated LoRA method."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedpeft.algorithms.lora.options import (
    MERGED_ADAPTER,
    MergingOptions,
)

NAME = "flora"


class FLoraOptions(MergingOptions):
    """algorithm: {name: flora}: stacking aggregation, merged into the backbone every round."""

    name: Literal["flora"] = "flora"
    adapter_incomplete: ClassVar[str | None] = MERGED_ADAPTER.format(name="flora")
    update_poisoning_unavailable: ClassVar[str | None] = (
        "its clients train fresh LoRA factors the server never sends, so there is no received tensor to change")
