"""The ``dp`` option of the algorithms that offer client-level differential privacy (a wrapper around their
halves: :mod:`fedpeft.algorithms.privacy.wrapper`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from fedpeft.config.wrapping import WrapperOptions

if TYPE_CHECKING:
    from fedpeft.config.schema import RunConfig


class PrivacyOptions(WrapperOptions):
    """Client-level differential privacy (DP-FedAvg): every client's update is clipped to L2 norm
    ``clipping_norm``, the server sums the clipped updates, divides by clients_per_round and adds
    Gaussian noise of standard deviation noise_multiplier * clipping_norm / clients_per_round. The
    privacy spent is accounted with Flower's RDP accountant (sampling K of N clients without
    replacement) and reported every round as dp_epsilon at dp_delta."""

    noise_multiplier: float = Field(1.0, ge=0, description="z; 0 = clipping only (no privacy guarantee).")
    clipping_norm: float = Field(1.0, gt=0, description="C: the L2 bound of one client's update (all arrays).")
    clipping: Literal["client", "server"] = Field(
        "client", description="client: clients clip before sending and the server rejects larger updates; "
        "server: the server clips what arrives (the server then sees unclipped updates).",
    )
    target_delta: float = Field(1e-5, gt=0, lt=1, description="delta at which epsilon is reported.")
    max_epsilon: float | None = Field(None, gt=0, description="Stop before a round would exceed this epsilon.")

    key: ClassVar[str] = "algorithm.dp"
    server_wrapper: ClassVar[str] = "fedpeft.algorithms.privacy.wrapper:PrivateServer"
    client_wrapper: ClassVar[str | None] = "fedpeft.algorithms.privacy.wrapper:PrivateClient"
    asynchronous_unavailable: ClassVar[str | None] = "the privacy accounting counts rounds of clients sampled together"
    secure_aggregation_unavailable: ClassVar[str] = ("the private mean needs each clipped update; SecAgg+ reveals only "
                                                     "the weighted mean")

    @model_validator(mode="after")
    def _budget_needs_noise(self) -> PrivacyOptions:
        if self.max_epsilon is not None and self.noise_multiplier == 0:
            raise ValueError("max_epsilon needs noise_multiplier > 0: without noise there is no finite epsilon")
        return self

    def check_system(self, run: RunConfig) -> None:
        system = run.system
        if system.over_selection or system.has_availability():
            raise ValueError("algorithm.dp with system.over_selection or clients that come and go (system.profile "
                             "mobile, system.trace) is not supported: the privacy accounting assumes every client can "
                             "be sampled and each sampled one counts; choose one")
