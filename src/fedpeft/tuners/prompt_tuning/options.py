"""The options of ``peft.method: prompt_tuning``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import PeftOptions


class PromptTuningOptions(PeftOptions):
    no_images: ClassVar[str | None] = "it prepends virtual tokens to a text model's token embeddings"
    method: Literal["prompt_tuning"] = "prompt_tuning"
    maps_to_heads: ClassVar[bool] = True
    num_virtual_tokens: int = Field(20, ge=1)
    init_text: str | None = Field(None, description="Initialise the prompt from this text's embeddings.")
