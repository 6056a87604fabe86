"""The options of ``peft.method: p_tuning``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import PeftOptions


class PTuningOptions(PeftOptions):
    no_images: ClassVar[str | None] = "it prepends virtual tokens to a text model's token embeddings"
    method: Literal["p_tuning"] = "p_tuning"
    maps_to_heads: ClassVar[bool] = True
    num_virtual_tokens: int = Field(20, ge=1)
    encoder_type: Literal["mlp", "lstm"] = "mlp"
    encoder_hidden_size: int = Field(128, ge=1)
