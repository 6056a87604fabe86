"""The coordinate-wise median (Yin et al., ICML 2018): its options and its aggregation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from fedpeft.algorithms.robust.core import Arrays, RobustResult, check_same_layout, norms, stacked
from fedpeft.config.adversarial import RobustRuleOptions


class MedianRule(RobustRuleOptions):
    """Coordinate-wise median of the clients' updates (Yin et al., ICML 2018). Tolerates fewer than half the
    updates being arbitrary; ignores the clients' sample counts (a claimed count is itself an attack surface);
    without attack it is noisier than the mean, most under skewed (non-IID) clients."""

    rule: Literal["median"] = "median"

    def min_updates(self) -> int:
        return 3  # the median of two updates is their mean


def coordinate_median(updates: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    names = check_same_layout(updates)
    return {k: np.median(stacked(updates, k), axis=0).reshape(np.shape(updates[0][k])).astype(np.float32)
            for k in names}


def aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: MedianRule
              ) -> RobustResult:
    size = [float(x) for x in norms(updates)]
    return RobustResult(coordinate_median(updates), norms=size)
