"""Norm bounding (Sun et al., 2019, "Can you really backdoor federated learning?"): its options and its aggregation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.robust.core import RobustResult, Scaled, check_same_layout, norms
from fedpeft.config.adversarial import RobustRuleOptions


class NormBoundRule(RobustRuleOptions):
    """Norm bounding (Sun et al., 2019, "Can you really backdoor federated learning?"): every update is scaled
    down to L2 norm at most max_norm (over all its tensors), then the sample-weighted mean is taken as in
    FedAvg. Limits what one update can move, not what many can; without attack it equals FedAvg whenever no
    honest update exceeds the bound. It keeps FedAvg's weighting by the clients' claimed sample counts, so a client
    that overstates its count weighs more (within the bound)."""

    rule: Literal["norm_bound"] = "norm_bound"
    max_norm: float | None = Field(None, gt=0, description="The bound; None = the median norm of the round's "
                                   "updates (so at most half of them are scaled).")


def norm_bounded_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                      max_norm: float | None) -> RobustResult:
    """Every update scaled to L2 norm <= bound (max_norm, or the median of the updates' norms when None), then
    the weighted mean."""
    check_same_layout(updates)
    size = norms(updates)
    bound = float(np.median(size)) if max_norm is None else float(max_norm)
    over = size > bound
    scale = np.where(over, bound / np.where(over, size, 1.0), 1.0)
    clipped = [Scaled(u, float(s)) for u, s in zip(updates, scale)]
    return RobustResult(weighted_mean(clipped, weights), bound=bound, clipped=[int(i) for i in np.flatnonzero(over)],
                        norms=[float(x) for x in size])


def aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: NormBoundRule
              ) -> RobustResult:
    return norm_bounded_mean(updates, weights, rule.max_norm)
