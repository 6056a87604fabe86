"""The options of ``algorithm.name: fedprox``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.algorithms.privacy.options import PrivacyOptions
from fedpeft.config.adversarial import ROBUST_DESCRIPTION, RobustRule
from fedpeft.config.schema import AlgorithmOptions


class FedProxOptions(AlgorithmOptions):
    name: Literal["fedprox"] = "fedprox"
    supports_secure_aggregation: ClassVar[bool] = True
    supports_personalized_eval: ClassVar[bool] = True
    asynchronous_unavailable: ClassVar[str | None] = None
    server_lr: float = Field(1.0, gt=0)
    mu: float = Field(0.01, ge=0, description="Weight of the proximal term mu/2 * ||w - w_global||^2.")
    dp: PrivacyOptions | None = None
    robust: RobustRule | None = Field(None, description=ROBUST_DESCRIPTION)
