"""The wrappers of ``algorithm.dp`` (DP-FedAvg, McMahan et al. 2018) around any algorithm with a ``dp`` option:
the server samples clients in secret, refuses updates larger than the clipping norm (when clients clip), puts the
noisy mean of the clipped changes in place of the weighted mean, reports and checkpoints the privacy spent and
stops the run before its budget is exceeded; the client clips its update before sending it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpeft.algorithms.aggregate import deltas, l2_norm
from fedpeft.algorithms.base import ClientAlgorithm, ClientContext, ServerAlgorithm, UpdateRejected
from fedpeft.algorithms.privacy.mean import PrivateMean, clip
from fedpeft.algorithms.privacy.options import PrivacyOptions
from fedpeft.algorithms.wrapping import ClientWrapper, ServerWrapper
from fedpeft.wire import Arrays, Payload


class PrivateServer(ServerWrapper):
    settings: PrivacyOptions

    def __init__(self, inner: ServerAlgorithm[Any], settings: PrivacyOptions) -> None:
        super().__init__(inner, settings)
        self.private = PrivateMean(settings, num_clients=inner.num_clients, clients_per_round=inner.clients_per_round)
        self.take_mean()

    def select(self, rnd: int) -> list[int]:
        # the sample must be secret from clients (who know the seed)
        return sorted(int(c) for c in self.private.sampler.choice(self.num_clients, self.clients_per_round,
                                                                   replace=False))

    def check_clipped(self, payload: Payload) -> None:
        """Refuse an update whose change is larger than algorithm.dp.clipping_norm, when the clients clip."""
        options = self.settings
        if options.clipping == "client":
            norm = l2_norm(deltas(self.global_state, payload.arrays))
            if norm > options.clipping_norm * (1 + 1e-4) + 1e-6:
                raise UpdateRejected(f"update norm {norm:.6g} exceeds algorithm.dp.clipping_norm "
                                     f"{options.clipping_norm:g} (clients must clip)")

    def validate(self, rnd: int, payload: Payload) -> None:
        self.inner.validate(rnd, payload)
        self.check_clipped(payload)

    def validate_from(self, rnd: int, client: int, payload: Payload) -> None:
        self.inner.validate_from(rnd, client, payload)
        self.check_clipped(payload)

    def accept(self, rnd: int, updates: dict[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]:
        # the contract's checks, update by update, with this wrapper's validate_from (the wrapped server's, then the
        # clipping bound): each rejection logged in the order the updates came
        return ServerAlgorithm.accept(self, rnd, updates)

    def combine(self, rnd: int, deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays:
        return self.private.mean(deltas)  # clipped, unweighted, fixed denominator, Gaussian noise

    def stop_reason(self) -> str | None:
        if not self.private.budget_left():
            return (f"one more round would exceed algorithm.dp.max_epsilon={self.settings.max_epsilon:g} "
                    f"(spent: epsilon {self.private.spent()['dp_epsilon']} at delta {self.settings.target_delta:g})")
        return self.inner.stop_reason()

    def round_info(self) -> dict[str, Any]:
        return {**self.inner.round_info(), **self.private.spent()}

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "privacy": self.private.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.private.load_state_dict(state.get("privacy") or {})

    def aggregate_mean(self, rnd: int, mean_update: dict[str, Any]) -> dict[str, float]:
        raise UpdateRejected("differential privacy needs each client's update, not their mean")


class PrivateClient(ClientWrapper):
    """The client's update with its change clipped to algorithm.dp.clipping_norm (when the clients clip)."""

    settings: PrivacyOptions

    def __init__(self, inner: ClientAlgorithm, settings: PrivacyOptions) -> None:
        super().__init__(inner, settings)
        self.clip_norm = settings.clipping_norm if settings.clipping == "client" else None

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        update = self.inner.fit(payload, ctx)
        if self.clip_norm is None:
            return update
        delta = clip(deltas(payload.arrays, update.arrays), self.clip_norm)
        state = {k: (payload.arrays[k].astype(np.float32) + delta[k]).astype(np.float32) for k in payload.arrays}
        return Payload(state, update.meta)
