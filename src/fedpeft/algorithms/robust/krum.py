"""Krum and Multi-Krum (Blanchard et al., NeurIPS 2017): their options and their aggregation.

score_i = the sum of the squared distances from update i to its n - f - 2 nearest other updates; Krum returns the
update with the lowest score, Multi-Krum the unweighted mean of the m lowest-scoring ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedpeft.algorithms.robust.core import RobustResult, check_same_layout, norms, stacked
from fedpeft.config.adversarial import RobustRuleOptions


class KrumRule(RobustRuleOptions):
    """Krum (Blanchard et al., NeurIPS 2017): each update is scored by the summed squared distances to its
    n - f - 2 nearest other updates and the lowest-scoring one becomes the round's update. Tolerates f
    arbitrary updates when n >= 2f + 3; uses one client's update per round, so it costs accuracy without
    attack, most under skewed clients."""

    rule: Literal["krum"] = "krum"
    num_attackers: int = Field(1, ge=0, description="f: the Byzantine updates per round it must tolerate.")

    def min_updates(self) -> int:
        return 2 * self.num_attackers + 3

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round or lower algorithm.robust.num_attackers"


class MultiKrumRule(KrumRule):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the unweighted mean of the m updates with the lowest Krum
    scores (m = n - f by default), which keeps most of the mean's accuracy without attack."""

    rule: Literal["multi_krum"] = "multi_krum"  # type: ignore[assignment]
    keep: int | None = Field(None, ge=1, description="m: updates averaged; None = n - f (n: the round's updates).")

    def min_updates(self) -> int:
        # Krum's 2f + 3, and m + f so that m updates can be kept while f are left out
        return max(super().min_updates(), (self.keep or 0) + self.num_attackers)


def pairwise_sq_distances(updates: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """n x n squared Euclidean distances between the updates (float64, zeros on the diagonal). Accumulated tensor
    by tensor from Gram matrices of the centred updates (distances do not change when every update moves by the
    same vector, and centring keeps |a|^2 + |b|^2 - 2ab from cancelling a large shared part)."""
    names = check_same_layout(updates)
    n = len(updates)
    d = np.zeros((n, n))
    for name in names:
        m = stacked(updates, name)
        m -= m.mean(axis=0)
        sq = np.einsum("ij,ij->i", m, m)
        d += sq[:, None] + sq[None, :] - 2.0 * m @ m.T
    np.fill_diagonal(d, 0.0)
    return np.maximum(d, 0.0)


def krum_scores(distances: np.ndarray, num_attackers: int) -> np.ndarray:
    """score_i = the sum of the n - f - 2 smallest squared distances from update i to the other updates, given
    the n x n squared distances."""
    n = distances.shape[0]
    neighbours = n - num_attackers - 2
    if neighbours < 1:
        raise ValueError(f"Krum with f={num_attackers} needs at least f + 3 = {num_attackers + 3} updates, got {n}")
    others = np.sort(distances + np.diag(np.full(n, np.inf)), axis=1)[:, :neighbours]  # excluding each update itself
    scores: np.ndarray = others.sum(axis=1)
    return scores


def multi_krum(updates: Sequence[Mapping[str, np.ndarray]], num_attackers: int, keep: int | None) -> RobustResult:
    """The unweighted mean of the ``keep`` updates with the lowest Krum scores (keep=1: Krum; None: n - f).
    Ties go to the update listed first."""
    names = check_same_layout(updates)
    n = len(updates)
    m = n - num_attackers if keep is None else keep
    if not 1 <= m <= n - num_attackers:
        raise ValueError(f"Multi-Krum keeps between 1 and n - f = {n - num_attackers} of {n} updates, asked for {m}")
    scores = krum_scores(pairwise_sq_distances(updates), num_attackers)
    kept = sorted(int(i) for i in np.argsort(scores, kind="stable")[:m])
    aggregate = {k: stacked([updates[i] for i in kept], k).mean(axis=0).reshape(np.shape(updates[0][k]))
                 .astype(np.float32) for k in names}
    return RobustResult(aggregate, kept=kept, scores=[float(s) for s in scores], norms=[float(x) for x in norms(updates)])


def aggregate_krum(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: KrumRule
                   ) -> RobustResult:
    return multi_krum(updates, rule.num_attackers, 1)


def aggregate_multi_krum(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: MultiKrumRule
                         ) -> RobustResult:
    return multi_krum(updates, rule.num_attackers, rule.keep)
