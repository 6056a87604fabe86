"""FedPepTAO's server step (paper 002, Algorithm 2, lines 12-25): pure maths over named arrays.

Notation: w the global prompt parameters, Delta_i = w_i - w the update of client i after its local
Adam steps (K_i steps at learning rate alpha), p_i = n_i / sum_S n the weights of Formula 4 over the
round's clients S, M the number of clients, beta the momentum, eta_r the server learning rate.

    Delta^r = sum_i p_i Delta_i                          aggregated update (line 12)
    c_i'    = c_i - c_g - Delta_i / (K_i alpha)          client control variates, on the server (14)
    c_g'    = c_g + |S|/|M| * sum_i p_i (c_i' - c_i)     global control variate (15-18)
    g^r     = Delta^r - Delta^(r-1)                      (19; see below)
    m_i     = beta m + (1 - beta) g^r + c_g' - c_i'      per-client momentum (21)
    w_i     = (w + Delta^r) - eta_r m_i                  per-client parameters (22; see below)
    w', m'  = sum_i p_i w_i, sum_i p_i m_i               (24-25)

Two points where the paper's text and its reference code (llm-eff/FedPepTAO) differ, and the code is
followed because the text cannot be what was run:
* Line 22 starts from w^(r-1): the aggregated update Delta^r would then reach the model only through
  the difference g^r, never itself. The code starts from the FedAvg result w + Delta^r.
* Line 19 writes g = Delta^(r-1) - Delta^r; the code uses Delta^r - Delta^(r-1) (its
  ``pre_grad - grad`` with grad = w - mean(w_i)). The round with no previous update (the first)
  is plain FedAvg: the control variates are updated, the momentum step is skipped.
The code also chains the per-client momentum steps one after another through shared state; the
parallel form of lines 20-25 is used here, with every m_i starting from the same m.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedpeft.algorithms.aggregate import weighted_mean

Arrays = dict[str, np.ndarray]


def server_lr(rnd: int, initial: float, decay: float, minimum: float) -> float:
    """eta_r = max(initial * decay^r, minimum) for round r >= 1 (the reference decays before first use)."""
    return max(initial * decay**rnd, minimum)


def zeros_like(x: Mapping[str, np.ndarray]) -> Arrays:
    return {k: np.zeros_like(v, dtype=np.float32) for k, v in x.items()}


def adaptive_step(
    w: Mapping[str, np.ndarray], updates: Sequence[Mapping[str, np.ndarray]], num_examples: Sequence[int],
    local_steps: Sequence[int], client_lr: float | Sequence[float],
    c_clients: Sequence[Mapping[str, np.ndarray] | None],
    c_global: Mapping[str, np.ndarray] | None, momentum: Mapping[str, np.ndarray] | None,
    prev_update: Mapping[str, np.ndarray] | None, *, beta: float, eta: float, sampled_fraction: float,
    control_variates: bool = True,
) -> tuple[Arrays, Arrays | None, Arrays, list[Arrays], Arrays]:
    """One round of Algorithm 2 on the server.

    ``client_lr`` is alpha, one for all clients or one per client; ``c_clients[i]`` is client i's control
    variate (None: never seen, i.e. 0); ``sampled_fraction`` is
    |S| / |M|. Returns (new w, new m or None in a round without a previous update, new c_g, the sampled
    clients' new c_i, Delta^r). With ``control_variates=False`` (the MomS baselines) the c terms are
    left out of line 21 and the control variates are returned as zeros."""
    if not updates:
        raise ValueError("a round needs at least one update")
    n = np.asarray(num_examples, dtype=np.float64)
    p = n / n.sum()
    delta = weighted_mean(updates, p)
    cg = dict(c_global) if c_global is not None else zeros_like(w)
    lrs = np.broadcast_to(np.asarray(client_lr, dtype=np.float64), (len(updates),))
    c_new: list[Arrays] = []
    for u, k_steps, lr, c_old in zip(updates, local_steps, lrs, c_clients):
        if k_steps <= 0:
            raise ValueError("local_steps must be positive")
        c0 = c_old if c_old is not None else zeros_like(w)
        c_new.append({k: (c0[k] - cg[k] - u[k] / (k_steps * lr)).astype(np.float32) for k in w})
    dc = weighted_mean([{k: c1[k] - (c0[k] if c0 is not None else 0.0) for k in w} for c1, c0 in zip(c_new, c_clients)], p)
    cg_new = {k: (cg[k] + sampled_fraction * dc[k]).astype(np.float32) for k in w}
    if not control_variates:
        cg_new, c_new = zeros_like(w), [zeros_like(w) for _ in c_new]
    fedavg = {k: (w[k] + delta[k]).astype(np.float32) for k in w}
    if prev_update is None:  # first round: FedAvg, nothing to take a momentum step on yet
        return fedavg, None, cg_new, c_new, delta
    m0 = momentum if momentum is not None else zeros_like(w)
    g = {k: delta[k] - prev_update[k] for k in w}
    m_i = [{k: (beta * m0[k] + (1 - beta) * g[k] + cg_new[k] - ci[k]).astype(np.float32) for k in w} for ci in c_new]
    w_i = [{k: (fedavg[k] - eta * mi[k]).astype(np.float32) for k in w} for mi in m_i]
    return weighted_mean(w_i, p), weighted_mean(m_i, p), cg_new, c_new, delta
