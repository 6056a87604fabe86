"""The coordinate-wise trimmed mean (Yin et al., ICML 2018): its options and its aggregation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedpeft.algorithms.robust.core import Arrays, RobustResult, check_same_layout, norms, stacked
from fedpeft.config.adversarial import RobustRuleOptions


def trim_count(n: int, trim_fraction: float) -> int:
    """floor(beta n), the values the trimmed mean drops at each end of a coordinate, with a tolerance for binary
    rounding: 0.29 x 100 is 28.999999999999996 in floats, and trims 29."""
    return math.floor(trim_fraction * n + 1e-9)


class TrimmedMeanRule(RobustRuleOptions):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): in every coordinate the floor(beta n) largest and
    floor(beta n) smallest of the n updates are dropped and the rest averaged, unweighted. Tolerates up to
    floor(beta n) arbitrary updates per round."""

    rule: Literal["trimmed_mean"] = "trimmed_mean"
    trim_fraction: float = Field(0.1, gt=0, lt=0.5, description="beta: the share of updates dropped at each end "
                                 "of every coordinate.")

    def min_updates(self) -> int:
        n = 2
        while trim_count(n, self.trim_fraction) < 1:  # at least one value trimmed at each end
            n += 1
        return n

    def why(self, need: int) -> str:
        return f"with trim_fraction {self.trim_fraction:g} trims nothing below {need} updates per round"

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round or algorithm.robust.trim_fraction"


def trimmed_mean(updates: Sequence[Mapping[str, np.ndarray]], trim_fraction: float) -> Arrays:
    """Per coordinate: sort the n values, drop floor(trim_fraction n) at each end, average the rest."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must lie in [0, 0.5), got {trim_fraction}")
    names = check_same_layout(updates)
    n = len(updates)
    k = trim_count(n, trim_fraction)
    return {name: np.sort(stacked(updates, name), axis=0)[k:n - k].mean(axis=0)
            .reshape(np.shape(updates[0][name])).astype(np.float32) for name in names}


def aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: TrimmedMeanRule
              ) -> RobustResult:
    size = [float(x) for x in norms(updates)]
    return RobustResult(trimmed_mean(updates, rule.trim_fraction), norms=size,
                        trimmed=trim_count(len(updates), rule.trim_fraction))
