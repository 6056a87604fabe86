"""The options of the fedsa federated LoRA method."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.algorithms.lora.options import (
    LoraFedAvgOptions,
)

NAME = "fedsa_lora"


KEPT = "lora_B"  # ctx.state key of the client's own tensors: its B factors (and the task head under local_head)


class FedSaLoraOptions(LoraFedAvgOptions):
    """algorithm: {name: fedsa_lora, server_lr: 1.0, local_head: true}: LoRA with A federated, B and (by
    default) the task head personal."""

    name: Literal["fedsa_lora"] = "fedsa_lora"
    personal_models: ClassVar[str | None] = "its own LoRA B (and, under local_head, its task head)"
    local_head: bool = Field(
        True, description="Keep the task head (the modules peft trains whole, modules_to_save) on each client with "
        "its B, as the reference code's classification config does (local_param: lora_B, classifier); false "
        "averages the head with A.")
