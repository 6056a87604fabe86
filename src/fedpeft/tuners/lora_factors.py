"""Pure maths over LoRA factors held as named arrays (no torch, no runtime).

HF PEFT names a LoRA module's factors ``<module>.lora_A.<adapter>.weight`` (shape ``(r, in)``) and
``<module>.lora_B.<adapter>.weight`` (shape ``(out, r)``); the module's update is ``s * B @ A`` with the
constant scale ``s = alpha / r``. Every function here leaves ``s`` out: it is the same for all clients of
a run (heterogeneous ranks keep the configured rank's scale, see :mod:`fedpeft.algorithms.lora.hetero`), so
it changes no aggregate and cancels from every relative error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Arrays = dict[str, np.ndarray]
A_MARK, B_MARK = ".lora_A.", ".lora_B."


@dataclass(frozen=True)
class LoraPair:
    """One adapted module: its name and the names of its A (r x in) and B (out x r) factors."""

    module: str
    a: str
    b: str

    @property
    def adapter(self) -> str:
        """The peft adapter the factors belong to (``default``): the name after ``.lora_A.``."""
        return self.a.split(".lora_A.")[1].split(".")[0]


def lora_pairs(names: Iterable[str]) -> list[LoraPair]:
    """The LoRA modules among ``names``, sorted; raises ValueError if an A has no B or the other way round."""
    a_of: dict[str, str] = {}
    b_of: dict[str, str] = {}
    for name in names:
        for mark, table in ((A_MARK, a_of), (B_MARK, b_of)):
            if mark in name:
                table[name.replace(mark, ".lora_?.")] = name
    unpaired = sorted(set(a_of) ^ set(b_of))
    if unpaired:
        raise ValueError(f"LoRA factor without its partner: {unpaired[0]!r}")
    return [LoraPair(key.split(".lora_?.")[0], a_of[key], b_of[key]) for key in sorted(a_of)]


def factor_names(pairs: Sequence[LoraPair]) -> tuple[set[str], set[str]]:
    """(names of the A factors, names of the B factors)."""
    return {p.a for p in pairs}, {p.b for p in pairs}


def _normalised(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(w)}")
    return w / w.sum()


def _sq_norm_of_sum(terms: Sequence[tuple[float, np.ndarray, np.ndarray]]) -> float:
    """||sum_j c_j B_j A_j||_F^2 from r x r Gram matrices, without forming any out x in product:
    sum_jk c_j c_k tr((B_j^T B_k)(A_k A_j^T))."""
    total = 0.0
    for cj, bj, aj in terms:
        for ck, bk, ak in terms:
            total += cj * ck * float(np.sum((bj.T @ bk) * (aj @ ak.T)))
    return max(total, 0.0)


def aggregation_gap(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                    pair: LoraPair) -> tuple[float, float]:
    """(||sum_i w_i B_i A_i - (sum_i w_i B_i)(sum_i w_i A_i)||_F^2, ||sum_i w_i B_i A_i||_F^2) of one module,
    weights normalised to sum 1. The gap is computed as sum_i w_i B_i (A_i - A_mean), which is exactly 0 for a
    shared A (no cancellation of large terms)."""
    w = _normalised(weights)
    bs = [np.asarray(s[pair.b], dtype=np.float64) for s in states]
    as_ = [np.asarray(s[pair.a], dtype=np.float64) for s in states]
    a_mean = sum(wi * a for wi, a in zip(w, as_))
    ref = _sq_norm_of_sum([(float(wi), b, a) for wi, b, a in zip(w, bs, as_)])
    return _sq_norm_of_sum([(float(wi), b, a - a_mean) for wi, b, a in zip(w, bs, as_)]), ref


def aggregation_error(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                      pairs: Sequence[LoraPair]) -> float:
    """||sum_i w_i B_i A_i - (sum_i w_i B_i)(sum_i w_i A_i)||_F / ||sum_i w_i B_i A_i||_F over all modules
    (weights normalised to sum 1): how far averaging A and B separately lands from averaging the clients'
    updates. 0 when the denominator is 0 (no client moved B off zero)."""
    err = ref = 0.0
    for p in pairs:
        e, r = aggregation_gap(states, weights, p)
        err, ref = err + e, ref + r
    return float(np.sqrt(err / ref)) if ref > 0 else 0.0


def pad_rank(factor: np.ndarray, rank: int, *, is_a: bool) -> np.ndarray:
    """A factor of a smaller rank zero-padded to ``rank`` (A: rows appended, B: columns appended)."""
    have = factor.shape[0] if is_a else factor.shape[1]
    if have > rank:
        raise ValueError(f"cannot pad a rank-{have} factor to rank {rank}")
    width = ((0, rank - have), (0, 0)) if is_a else ((0, 0), (0, rank - have))
    return np.pad(factor, width).astype(np.float32)


def truncate_rank(factor: np.ndarray, rank: int, *, is_a: bool) -> np.ndarray:
    """The first ``rank`` components of a factor (A: its first rows, B: its first columns)."""
    return np.ascontiguousarray(factor[:rank] if is_a else factor[:, :rank]).astype(np.float32)


def svd(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The thin SVD U S V^T of a finite matrix in float64: LAPACK's divide and conquer (gesdd, numpy's), and where
    that does not converge, which it may fail to do on some ill-conditioned matrices, the slower QR iteration
    (gesvd)."""
    m = np.asarray(matrix, dtype=np.float64)
    if not np.all(np.isfinite(m)):
        raise ValueError("the matrix to factorise holds NaN or infinite values")
    try:
        return np.linalg.svd(m, full_matrices=False)
    except np.linalg.LinAlgError:
        import scipy.linalg

        return scipy.linalg.svd(m, full_matrices=False, lapack_driver="gesvd")


