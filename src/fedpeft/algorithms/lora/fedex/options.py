"""The options of the fedex federated LoRA method."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedpeft.algorithms.lora.options import (
    MERGED_ADAPTER,
    MergingOptions,
)

NAME = "fedex_lora"


class FedExLoraOptions(MergingOptions):
    """algorithm: {name: fedex_lora}: FedAvg of A and B with the residual merged into the backbone."""

    name: Literal["fedex_lora"] = "fedex_lora"
    adapter_incomplete: ClassVar[str | None] = MERGED_ADAPTER.format(name="fedex_lora")
