"""Options of the simulated system (``system``): the clients' devices, links and availability on a virtual clock,
and the round's deadline and over-selection. Like the rest of fedpeft.config: descriptions and validation only.

The clock itself is fedpeft.system's: a client's simulated time is its download (payload bytes / bandwidth +
latency), its local computation (the FLOPs the run counts, at the device's speed) and its upload, so it depends
on the config, the seed and the counted work, never on the host.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from fedpeft.config.section import Section

PROFILES = ("ideal", "datacenter", "mobile")


class SystemConfig(Section):
    """The devices, links and availability the run's clients are simulated on (docs/guide/system.md)."""

    profile: Literal["ideal", "datacenter", "mobile"] = Field(
        "ideal", description="Where the clients' devices and links are drawn from. ideal: every client computes at "
        "the reference speed (1 TFLOP/s), transfers take no time and every client is always online (the simulated "
        "time of today's runs); datacenter: cross-silo servers with data-centre GPUs on wide-area links, always "
        "online; mobile: cross-device phones on 4G links with heavy-tailed speeds and daily online windows. Ignored "
        "when system.trace is given.")
    trace: str | None = Field(
        None, description="A JSON or parquet file with one device per client (flops_per_s or slowdown, "
        "download_mbps, upload_mbps, latency_s, and online windows), read instead of drawing from a profile; "
        "FedScale's traces convert to it (docs/guide/system.md). A relative path is taken from the working "
        "directory, as task.data_files.")
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Seed of the per-client draws from the profile (None: the run's seed).")
    deadline_s: float | None = Field(
        None, gt=0, description="A round's deadline in simulated seconds from its start: updates that arrive later are "
        "dropped (listed in the row's rejected, counted in sim_dropped), and the round ends at the deadline at the "
        "latest. On the Flower runtime: real seconds, the TTL of the round's messages (counted from their creation, "
        "just before they are pushed), shorter than federation.round_timeout_s. None: a round waits for every "
        "selected client.")
    over_selection: float = Field(
        0.0, ge=0, le=10, description="Select ceil(clients_per_round x (1 + this)) clients and aggregate the first "
        "clients_per_round accepted updates to arrive (Bonawitz et al., 2019); the rest are dropped and counted. On "
        "the Flower runtime: the first clients_per_round replies whose update decodes, in real time (the server's "
        "checks follow; an update they refuse leaves the round with fewer).")

    @model_validator(mode="after")
    def _trace_or_profile(self) -> SystemConfig:
        if self.trace is not None and "profile" in self.model_fields_set and self.profile != "ideal":
            raise ValueError(f"system.trace and system.profile {self.profile} both name the devices: keep one")
        return self

    def selected(self, clients_per_round: int) -> int:
        """How many clients a round selects: clients_per_round, more with over-selection."""
        return math.ceil(clients_per_round * (1.0 + self.over_selection) - 1e-9)

    def has_availability(self) -> bool:
        """Whether clients come and go (the mobile profile, or a trace: its online windows)."""
        return self.trace is not None or self.profile == "mobile"

    def simulates_time_only(self) -> bool:
        """Whether the run is today's run with a clock beside it: ideal devices, no deadline, no over-selection."""
        return self.trace is None and self.profile == "ideal" and self.deadline_s is None and not self.over_selection
