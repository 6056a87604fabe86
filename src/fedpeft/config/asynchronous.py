"""Options of buffered asynchronous aggregation (``federation.asynchronous``): FedBuff (Nguyen et al., 2022) and
FedAsync (Xie et al., 2019) on the simulated clock. Like the rest of fedpeft.config: descriptions and validation
only."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from fedpeft.config.section import Section

FEDBUFF_BUFFER = 10  # the buffer size of FedBuff's experiments (FLSim's FedBuff configs)


class AsynchronousConfig(Section):
    """Clients train concurrently, each from the global model current when it started; the server aggregates every
    ``buffer_size`` arriving updates, each weighted by its staleness (docs/guide/asynchronous.md). With it,
    federation.clients_per_round is the number of clients training at once (the concurrency) and
    federation.rounds the number of aggregations."""

    rule: Literal["fedbuff", "fedasync"] = Field(
        "fedbuff", description="fedbuff: every buffer_size updates, the algorithm's own aggregation of their changes "
        "(each relative to the model the client started from, scaled by its staleness weight) with its server "
        "learning rate. fedasync: every update at once (buffer_size 1), the global model mixed with the client's, "
        "x = (1 - a) x + a x_client with a = mixing x staleness weight.")
    buffer_size: int | None = Field(
        None, ge=1, description="K, the updates aggregated together (None: fedbuff 10, at most clients_per_round; "
        "fedasync 1).")
    staleness: Literal["sqrt", "constant", "polynomial", "hinge"] | None = Field(
        None, description="The weight of an update that started s aggregations ago: sqrt 1/sqrt(1+s) (FedBuff's), "
        "constant 1, polynomial (1+s)^-staleness_a, hinge 1 for s <= staleness_b, else 1/(staleness_a (s - "
        "staleness_b) + 1) (FedAsync's). None: sqrt under fedbuff, polynomial under fedasync.")
    staleness_a: float = Field(0.5, gt=0, description="The exponent of polynomial, the slope of hinge.")
    staleness_b: int = Field(4, ge=0, description="The staleness up to which hinge weighs an update 1.")
    mixing: float = Field(0.6, gt=0, le=1, description="fedasync's alpha: how much of a fresh client's model enters "
                          "the global one.")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop (and count) updates that started more than this many aggregations ago.")

    @model_validator(mode="after")
    def _fedasync_is_k_one(self) -> AsynchronousConfig:
        if self.rule == "fedasync" and self.buffer_size not in (None, 1):
            raise ValueError(f"rule fedasync aggregates every update (buffer_size 1), and "
                             f"buffer_size is {self.buffer_size}: remove it, or use rule fedbuff")
        return self

    def buffer(self, concurrency: int) -> int:
        """K: the updates aggregated together, for ``concurrency`` clients training at once."""
        if self.buffer_size is not None:
            return self.buffer_size
        return 1 if self.rule == "fedasync" else min(FEDBUFF_BUFFER, concurrency)

    def weighting(self) -> str:
        return self.staleness or ("sqrt" if self.rule == "fedbuff" else "polynomial")


def staleness_weight(kind: str, staleness: int, a: float = 0.5, b: int = 4) -> float:
    """The weight of an update ``staleness`` aggregations old (FedBuff's sqrt, FedAsync's constant, polynomial and
    hinge functions)."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} < 0")
    if kind == "constant":
        return 1.0
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + staleness)
    if kind == "polynomial":
        return float((1.0 + staleness) ** -a)
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness weighting {kind!r}")
