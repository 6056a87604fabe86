"""The options of the ffa federated LoRA method."""

from __future__ import annotations

from typing import Literal

from fedpeft.algorithms.lora.options import (
    LoraFedAvgOptions,
)

NAME = "ffa_lora"


class FfaLoraOptions(LoraFedAvgOptions):
    """algorithm: {name: ffa_lora, server_lr: 1.0}: LoRA with A frozen, B and the head federated (FedAvg)."""

    name: Literal["ffa_lora"] = "ffa_lora"
