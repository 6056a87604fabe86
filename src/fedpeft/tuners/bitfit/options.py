"""The options of ``peft.method: bitfit``."""

from __future__ import annotations

from typing import Literal

from fedpeft.config.schema import PeftOptions, RunConfig, refuse_quantized_backbone


class BitFitOptions(PeftOptions):
    method: Literal["bitfit"] = "bitfit"

    def check(self, run: RunConfig) -> None:
        refuse_quantized_backbone(run, "peft.method bitfit trains the biases of the quantized linear layers, which "
                                        "bitsandbytes keeps frozen: use lora, ia3, the prompt methods or adapters")
