"""The options of ``peft.method: bottleneck`` (houlsby and pfeiffer)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.schema import PeftOptions


class BottleneckOptions(PeftOptions):
    reduction_factor: int = Field(16, ge=1, description="Bottleneck size = hidden size / reduction_factor.")
    bottleneck_size: int | None = Field(None, ge=1, description="Overrides reduction_factor.")
    non_linearity: Literal["relu", "gelu", "swish", "tanh"] = "relu"
    init_std: float = Field(1e-2, ge=0, description="Std of the down/up projection init (near identity).")


class HoulsbyOptions(BottleneckOptions):
    """Bottleneck adapters after the attention block and after the feed-forward block."""

    method: Literal["houlsby"] = "houlsby"


class PfeifferOptions(BottleneckOptions):
    """One bottleneck adapter per layer, after the feed-forward block."""

    method: Literal["pfeiffer"] = "pfeiffer"
