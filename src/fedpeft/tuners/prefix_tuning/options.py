"""The options of ``peft.method: prefix_tuning``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from fedpeft.config.schema import PeftOptions, RunConfig


class PrefixTuningOptions(PeftOptions):
    """Deep prompts: trainable key/value prefixes at every layer (prefix tuning / P-tuning v2)."""

    no_images: ClassVar[str | None] = ("peft passes its prefixes as a text model's past_key_values, which a vision "
                                        "transformer's forward does not take")
    method: Literal["prefix_tuning"] = "prefix_tuning"
    layer_prefixes: ClassVar[bool] = True
    maps_to_heads: ClassVar[bool] = True
    num_virtual_tokens: int = Field(20, ge=1)
    projection: bool = Field(False, description="Reparametrise the prefixes through a 2-layer MLP.")
    encoder_hidden_size: int = Field(512, ge=1, description="Hidden size of the projection MLP.")
    init_text: str | None = Field(
        None, description="Initialise each layer's prefix with the keys/values the frozen model computes for this "
        "text (cut or repeated to num_virtual_tokens tokens; Li & Liang 2021), so that the untrained prefixed model "
        "is the model with the text prepended. Decoder-only models, projection false. None: peft's N(0, 1) values.")

    def check(self, run: RunConfig) -> None:
        if run.train.gradient_checkpointing:
            raise ValueError("train.gradient_checkpointing drops the prefixes: transformers' checkpointed layers "
                             "discard past_key_values in training, which is how prefix tuning reaches them; set "
                             "train.gradient_checkpointing: false (or use another peft.method)")

    @model_validator(mode="after")
    def _init_text_sets_the_prefixes(self):
        if self.init_text is not None and self.projection:
            raise ValueError("peft.init_text sets the prefixes themselves; it needs projection: false")
        return self
