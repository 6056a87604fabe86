"""Pure aggregation maths over named arrays (``dict[str, np.ndarray]``), one function per rule.

Notation: ``x`` global parameters, ``delta_c = x_c - x`` the update of client c, ``n_c`` its number of
training examples. Every server optimizer takes the pseudo-gradient ``d = sum_c n_c delta_c / sum_c n_c``
(paper 000, Eq. 5) and returns the new state; FedAdam / FedYogi follow Reddi et al. 2021 (Adaptive
Federated Optimization, Alg. 2): no bias correction, ``v`` initialised to ``tau**2``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Arrays = dict[str, np.ndarray]


def deltas(global_state: Mapping[str, np.ndarray], client_state: Mapping[str, np.ndarray]) -> Arrays:
    return {k: client_state[k].astype(np.float32) - global_state[k] for k in global_state}


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of all of ``arrays`` together (summed in float64)."""
    return float(math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values())))


def weighted_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> Arrays:
    """sum_c w_c u_c / sum_c w_c, computed in float64 and returned as float32."""
    if not updates:
        raise ValueError("weighted_mean of no updates")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(w)}")
    w = w / w.sum()
    out: Arrays = {}
    for k in updates[0]:
        acc = np.zeros(updates[0][k].shape, dtype=np.float64)
        for wi, u in zip(w, updates):
            acc += wi * u[k]
        out[k] = acc.astype(np.float32)
    return out


def fedavg_step(x: Mapping[str, np.ndarray], d: Mapping[str, np.ndarray], server_lr: float) -> Arrays:
    """x + eta * d (Eq. 5 of paper 000; eta = 1 is plain FedAvg)."""
    return {k: (x[k] + server_lr * d[k]).astype(np.float32) for k in x}


def fedavgm_step(
    x: Mapping[str, np.ndarray], d: Mapping[str, np.ndarray], m: Mapping[str, np.ndarray] | None,
    server_lr: float, momentum: float,
) -> tuple[Arrays, Arrays]:
    """Server momentum (Hsu et al. 2019): m = beta m + d; x = x + eta m. Returns (x, m)."""
    m_new = {k: (momentum * (m[k] if m is not None else 0.0) + d[k]).astype(np.float32) for k in x}
    return {k: (x[k] + server_lr * m_new[k]).astype(np.float32) for k in x}, m_new


def _adaptive_step(x, d, m, v, server_lr, beta1, tau, second_moment, initial_v) -> tuple[Arrays, Arrays, Arrays]:
    m0 = m if m is not None else {k: np.zeros_like(x[k]) for k in x}
    v0 = v if v is not None else {k: np.full_like(x[k], tau * tau if initial_v is None else initial_v) for k in x}
    m_new = {k: (beta1 * m0[k] + (1 - beta1) * d[k]).astype(np.float32) for k in x}
    v_new = {k: second_moment(v0[k], np.square(d[k])).astype(np.float32) for k in x}
    x_new = {k: (x[k] + server_lr * m_new[k] / (np.sqrt(v_new[k]) + tau)).astype(np.float32) for k in x}
    return x_new, m_new, v_new


def fedadam_step(
    x: Mapping[str, np.ndarray], d: Mapping[str, np.ndarray], m: Mapping[str, np.ndarray] | None,
    v: Mapping[str, np.ndarray] | None, server_lr: float, beta1: float, beta2: float, tau: float,
    initial_v: float | None = None,
) -> tuple[Arrays, Arrays, Arrays]:
    """m = b1 m + (1-b1) d; v = b2 v + (1-b2) d^2; x = x + eta m / (sqrt(v) + tau), m starting at 0 and v at
    ``initial_v`` (default tau^2, Reddi et al.'s). Returns (x, m, v)."""
    return _adaptive_step(x, d, m, v, server_lr, beta1, tau, lambda v0, d2: beta2 * v0 + (1 - beta2) * d2,
                          initial_v)


def fedyogi_step(
    x: Mapping[str, np.ndarray], d: Mapping[str, np.ndarray], m: Mapping[str, np.ndarray] | None,
    v: Mapping[str, np.ndarray] | None, server_lr: float, beta1: float, beta2: float, tau: float,
    initial_v: float | None = None,
) -> tuple[Arrays, Arrays, Arrays]:
    """As FedAdam but v = v - (1-b2) d^2 sign(v - d^2). Returns (x, m, v)."""
    return _adaptive_step(x, d, m, v, server_lr, beta1, tau, lambda v0, d2: v0 - (1 - beta2) * d2 * np.sign(v0 - d2),
                          initial_v)
