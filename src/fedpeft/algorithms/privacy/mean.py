"""Client-level differential privacy for the FedAvg family (DP-FedAvg, McMahan et al. 2018).

Each client's update delta_c = x_c - x is clipped to L2 norm C over all its arrays (by the client, or
by the server: ``algorithm.dp.clipping``). The server sums the clipped deltas, divides by the number of
clients sampled per round K (a fixed denominator, so one client changes the mean by at most C/K
whether or not the others arrive), and adds N(0, (z C / K)^2) to every entry. The server optimizer
(FedAvg, FedAvgM, FedAdam, FedYogi) then applies that noisy mean; everything it does afterwards is
post-processing.

The privacy accountant is Flower's (``flwr.serverapp.RdpAccountant``, public API: Renyi DP over
Google's dp-accounting, clients sampled K of N uniformly without replacement, replace-one neighbours).
Clipping (the flat clipping of the paper above, with the norm in float64) and the noise scale z C / K
are two lines each here: Flower has them only in its internal modules.
The noise standard deviation on the sum of clipped updates is z C. Under replace-one neighbours (the
relation that goes with sampling exactly K clients) the sum moves by up to 2 C when one client's
data is replaced, so the accountant is given the noise multiplier z / 2.

The noise comes from operating-system entropy, never from the run's seed: the config (and its seed)
is sent to every client, and anyone who can reproduce the noise can subtract it. So runs with
differential privacy are not bit-reproducible, and a resumed run draws fresh noise; the accountant's
state is checkpointed, so the privacy spent carries over.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedpeft.algorithms.aggregate import l2_norm

# Flower's building blocks are imported where they are used, so that importing fedpeft.algorithms does not load
# Flower (only a run with algorithm.dp does)

Arrays = dict[str, np.ndarray]


def clip(delta: Arrays, clipping_norm: float) -> Arrays:
    """delta scaled to L2 norm <= clipping_norm (float32, new arrays)."""
    norm = l2_norm(delta)
    scale = np.float32(min(1.0, clipping_norm / norm)) if norm > 0 else np.float32(1.0)  # FlatClip (McMahan+ 2018)
    return {k: np.array(delta[k], dtype=np.float32) * scale for k in sorted(delta)}


class PrivateMean:
    """Noisy mean of clipped client deltas, with the privacy spent so far."""

    def __init__(self, options: Any, *, num_clients: int, clients_per_round: int):
        self.options = options
        self.num_clients = num_clients
        self.k = clients_per_round
        self.sampler = np.random.default_rng()  # client sampling from OS entropy, secret from clients
        self.accountant: Any = None  # flwr's RdpAccountant
        if options.noise_multiplier > 0:
            from flwr.serverapp import (
                NeighboringRelation,
                PrivacyConfig,
                RdpAccountant,
                SamplingMethod,
            )

            self.accountant = RdpAccountant(PrivacyConfig(
                target_delta=options.target_delta, population_size=num_clients,
                neighboring_relation=NeighboringRelation.REPLACE_ONE,
                sampling_method=SamplingMethod.WITHOUT_REPLACEMENT, max_epsilon=options.max_epsilon))

    def event(self) -> Any:
        """flwr's GaussianPrivacyEvent of one round."""
        from flwr.serverapp import GaussianPrivacyEvent

        # sensitivity of the clipped sum under replace-one neighbours is 2 C; the noise is z C
        return GaussianPrivacyEvent(self.options.noise_multiplier / 2, self.k, self.num_clients)

    def budget_left(self) -> bool:
        """False when one more round would exceed algorithm.dp.max_epsilon."""
        if self.accountant is None or self.options.max_epsilon is None:
            return True
        return not self.accountant.would_exceed(self.event())

    def mean(self, deltas: list[Arrays]) -> Arrays:
        C = self.options.clipping_norm
        clipped = [clip(d, C) for d in deltas]  # idempotent for updates the clients clipped already
        std = self.options.noise_multiplier * C / self.k  # of the mean of k clipped updates
        rng = np.random.default_rng()  # fresh OS entropy: see the module docstring
        out: Arrays = {}
        for name in sorted(clipped[0]):
            total = np.zeros(clipped[0][name].shape, dtype=np.float64)
            for d in clipped:
                total += d[name]
            noisy = total / self.k
            if std > 0:
                noisy = noisy + rng.normal(0.0, std, size=noisy.shape)
            out[name] = noisy.astype(np.float32)
        if self.accountant is not None:
            self.accountant.compose(self.event())
        return out

    def spent(self) -> dict[str, Any]:
        if self.accountant is None:
            return {"dp_epsilon": math.inf, "dp_delta": self.options.target_delta, "dp_releases": 0}
        eps = self.accountant.get_epsilon(self.options.target_delta)
        return {"dp_epsilon": eps, "dp_delta": self.options.target_delta,
                "dp_releases": self.accountant.num_releases}

    def state_dict(self) -> dict[str, Any]:
        return self.accountant.state_dict() if self.accountant is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.accountant is not None and state:
            self.accountant.load_state_dict(state)
