"""Head pruning (paper 000, Eq. 7) and the sparse per-head wire format.

A pruned upload carries: every non-head trainable parameter in full; every head-associated parameter
packed, i.e. only the slices of the kept heads concatenated along its head axis in layout order; the
sorted kept head ids (``KEPT_KEY``, int32); and, for importance pruning, the importance vector with
Eq. 7 applied (``ALPHA_KEY``, float32, pruned heads 0). The receiver rebuilds the full tensors from the
layout and the kept ids, so the byte count of the payload is exactly what is sent.
"""

from __future__ import annotations

import math

import numpy as np

from fedpeft.heads.layout import HeadLayout, HeadParam

KEPT_KEY = "fedpeft.heads.kept"
ALPHA_KEY = "fedpeft.heads.alpha"


def keep_count(num: int, sparsity: float) -> int:
    """Heads kept at ``sparsity`` (the top (1 - s) fraction, at least one)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    return max(1, math.floor((1.0 - sparsity) * num + 0.5))


def kept_by_importance(alpha: np.ndarray, sparsity: float, layout: HeadLayout, *, per_module: bool = False) -> np.ndarray:
    """Eq. 7: keep the heads at or above the threshold that keeps the top (1 - s) fraction, over all
    heads of the model (or within every attention module). Ties go to the lower head id."""
    alpha = np.asarray(alpha, dtype=np.float64)
    if per_module:
        H = layout.heads_per_module
        kept = [m * H + _top(alpha[m * H:(m + 1) * H], keep_count(H, sparsity)) for m in range(layout.num_modules)]
        return np.sort(np.concatenate(kept)).astype(np.int32)
    return np.sort(_top(alpha, keep_count(len(alpha), sparsity))).astype(np.int32)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(len(values)), -values))  # by value descending, then id ascending
    return order[:k]


def kept_at_random(layout: HeadLayout, sparsity: float, rng: np.random.Generator, *, per_module: bool = False) -> np.ndarray:
    """Baseline B2: the same number of heads as Eq. 7 keeps, chosen uniformly at random."""
    if per_module:
        H = layout.heads_per_module
        k = keep_count(H, sparsity)
        kept = [m * H + rng.choice(H, size=k, replace=False) for m in range(layout.num_modules)]
        return np.sort(np.concatenate(kept)).astype(np.int32)
    return np.sort(rng.choice(layout.num_heads, size=keep_count(layout.num_heads, sparsity), replace=False)).astype(np.int32)


def _take(param: HeadParam, value: np.ndarray, kept: set[int]) -> np.ndarray:
    units = param.kept_units(kept)
    if not units:
        return np.zeros(param.packed_shape(kept), dtype=value.dtype)
    return np.concatenate([np.take(value, range(u.start, u.stop), axis=param.axis) for u in units], axis=param.axis)


def pack(state: dict[str, np.ndarray], layout: HeadLayout, kept: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of a pruned upload (without alpha): non-head in full, head parameters packed, kept ids."""
    kept_set = {int(h) for h in kept}
    out = {}
    for name, value in state.items():
        param = layout.params.get(name)
        out[name] = value if param is None else _take(param, value, kept_set)
    out[KEPT_KEY] = np.asarray(kept, dtype=np.int32)
    return out


def packed_spec(spec: dict[str, tuple[tuple[int, ...], str]], layout: HeadLayout, kept: np.ndarray, *,
                with_scores: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every array :func:`pack` makes from a state of ``spec`` (plus the importance scores
    when the upload carries them), without the values: for accounting (``wire.encoded_size``)."""
    kept_set = {int(h) for h in kept}
    out = {n: ((layout.params[n].packed_shape(kept_set) if n in layout.params else tuple(shape)), dtype)
           for n, (shape, dtype) in spec.items()}
    out[KEPT_KEY] = ((len(kept_set),), "int32")
    if with_scores:
        out[ALPHA_KEY] = ((layout.num_heads,), "float32")
    return out


def unpack_into(param: HeadParam, packed: np.ndarray, kept: set[int], target: np.ndarray) -> None:
    """Write the packed slices back into ``target`` (a full-shape array) at their positions."""
    offset = 0
    for u in param.kept_units(kept):
        index = [slice(None)] * target.ndim
        index[param.axis] = slice(u.start, u.stop)
        source = [slice(None)] * packed.ndim
        source[param.axis] = slice(offset, offset + u.size)
        target[tuple(index)] = packed[tuple(source)]
        offset += u.size


def pruned_mask(param: HeadParam, kept: set[int]) -> np.ndarray:
    """Boolean mask (full shape) of the entries of ``param`` that belong to no kept head."""
    mask = np.zeros(param.shape, dtype=bool)
    index = [slice(None)] * len(param.shape)
    for u in param.units:
        if not any(h in kept for h in u.heads):
            index[param.axis] = slice(u.start, u.stop)
            mask[tuple(index)] = True
    return mask
