"""The options of ``peft.method: ia3``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import PeftOptions


class IA3Options(PeftOptions):
    method: Literal["ia3"] = "ia3"
    maps_to_heads: ClassVar[bool] = True
    target_modules: list[str] | None = Field(None, description="Default: peft's choice for the architecture.")
    feedforward_modules: list[str] | None = None
