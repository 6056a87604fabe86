"""Byzantine-robust aggregation of client updates: pure functions over named arrays.

Each rule takes the round's updates ``delta_c = x_c - x`` (one ``dict[str, np.ndarray]`` per client, same names
and shapes) and returns one aggregate of the same form, which the server optimizer then steps on in place of
the weighted mean. The rules see an update as one vector (all its tensors); they work one tensor at a time, in
float64, so their working memory beyond the updates grows with the largest tensor (n copies of it), not with the
whole update. What each rule assumes and costs is in :mod:`fedpeft.config.adversarial`.

* median: coordinate-wise median (Yin et al. 2018);
* trimmed mean: per coordinate, drop the floor(beta n) largest and smallest values, average the rest (same paper);
* Krum / Multi-Krum (Blanchard et al. 2017): score_i = sum of the squared distances from update i to its
  n - f - 2 nearest other updates; Krum returns the update with the lowest score, Multi-Krum the unweighted
  mean of the m lowest-scoring ones;
* norm bounding (Sun et al. 2019): each update scaled to L2 norm <= bound, then the sample-weighted mean.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.config.adversarial import trim_count

Arrays = dict[str, np.ndarray]


@dataclass
class RobustResult:
    """The aggregate and what the rule did to the round's updates (positions in the input order)."""

    aggregate: Arrays
    kept: list[int] | None = None  # Krum / Multi-Krum: the updates the aggregate is made of
    scores: list[float] | None = None  # Krum / Multi-Krum: every update's score
    bound: float | None = None  # norm bounding: the bound applied
    clipped: list[int] = field(default_factory=list)  # norm bounding: the updates scaled down
    trimmed: int | None = None  # trimmed mean: the values dropped at each end of every coordinate
    norms: list[float] = field(default_factory=list)  # every update's L2 norm


def check_same_layout(updates: Sequence[Mapping[str, np.ndarray]]) -> list[str]:
    """The tensor names (sorted), after checking every update has the same names and shapes."""
    names = sorted(updates[0])
    for i, u in enumerate(updates):
        if sorted(u) != names or any(np.shape(u[k]) != np.shape(updates[0][k]) for k in names):
            raise ValueError(f"update {i} has other tensors or shapes than update 0")
    return names


def stacked(updates: Sequence[Mapping[str, np.ndarray]], name: str) -> np.ndarray:
    """The updates' tensor ``name`` as one n x size float64 matrix (one tensor at a time keeps memory small)."""
    return np.stack([np.asarray(u[name], dtype=np.float64).ravel() for u in updates])


def norms(updates: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """Every update's L2 norm over all its tensors (float64)."""
    names = check_same_layout(updates)
    sq = np.zeros(len(updates))
    for name in names:
        m = stacked(updates, name)
        sq += np.einsum("ij,ij->i", m, m)
    return np.sqrt(sq)


def coordinate_median(updates: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    names = check_same_layout(updates)
    return {k: np.median(stacked(updates, k), axis=0).reshape(np.shape(updates[0][k])).astype(np.float32)
            for k in names}


def trimmed_mean(updates: Sequence[Mapping[str, np.ndarray]], trim_fraction: float) -> Arrays:
    """Per coordinate: sort the n values, drop floor(trim_fraction n) at each end, average the rest."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must lie in [0, 0.5), got {trim_fraction}")
    names = check_same_layout(updates)
    n = len(updates)
    k = trim_count(n, trim_fraction)
    return {name: np.sort(stacked(updates, name), axis=0)[k:n - k].mean(axis=0)
            .reshape(np.shape(updates[0][name])).astype(np.float32) for name in names}


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
    return others.sum(axis=1)


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


class Scaled(Mapping[str, np.ndarray]):
    """An update times a factor, each tensor scaled (in float64) only when it is read."""

    def __init__(self, update: Mapping[str, np.ndarray], factor: float):
        self.update, self.factor = update, factor

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.update[name], dtype=np.float64) * self.factor

    def __iter__(self) -> Iterator[str]:
        return iter(self.update)

    def __len__(self) -> int:
        return len(self.update)


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


def robust_aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: Any) -> RobustResult:
    """Aggregate ``updates`` with the rule ``rule`` (an ``algorithm.robust`` section, see
    fedpeft.config.adversarial); ``weights`` (the clients' sample counts) are used by norm bounding only.
    The aggregate is ``.aggregate``; :func:`round_report` turns the rest into metrics.jsonl entries."""
    if not updates:
        raise ValueError("robust aggregation of no updates")
    name = rule.rule
    if name == "norm_bound":
        return norm_bounded_mean(updates, weights, rule.max_norm)
    if name in ("krum", "multi_krum"):
        return multi_krum(updates, rule.num_attackers, 1 if name == "krum" else rule.keep)
    size = [float(x) for x in norms(updates)]
    if name == "median":
        return RobustResult(coordinate_median(updates), norms=size)
    if name == "trimmed_mean":
        return RobustResult(trimmed_mean(updates, rule.trim_fraction), norms=size,
                            trimmed=trim_count(len(updates), rule.trim_fraction))
    raise ValueError(f"unknown robust aggregation rule {name!r}")


def round_report(result: RobustResult, clients: Sequence[int]) -> dict[str, Any]:
    """The rule's effect as metrics.jsonl entries, by client id."""
    out: dict[str, Any] = {"client_update_norm": {str(c): n for c, n in zip(clients, result.norms)}}
    if result.kept is not None:
        out["robust_kept"] = [int(clients[i]) for i in result.kept]
        out["robust_excluded"] = [int(c) for i, c in enumerate(clients) if i not in set(result.kept)]
        out["robust_krum_score"] = {str(c): s for c, s in zip(clients, result.scores or [])}
    if result.trimmed is not None:
        out["robust_trimmed_per_side"] = result.trimmed
    if result.bound is not None:
        out["robust_bound"] = result.bound
        out["robust_clipped"] = [int(clients[i]) for i in result.clipped]
    return out
