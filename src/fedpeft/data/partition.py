"""Splitting training examples among clients: IID, Dirichlet label skew, Dirichlet quantity skew.

Pure functions of (labels or n, num_clients, a seeded numpy Generator): the same seed gives the same
partition. Every client receives at least ``min_size`` examples; impossible requests fail loudly.

Label skew draws, for every client, a label distribution ``q_c ~ Dirichlet(alpha * p)`` where ``p``
is the global label frequency, then fills the client's quota by sampling labels from ``q_c`` without
replacement (classes that run out are dropped from ``q_c`` and the rest renormalised). Compared with
the per-class split of Hsu et al. (2019) this keeps client sizes under control (equal, or Dirichlet
when ``size_alpha`` is set) and never produces empty clients, even with 1000 clients.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpeft.errors import UserError


class PartitionError(UserError, ValueError):
    pass


def client_sizes(n: int, num_clients: int, rng: np.random.Generator, alpha: float | None, min_size: int) -> np.ndarray:
    """Sizes summing to n: equal (alpha None) or proportional to Dirichlet(alpha) draws, each >= min_size."""
    if num_clients * min_size > n:
        raise PartitionError(
            f"{n} examples cannot give {num_clients} clients at least {min_size} each; "
            "use fewer clients, a smaller min_size or more data"
        )
    spare = n - num_clients * min_size
    if alpha is None:
        shares = np.full(num_clients, spare / num_clients)
    else:
        shares = rng.dirichlet(np.full(num_clients, alpha)) * spare
    sizes = np.floor(shares).astype(np.int64)
    remainder = spare - int(sizes.sum())
    if remainder:
        # hand out the rest by largest fractional part (ties by client index): deterministic
        order = np.lexsort((np.arange(num_clients), -(shares - sizes)))
        sizes[order[:remainder]] += 1
    return sizes + min_size


def iid(n: int, num_clients: int, rng: np.random.Generator, min_size: int = 1) -> list[np.ndarray]:
    perm = rng.permutation(n)
    sizes = client_sizes(n, num_clients, rng, None, min_size)
    return [np.sort(p) for p in np.split(perm, np.cumsum(sizes)[:-1])]


def dirichlet_quantity(
    n: int, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 1
) -> list[np.ndarray]:
    """IID labels, client sizes from Dirichlet(alpha)."""
    sizes = client_sizes(n, num_clients, rng, alpha, min_size)
    perm = rng.permutation(n)
    return [np.sort(p) for p in np.split(perm, np.cumsum(sizes)[:-1])]


def dirichlet_label(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
    size_alpha: float | None = None,
) -> list[np.ndarray]:
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0:
        raise PartitionError("dirichlet_label needs one integer class label per training example")
    classes, y = np.unique(labels, return_inverse=True)
    num_classes = len(classes)
    sizes = client_sizes(len(labels), num_clients, rng, size_alpha, min_size)
    prior = np.bincount(y, minlength=num_classes) / len(y)
    pools = [rng.permutation(np.flatnonzero(y == k)) for k in range(num_classes)]
    taken = np.zeros(num_classes, dtype=np.int64)
    remaining = np.array([len(p) for p in pools], dtype=np.int64)
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for c in rng.permutation(num_clients):
        q = rng.dirichlet(alpha * prior * num_classes)
        if not np.all(np.isfinite(q)):  # tiny concentrations can underflow to 0/0
            q = np.eye(num_classes)[rng.choice(num_classes, p=prior)]
        need = int(sizes[c])
        parts = []
        while need > 0:
            weights = np.where(remaining > 0, q, 0.0)
            if weights.sum() <= 0:  # q put all its mass on exhausted classes
                weights = (remaining > 0).astype(np.float64)
            draw = np.minimum(rng.multinomial(need, weights / weights.sum()), remaining)
            for k in np.flatnonzero(draw):
                parts.append(pools[k][taken[k] : taken[k] + draw[k]])
            taken += draw
            remaining -= draw
            need -= int(draw.sum())
        out[c] = np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
    return out


def partition(
    scheme: str,
    num_clients: int,
    rng: np.random.Generator,
    *,
    n: int,
    labels: np.ndarray | None = None,
    alpha: float = 0.5,
    size_alpha: float | None = None,
    min_size: int = 1,
) -> list[np.ndarray]:
    if scheme == "iid":
        return iid(n, num_clients, rng, min_size)
    if scheme == "dirichlet_quantity":
        return dirichlet_quantity(n, num_clients, alpha, rng, min_size)
    if scheme == "dirichlet_label":
        if labels is None:
            raise PartitionError(
                "federation.partition.scheme dirichlet_label needs class labels; this task has none "
                "(use iid or dirichlet_quantity)"
            )
        return dirichlet_label(labels, num_clients, alpha, rng, min_size, size_alpha)
    raise PartitionError(f"unknown partition scheme {scheme!r}; valid: iid, dirichlet_label, dirichlet_quantity")


def partition_stats(parts: list[np.ndarray], labels: np.ndarray | None = None) -> dict[str, Any]:
    """Sizes and label histograms per client, plus a summary (saved as partition.json)."""
    sizes = np.array([len(p) for p in parts])
    stats: dict[str, Any] = {
        "num_clients": len(parts),
        "num_examples": int(sizes.sum()),
        "size_min": int(sizes.min()),
        "size_max": int(sizes.max()),
        "size_mean": float(sizes.mean()),
        "size_std": float(sizes.std()),
        "clients": [{"id": i, "size": int(s)} for i, s in enumerate(sizes)],
    }
    if labels is not None:
        labels = np.asarray(labels)
        classes = np.unique(labels)
        global_hist = np.array([(labels == k).sum() for k in classes], dtype=np.float64)
        global_p = global_hist / global_hist.sum()
        entropies, tv = [], []
        for entry, p in zip(stats["clients"], parts):
            hist = np.array([(labels[p] == k).sum() for k in classes])
            entry["labels"] = {str(int(k)): int(v) for k, v in zip(classes, hist) if v}
            q = hist / max(hist.sum(), 1)
            nz = q[q > 0]
            entropies.append(float(-(nz * np.log(nz)).sum()))
            tv.append(float(0.5 * np.abs(q - global_p).sum()))
        stats["num_classes"] = len(classes)
        stats["classes_per_client_mean"] = float(np.mean([len(c["labels"]) for c in stats["clients"]]))
        stats["label_entropy_mean"] = float(np.mean(entropies))
        stats["label_entropy_max_possible"] = float(np.log(len(classes)))
        stats["tv_distance_to_global_mean"] = float(np.mean(tv))
    return stats


def format_stats(stats: dict[str, Any], max_rows: int = 20) -> str:
    lines = [
        (f"clients: {stats['num_clients']}  examples: {stats['num_examples']}  "
        f"size min/mean/max: {stats['size_min']}/{stats['size_mean']:.1f}/{stats['size_max']} (std {stats['size_std']:.1f})")
    ]
    if "num_classes" in stats:
        lines.append(
            f"classes: {stats['num_classes']}  classes per client (mean): {stats['classes_per_client_mean']:.2f}  "
            f"label entropy (mean): {stats['label_entropy_mean']:.3f} of {stats['label_entropy_max_possible']:.3f}  "
            f"TV distance to global (mean): {stats['tv_distance_to_global_mean']:.3f}"
        )
    lines.append("client  size  labels")
    for c in stats["clients"][:max_rows]:
        lab = " ".join(f"{k}:{v}" for k, v in c.get("labels", {}).items())
        lines.append(f"{c['id']:>6}  {c['size']:>4}  {lab}")
    if len(stats["clients"]) > max_rows:
        lines.append(f"... {len(stats['clients']) - max_rows} more clients")
    return "\n".join(lines)
