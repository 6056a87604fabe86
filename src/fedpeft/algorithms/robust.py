"""Byzantine-robust aggregation of client updates: pure functions over named arrays.

Each rule takes the round's updates ``delta_c = x_c - x`` (one ``dict[str, np.ndarray]`` per client, same names
and shapes) and returns one aggregate of the same form, which the server optimizer then steps on in place of
the weighted mean. The rules see an update as one flat vector (all its tensors, in name order); distances and
norms are computed in float64. What each rule assumes and costs is in :mod:`fedpeft.config.adversarial`.

* median: coordinate-wise median (Yin et al. 2018);
* trimmed mean: per coordinate, drop the floor(beta n) largest and smallest values, average the rest (same paper);
* Krum / Multi-Krum (Blanchard et al. 2017): score_i = sum of the squared distances from update i to its
  n - f - 2 nearest other updates; Krum returns the update with the lowest score, Multi-Krum the unweighted
  mean of the m lowest-scoring ones;
* norm bounding (Sun et al. 2019): each update scaled to L2 norm <= bound, then the sample-weighted mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpeft.algorithms.aggregate import weighted_mean

Arrays = dict[str, np.ndarray]


@dataclass
class RobustResult:
    """The aggregate and what the rule did to the round's updates (positions in the input order)."""

    aggregate: Arrays
    kept: list[int] | None = None  # Krum / Multi-Krum: the updates the aggregate is made of
    scores: list[float] | None = None  # Krum / Multi-Krum: every update's score
    bound: float | None = None  # norm bounding: the bound applied
    clipped: list[int] = field(default_factory=list)  # norm bounding: the updates scaled down
    norms: list[float] = field(default_factory=list)  # every update's L2 norm


def flatten(updates: Sequence[Mapping[str, np.ndarray]]) -> tuple[np.ndarray, list[tuple[str, tuple[int, ...]]]]:
    """(n x D float64 matrix of the updates, the (name, shape) of each block of D in order)."""
    names = sorted(updates[0])
    layout = [(k, tuple(updates[0][k].shape)) for k in names]
    for i, u in enumerate(updates):
        if sorted(u) != names or any(tuple(u[k].shape) != s for k, s in layout):
            raise ValueError(f"update {i} has other tensors or shapes than update 0")
    flat = np.stack([np.concatenate([np.asarray(u[k], dtype=np.float64).ravel() for k in names]) if names
                     else np.zeros(0) for u in updates])
    return flat, layout


def unflatten(vector: np.ndarray, layout: Sequence[tuple[str, tuple[int, ...]]]) -> Arrays:
    out: Arrays = {}
    start = 0
    for name, shape in layout:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = vector[start:start + size].reshape(shape).astype(np.float32)
        start += size
    return out


def coordinate_median(updates: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    flat, layout = flatten(updates)
    return unflatten(np.median(flat, axis=0), layout)


def trimmed_mean(updates: Sequence[Mapping[str, np.ndarray]], trim_fraction: float) -> Arrays:
    """Per coordinate: sort the n values, drop floor(trim_fraction n) at each end, average the rest."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must lie in [0, 0.5), got {trim_fraction}")
    flat, layout = flatten(updates)
    n = flat.shape[0]
    k = int(trim_fraction * n)
    ordered = np.sort(flat, axis=0)
    return unflatten(ordered[k:n - k].mean(axis=0), layout)


def pairwise_sq_distances(flat: np.ndarray) -> np.ndarray:
    """n x n squared Euclidean distances (float64, exact zeros on the diagonal, no negative rounding)."""
    sq = np.einsum("ij,ij->i", flat, flat)
    d = sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T
    np.fill_diagonal(d, 0.0)
    return np.maximum(d, 0.0)


def krum_scores(flat: np.ndarray, num_attackers: int) -> np.ndarray:
    """score_i = the sum of the n - f - 2 smallest squared distances from update i to the other updates."""
    n = flat.shape[0]
    neighbours = n - num_attackers - 2
    if neighbours < 1:
        raise ValueError(f"Krum with f={num_attackers} needs at least f + 3 = {num_attackers + 3} updates, got {n}")
    d = pairwise_sq_distances(flat)
    others = np.sort(d + np.diag(np.full(n, np.inf)), axis=1)[:, :neighbours]  # excluding each update itself
    return others.sum(axis=1)


def multi_krum(updates: Sequence[Mapping[str, np.ndarray]], num_attackers: int, keep: int | None) -> RobustResult:
    """The unweighted mean of the ``keep`` updates with the lowest Krum scores (keep=1: Krum; None: n - f).
    Ties go to the update listed first."""
    flat, layout = flatten(updates)
    n = flat.shape[0]
    m = n - num_attackers if keep is None else keep
    if not 1 <= m <= n:
        raise ValueError(f"Multi-Krum keeps between 1 and {n} updates, asked for {m}")
    scores = krum_scores(flat, num_attackers)
    kept = sorted(int(i) for i in np.argsort(scores, kind="stable")[:m])
    return RobustResult(unflatten(flat[kept].mean(axis=0), layout), kept=kept, scores=[float(s) for s in scores],
                        norms=[float(x) for x in np.linalg.norm(flat, axis=1)])


def norm_bounded_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                      max_norm: float | None) -> RobustResult:
    """Every update scaled to L2 norm <= bound (max_norm, or the median of the updates' norms when None), then
    the weighted mean."""
    flat, layout = flatten(updates)
    norms = np.linalg.norm(flat, axis=1)
    bound = float(np.median(norms)) if max_norm is None else float(max_norm)
    scale = np.ones(len(norms))
    over = norms > bound
    scale[over] = bound / norms[over]
    clipped = [unflatten(row * s, layout) for row, s in zip(flat, scale)]
    return RobustResult(weighted_mean(clipped, weights), bound=bound, clipped=[int(i) for i in np.flatnonzero(over)],
                        norms=[float(x) for x in norms])


def robust_aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rule: Any) -> RobustResult:
    """Aggregate ``updates`` with the rule ``rule`` (an ``algorithm.robust`` section, see
    fedpeft.config.adversarial); ``weights`` (the clients' sample counts) are used by norm bounding only."""
    if not updates:
        raise ValueError("robust aggregation of no updates")
    name = rule.rule
    if name == "norm_bound":
        return norm_bounded_mean(updates, weights, rule.max_norm)
    if name in ("krum", "multi_krum"):
        return multi_krum(updates, rule.num_attackers, 1 if name == "krum" else rule.keep)
    flat, _ = flatten(updates)
    norms = [float(x) for x in np.linalg.norm(flat, axis=1)]
    if name == "median":
        return RobustResult(coordinate_median(updates), norms=norms)
    if name == "trimmed_mean":
        return RobustResult(trimmed_mean(updates, rule.trim_fraction), norms=norms)
    raise ValueError(f"unknown robust aggregation rule {name!r}")


def round_report(result: RobustResult, clients: Sequence[int]) -> dict[str, Any]:
    """The rule's effect as metrics.jsonl entries, by client id."""
    out: dict[str, Any] = {"client_update_norm": {str(c): n for c, n in zip(clients, result.norms)}}
    if result.kept is not None:
        out["robust_kept"] = [int(clients[i]) for i in result.kept]
        out["robust_excluded"] = [int(c) for i, c in enumerate(clients) if i not in set(result.kept)]
        out["robust_krum_score"] = {str(c): s for c, s in zip(clients, result.scores or [])}
    if result.bound is not None:
        out["robust_bound"] = result.bound
        out["robust_clipped"] = [int(clients[i]) for i in result.clipped]
    return out
