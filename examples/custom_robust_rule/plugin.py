"""A fedpeft plugin: the geometric median as a Byzantine-robust aggregation rule (``algorithm.robust``).

The geometric median of the clients' updates is the point with the smallest sum of (sample-weighted) Euclidean
distances to them; unlike the coordinate-wise median it treats an update as one vector, and it stays bounded while
fewer than half the weight is arbitrary. Robust Federated Aggregation (Pillutla, Kakade and Harchaoui, "Robust
Aggregation for Federated Learning", IEEE Transactions on Signal Processing 2022) computes it with a few steps of
the smoothed Weiszfeld algorithm, as here. Written against ``import fedpeft`` only; every algorithm with a
``robust`` option (FedAvg and its server optimizers, FedProx, FFA-LoRA, FedSA-LoRA) can use it.

    fedpeft run examples/custom_robust_rule/config.yaml --plugin examples/custom_robust_rule/plugin.py
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

import fedpeft


class GeometricMedianRule(fedpeft.RobustRuleOptions):
    """Geometric median by the smoothed Weiszfeld algorithm (RFA, Pillutla et al. 2022): each step re-weights
    every update by its sample share over its distance to the current estimate (at least ``smoothing``)."""

    rule: Literal["geometric_median"] = "geometric_median"
    iterations: int = Field(4, ge=1, description="Weiszfeld steps at most (RFA: 3 or 4 are enough in practice).")
    smoothing: float = Field(1e-6, gt=0, description="nu: the smallest distance a weight divides by (keeps an "
                             "estimate that lands on an update finite); also the relative change that stops early.")

    def min_updates(self) -> int:
        return 3  # of two updates every point between them has the same sum of distances


def geometric_median(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                     rule: GeometricMedianRule) -> fedpeft.RobustResult:
    """The round's updates (x_c - x) to their sample-weighted geometric median (in float64, as one vector each:
    the working memory is n copies of the whole update, fine for adapters)."""
    names = sorted(updates[0])
    points = np.stack([np.concatenate([np.asarray(u[k], np.float64).ravel() for k in names]) for u in updates])
    alpha = np.asarray(weights, np.float64) / float(np.sum(weights))
    estimate = alpha @ points  # start at the weighted mean
    for _ in range(rule.iterations):
        beta = alpha / np.maximum(rule.smoothing, np.linalg.norm(points - estimate, axis=1))
        step = beta @ points / beta.sum()
        moved = float(np.linalg.norm(step - estimate))
        estimate = step
        if moved <= rule.smoothing * max(1.0, float(np.linalg.norm(estimate))):
            break
    aggregate, offset = {}, 0
    for k in names:
        shape = np.shape(updates[0][k])
        size = int(np.prod(shape))
        aggregate[k] = estimate[offset:offset + size].reshape(shape).astype(np.float32)
        offset += size
    return fedpeft.RobustResult(aggregate)


fedpeft.register_robust_rule("geometric_median", options=GeometricMedianRule, aggregate=geometric_median)
