"""The options of the fedsa federated LoRA method."""

from __future__ import annotations

from typing import Any, Literal

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
    local_head: bool = Field(
        True, description="Keep the task head (the modules peft trains whole, modules_to_save) on each client with "
        "its B, as the reference code's classification config does (local_param: lora_B, classifier); false "
        "averages the head with A.")

    def check(self, run: Any) -> None:
        super().check(run)
        if not run.eval.personalized:
            raise ValueError("algorithm fedsa_lora keeps each client's B on the client, so the server's global model "
                             "has none and its score is not the method's: set eval.personalized: true to score the "
                             "clients' own models")
