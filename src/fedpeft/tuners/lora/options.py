"""The options of ``peft.method: lora``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import PeftOptions


class LoraOptions(PeftOptions):
    method: Literal["lora"] = "lora"
    maps_to_heads: ClassVar[bool] = True
    lora_factors: ClassVar[bool] = True
    label_options: ClassVar[tuple[str, ...]] = ("r",)
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.1, ge=0, lt=1)
    target_modules: list[str] | None = Field(
        None, description="Module names to adapt. Default: the attention query/key/value projections."
    )
