"""What every Byzantine-robust aggregation rule shares: pure functions over named arrays.

A rule takes the round's updates ``delta_c = x_c - x`` (one ``dict[str, np.ndarray]`` per client, same names
and shapes), the clients' sample counts and its options, and returns a :class:`RobustResult`: one aggregate of the
same form, which the server optimizer then steps on in place of the weighted mean, and what the rule did. The
rules see an update as one vector (all its tensors); fedpeft's work one tensor at a time, in float64, so their
working memory beyond the updates grows with the largest tensor (n copies of it), not with the whole update.
Each rule is registered (``fedpeft.register_robust_rule``) with its options, which say what it assumes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
