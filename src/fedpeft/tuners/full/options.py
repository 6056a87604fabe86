"""The options of ``peft.method: full``."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedpeft.config.schema import PeftOptions, RunConfig, refuse_quantized_backbone


class FullFineTuning(PeftOptions):
    method: Literal["full"] = "full"
    trains_every_weight: ClassVar[bool] = True

    def check(self, run: RunConfig) -> None:
        refuse_quantized_backbone(run, "peft.method full trains the backbone's weights, which are frozen in 4 or 8 "
                                        "bits: use lora, ia3, the prompt methods or bottleneck adapters")
