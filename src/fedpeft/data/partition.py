"""Splitting training examples among clients: IID, Dirichlet label skew, Dirichlet quantity skew.

Pure functions of (labels or n, num_clients, a seeded numpy Generator): the same seed gives the same
partition. Every client receives at least ``min_size`` examples; impossible requests fail loudly.

Label skew draws, for every client, a label distribution ``q_c ~ Dirichlet(alpha * p)`` where ``p``
is the global label frequency, then fills the client's quota by sampling labels from ``q_c`` without
replacement (classes that run out are dropped from ``q_c`` and the rest renormalised). Compared with
the per-class split of Hsu et al. (2019) this keeps client sizes under control (equal, or Dirichlet
when ``size_alpha`` is set) and never produces empty clients, even with 1000 clients.

Natural clients come from a column of the data (one category per example, as text; :data:`MISSING` for
rows without a value). ``by_column`` gives every category to exactly one client: with as many categories as
clients each is one client; with more, categories are grouped largest first, each to the client holding the
fewest examples so far (lowest client id on ties; categories of equal size in a seeded random order), so
client 0 holds the largest category. ``dirichlet_column`` is label skew over the categories instead of class
labels (any task type, generation included).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpeft.errors import UserError


class PartitionError(UserError, ValueError):
    pass


MISSING = "(missing)"  # the category of rows whose partition column is null, blank or absent
COLUMN_SCHEMES = ("column", "dirichlet_column")


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


def _show_values(names: np.ndarray, limit: int = 5) -> str:
    shown = ", ".join(repr(str(v)) for v in names[:limit])
    return shown + (f", ... {len(names) - limit} more" if len(names) > limit else "")


def by_column(
    categories: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    min_size: int = 1,
    column: str = "column",
) -> list[np.ndarray]:
    """Each distinct value of ``categories`` (one per example) goes whole to one client: one value per client
    when there are ``num_clients`` of them, else grouped largest first onto the least-loaded client."""
    categories = np.asarray(categories)
    if categories.ndim != 1 or len(categories) == 0:
        raise PartitionError("the column scheme needs one value of the partition column per training example")
    names, codes = np.unique(categories, return_inverse=True)
    counts = np.bincount(codes, minlength=len(names))
    if len(names) < num_clients:
        raise PartitionError(
            f"federation.partition.column {column!r} has {len(names)} distinct values ({_show_values(names)}), "
            f"fewer than federation.num_clients ({num_clients}); set num_clients to at most {len(names)}, choose "
            "a column with more values, or use scheme dirichlet_column"
        )
    order = np.lexsort((rng.permutation(len(names)), -counts))  # largest first, equal sizes in seeded order
    load = np.zeros(num_clients, dtype=np.int64)
    owner = np.empty(len(names), dtype=np.int64)
    for k in order:
        c = int(np.argmin(load))  # the first client with the fewest examples
        owner[k] = c
        load[c] += counts[k]
    small = int(np.argmin(load))
    if load[small] < min_size:
        held = names[np.flatnonzero(owner == small)]
        raise PartitionError(
            f"federation.partition.column {column!r}: client {small} (values {_show_values(held)}) gets "
            f"{load[small]} examples, fewer than federation.partition.min_size ({min_size}); lower min_size or "
            "federation.num_clients"
        )
    client_of = owner[codes]
    return [np.flatnonzero(client_of == c) for c in range(num_clients)]


def dirichlet_column(
    categories: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
    size_alpha: float | None = None,
    column: str = "column",
) -> list[np.ndarray]:
    """Label skew (:func:`dirichlet_label`) over the values of a column instead of class labels."""
    categories = np.asarray(categories)
    if categories.ndim != 1 or len(categories) == 0:
        raise PartitionError("dirichlet_column needs one value of the partition column per training example")
    names, codes = np.unique(categories, return_inverse=True)
    if len(names) < 2:
        raise PartitionError(
            f"federation.partition.column {column!r} has a single value ({_show_values(names)}), so "
            "dirichlet_column cannot skew it; choose a column with at least 2 values"
        )
    return dirichlet_label(codes, num_clients, alpha, rng, min_size, size_alpha)


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
    categories: np.ndarray | None = None,
    column: str | None = None,
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
    if scheme in COLUMN_SCHEMES:
        if categories is None or len(categories) != n:
            raise PartitionError(f"federation.partition.scheme {scheme} needs the value of "
                                 "federation.partition.column for every training example")
        if scheme == "column":
            return by_column(categories, num_clients, rng, min_size, column or "column")
        return dirichlet_column(categories, num_clients, alpha, rng, min_size, size_alpha, column or "column")
    raise PartitionError(f"unknown partition scheme {scheme!r}; valid: iid, dirichlet_label, dirichlet_quantity, "
                         "column, dirichlet_column")


def partition_stats(
    parts: list[np.ndarray],
    labels: np.ndarray | None = None,
    categories: np.ndarray | None = None,
    column: str | None = None,
    label_names: list[str] | None = None,
) -> dict[str, Any]:
    """Sizes and label histograms per client, plus a summary (saved as partition.json); with ``categories``
    (the partition column's value per example) also each client's values and their counts. ``label_names``
    (class id -> name) are kept where they say more than the ids, for :func:`format_stats` to show."""
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
        if label_names and any(name != str(i) for i, name in enumerate(label_names)):
            stats["label_names"] = list(label_names)
        stats["classes_per_client_mean"] = float(np.mean([len(c["labels"]) for c in stats["clients"]]))
        stats["label_entropy_mean"] = float(np.mean(entropies))
        stats["label_entropy_max_possible"] = float(np.log(len(classes)))
        stats["tv_distance_to_global_mean"] = float(np.mean(tv))
    if categories is not None:
        _column_stats(stats, parts, np.asarray(categories), column or "column")
    return stats


def _column_stats(stats: dict[str, Any], parts: list[np.ndarray], categories: np.ndarray, column: str) -> None:
    """Per client ``values`` {value: count} (largest first), and how far the clients' value mixes are from the
    global one (as the label summary)."""
    names, codes = np.unique(categories, return_inverse=True)
    global_p = np.bincount(codes, minlength=len(names)) / len(codes)
    entropies, tv = [], []
    for entry, p in zip(stats["clients"], parts):
        hist = np.bincount(codes[np.asarray(p, dtype=np.int64)], minlength=len(names))
        order = np.lexsort((np.arange(len(names)), -hist))
        entry["values"] = {str(names[k]): int(hist[k]) for k in order if hist[k]}
        q = hist / max(hist.sum(), 1)
        nz = q[q > 0]
        entropies.append(float(-(nz * np.log(nz)).sum()))
        tv.append(float(0.5 * np.abs(q - global_p).sum()))
    stats["column"] = column
    stats["num_values"] = len(names)
    stats["values_per_client_mean"] = float(np.mean([len(c["values"]) for c in stats["clients"]]))
    stats["value_entropy_mean"] = float(np.mean(entropies))
    stats["value_entropy_max_possible"] = float(np.log(len(names)))
    stats["value_tv_distance_to_global_mean"] = float(np.mean(tv))


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
    column = stats.get("column")
    if column is not None:
        lines.append(
            f"column {column!r}: {stats['num_values']} values  values per client (mean): "
            f"{stats['values_per_client_mean']:.2f}  value entropy (mean): {stats['value_entropy_mean']:.3f} of "
            f"{stats['value_entropy_max_possible']:.3f}  TV distance to global (mean): "
            f"{stats['value_tv_distance_to_global_mean']:.3f}"
        )
    has_labels = column is None or any("labels" in c for c in stats["clients"])
    names = stats.get("label_names") or []
    lines.append("client  size  " + " | ".join([*(["labels"] if has_labels else []), *([column] if column else [])]))
    for c in stats["clients"][:max_rows]:
        cells = [" ".join(f"{names[int(k)] if int(k) < len(names) else k}:{v}" for k, v in c.get("labels", {}).items())
                 ] if has_labels else []
        if column is not None:
            cells.append(_values_cell(c.get("values", {})))
        lines.append(f"{c['id']:>6}  {c['size']:>4}  {' | '.join(cells)}")
    if len(stats["clients"]) > max_rows:
        lines.append(f"... {len(stats['clients']) - max_rows} more clients")
    return "\n".join(lines)


def _values_cell(values: dict[str, int], limit: int = 6) -> str:
    """A client's column values, largest first: ``The Eagle:679, Cotto:239, ... 3 more``."""
    shown = [f"{k}:{v}" for k, v in list(values.items())[:limit]]
    if len(values) > limit:
        shown.append(f"... {len(values) - limit} more")
    return ", ".join(shown)
