"""A fedpeft plugin: FedAvg's clients with a coordinate-wise median on the server.

The median of the clients' updates, taken entry by entry, ignores any single client's values as long as
fewer than half the clients send extreme ones, which makes it a classic defence against poisoned updates
(Yin et al. 2018, "Byzantine-robust distributed learning"). Written against ``import fedpeft`` only.

    fedpeft run examples/custom_algorithm/config.yaml --plugin examples/custom_algorithm/plugin.py
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

import fedpeft


class MedianOptions(fedpeft.AlgorithmOptions):
    """algorithm: {name: median, server_lr: 1.0}"""

    name: Literal["median"] = "median"
    server_lr: float = Field(1.0, gt=0, description="Step along the median update (1.0 = take it).")


class MedianServer(fedpeft.ServerAlgorithm[MedianOptions]):
    """Every client gets the global state; the new global state moves along the entry-wise median of the
    accepted clients' changes to it. Updates were checked (names, shapes, finite values) before this."""

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {"median_norm": 0.0}
        squared = 0.0
        for name, current in self.global_state.items():
            changes = np.stack([updates[c].arrays[name] - current for c in sorted(updates)])
            median = np.median(changes, axis=0).astype(np.float32)
            self.global_state[name] = current + np.float32(self.options.server_lr) * median
            squared += float(np.sum(median.astype(np.float64) ** 2))
        return {"median_norm": squared ** 0.5}


class LocalTrainingClient(fedpeft.ClientAlgorithm):
    """Load the global state, train on the client's data, send the trained state back."""

    def __init__(self, options: MedianOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        ctx.tuned.load_state(payload.arrays)
        result = ctx.train()
        meta = {"round": payload.meta["round"], "num_examples": ctx.num_examples, **result.as_meta()}
        return fedpeft.Payload(ctx.tuned.state(), meta)


fedpeft.register_algorithm("median", options=MedianOptions, server=MedianServer, client=LocalTrainingClient)