def svd_factors(product: np.ndarray, rank: int, *, split: str = "sqrt") -> tuple[np.ndarray, np.ndarray]:
    """The best rank-``rank`` factorisation (B, A) of ``product`` (out x in) in the Frobenius norm (Eckart-Young).
    With product = U S V^T: ``split="sqrt"`` gives B = U_r sqrt(S_r), A = sqrt(S_r) V_r^T (the singular values
    split evenly, so neither factor dominates the other's learning rate); ``split="b"`` gives B = U_r S_r,
    A = V_r^T (orthonormal rows, FlexLoRA's reference code). Either way B @ A = U_r S_r V_r^T."""
    if split not in ("sqrt", "b"):
        raise ValueError(f"split must be 'sqrt' or 'b', not {split!r}")
    u, s, vt = svd(product)
    k = min(rank, s.size)
    to_b, to_a = (np.sqrt(s[:k]), np.sqrt(s[:k])) if split == "sqrt" else (s[:k], np.ones(k))
    b = np.zeros((product.shape[0], rank))
    a = np.zeros((rank, product.shape[1]))
    b[:, :k] = u[:, :k] * to_b
    a[:k] = to_a[:, None] * vt[:k]
    return b.astype(np.float32), a.astype(np.float32)


def weighted_product(states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                     pair: LoraPair, scales: Sequence[float] | None = None) -> np.ndarray:
    """sum_i w_i c_i B_i A_i (weights normalised; ``scales`` c_i, default 1), in float64."""
    w = _normalised(weights)
    c = np.ones(len(states)) if scales is None else np.asarray(scales, dtype=np.float64)
    out = np.zeros((states[0][pair.b].shape[0], states[0][pair.a].shape[1]))
    for wi, ci, s in zip(w, c, states):
        out += wi * ci * (np.asarray(s[pair.b], dtype=np.float64) @ np.asarray(s[pair.a], dtype=np.float64))
    return out


def stack(blocks: Sequence[tuple[float, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, float]:
    """Stacked factors of a sum of LoRA products: for blocks (c_j, B_j, A_j), B_s = [c_1 B_1, c_2 B_2, ...]
    (out x sum r_j) and A_s = [A_1; A_2; ...] (sum r_j x in), so B_s A_s = sum_j c_j B_j A_j (FLoRA's
    stacking). Returned as float32 with ||sum_j c_j B_j A_j - B_s A_s||_F, the error of storing them in
    float32, computed block by block (sum_j (c_j B_j - B_sj) A_j + B_sj (A_j - A_sj)) so that it is not lost
    in cancellation."""
    bs = [(c * np.asarray(b, dtype=np.float64)).astype(np.float32) for c, b, _ in blocks]
    as_ = [np.asarray(a, dtype=np.float32) for _, _, a in blocks]
    terms = []
    for (c, b, a), b32, a32 in zip(blocks, bs, as_):
        b64, a64 = np.asarray(b, dtype=np.float64), np.asarray(a, dtype=np.float64)
        terms += [(1.0, c * b64 - b32, a64), (1.0, b32.astype(np.float64), a64 - a32)]
    return np.concatenate(bs, axis=1), np.concatenate(as_, axis=0), float(np.sqrt(_sq_norm_of_sum(terms)))


def sum_norm(blocks: Sequence[tuple[float, np.ndarray, np.ndarray]]) -> float:
    """||sum_j c_j B_j A_j||_F."""
    return float(np.sqrt(_sq_norm_of_sum([(c, np.asarray(b, np.float64), np.asarray(a, np.float64))
                                          for c, b, a in blocks])))
