"""The options of ``algorithm.name: fedavg`` (and its family)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.algorithms.privacy.options import PrivacyOptions
from fedpeft.config.adversarial import ROBUST_DESCRIPTION, RobustRule
from fedpeft.config.schema import AlgorithmOptions


class FedAvgOptions(AlgorithmOptions):
    """FedAvg with a server learning rate: x += server_lr * weighted mean of client deltas (Eq. 5)."""

    name: Literal["fedavg"] = "fedavg"
    supports_secure_aggregation: ClassVar[bool] = True
    supports_personalized_eval: ClassVar[bool] = True
    asynchronous_unavailable: ClassVar[str | None] = None
    server_lr: float = Field(1.0, gt=0)
    dp: PrivacyOptions | None = Field(None, description="Client-level differential privacy (off by default).")
    robust: RobustRule | None = Field(None, description=ROBUST_DESCRIPTION)


class FedAvgMOptions(AlgorithmOptions):
    """FedAvgM: FedAvg with momentum on the server step (Hsu et al. 2019)."""

    name: Literal["fedavgm"] = "fedavgm"
    supports_secure_aggregation: ClassVar[bool] = True
    supports_personalized_eval: ClassVar[bool] = True
    asynchronous_unavailable: ClassVar[str | None] = None
    server_lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    dp: PrivacyOptions | None = None
    robust: RobustRule | None = Field(None, description=ROBUST_DESCRIPTION)


class FedAdamOptions(AlgorithmOptions):
    """FedAdam (Reddi et al. 2021): an Adam step on the server, the clients' mean change as its gradient."""

    name: Literal["fedadam"] = "fedadam"
    supports_secure_aggregation: ClassVar[bool] = True
    supports_personalized_eval: ClassVar[bool] = True
    asynchronous_unavailable: ClassVar[str | None] = None
    dp: PrivacyOptions | None = None
    robust: RobustRule | None = Field(None, description=ROBUST_DESCRIPTION)
    server_lr: float = Field(1e-2, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0, description="Adaptivity (epsilon) of the server optimizer.")
    initial_v: Literal["tau_squared", "zero"] = Field(
        "tau_squared", description="The second moment's start: tau_squared (Reddi et al.'s v0 = tau^2) or zero "
        "(Flower's strategies).")
    bias_correction: bool = Field(
        False, description="Scale the step at round t by sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)), as Flower's "
        "FedAdam does (Reddi et al. have none). With initial_v: zero, fedadam is then Flower's FedAdam; fedyogi "
        "with initial_v: zero and no correction is Flower's FedYogi.")


class FedYogiOptions(FedAdamOptions):
    """FedYogi (Reddi et al. 2021): FedAdam with Yogi's additive second-moment update."""

    name: Literal["fedyogi"] = "fedyogi"  # type: ignore[assignment]
