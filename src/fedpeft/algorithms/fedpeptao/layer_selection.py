"""Which layers' prompts travel (FedPepTAO, paper 002 Sec. 4.2 and Algorithm 1): pure maths.

Layer scores (Eq. 2-3). For one client and one layer l, take the hidden states that layer l outputs
for a batch of n samples, one flattened vector per sample; form the n x n kernel of their pairwise
cosine similarities and its eigenvalues lambda_1..lambda_n; the layer's score is

    zeta_l = (1/n) * sum_j [ log(lambda_j + eps) + 1 / (lambda_j + eps) ],   eps = 1e-5.

The paper writes the kernel over layers (an L x L matrix of layer-to-layer similarities) but then
indexes eigenvalues by sample, and its reference code builds the samples x samples kernel per layer
(``run_getscore.py``); that is the reading implemented here. The mean (the paper's 1/n_i) replaces the
reference's sum, which only rescales scores computed on equal batches. The kernel is symmetric
positive semi-definite, so its eigenvalues come from ``eigvalsh`` and round-off negatives are set to
0 (log of a negative number is undefined).

Aggregation (Formula 4): a sample-weighted mean over clients, weights n_i / sum(n).

Selection (Algorithm 1, lines 16-19): layers in descending score order are added until the selected
layers hold at least a fraction ``ratio`` of all prompt parameters. The baselines of the paper's
Appendix B.6 order the layers otherwise: ``random`` (seeded), ``ascending`` (bottom layers first) and
``descending`` (top layers first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-5
ORDERS = ("score", "random", "ascending", "descending")


def cosine_kernel(features: np.ndarray) -> np.ndarray:
    """(n, d) -> (n, n) matrix of cosine similarities between the rows (a zero row is similar to nothing)."""
    x = np.asarray(features, dtype=np.float64).reshape(len(features), -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    unit = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    return unit @ unit.T


def layer_score(features: np.ndarray, eps: float = EPS) -> float:
    """zeta (Eq. 3) of one layer from its (n_samples, ...) hidden states."""
    if len(features) < 2:
        raise ValueError("a layer score needs the hidden states of at least 2 samples")
    lam = np.clip(np.linalg.eigvalsh(cosine_kernel(features)), 0.0, None)
    return float(np.mean(np.log(lam + eps) + 1.0 / (lam + eps)))


def aggregate_scores(client_scores: Sequence[Sequence[float]], num_examples: Sequence[int]) -> np.ndarray:
    """Formula 4: sum_i n_i / sum(n) * zeta_i, per layer."""
    scores = np.asarray(client_scores, dtype=np.float64)
    n = np.asarray(num_examples, dtype=np.float64)
    if scores.ndim != 2 or len(scores) != len(n) or len(n) == 0:
        raise ValueError("need one row of layer scores per client and one example count per client")
    if np.any(n <= 0):
        raise ValueError(f"example counts must be positive, got {n.tolist()}")
    return (n[:, None] * scores).sum(axis=0) / n.sum()


def layer_order(scores: Sequence[float], order: str = "score", seed: int = 0) -> list[int]:
    """Layer indices in the order they are selected."""
    count = len(scores)
    if order == "score":  # highest score first; ties by layer index
        return sorted(range(count), key=lambda l: (-scores[l], l))
    if order == "random":
        return [int(l) for l in np.random.default_rng([seed, 0x1A7E5]).permutation(count)]
    if order == "ascending":
        return list(range(count))
    if order == "descending":
        return list(range(count - 1, -1, -1))
    raise ValueError(f"unknown layer order {order!r}; choose one of {ORDERS}")


def select_layers(ordered: Sequence[int], layer_params: Sequence[int], ratio: float) -> list[int]:
    """Algorithm 1 lines 17-19: take layers in the given order while the selected share of prompt
    parameters is below ``ratio``; returns the selected layers, sorted."""
    if not 0 < ratio <= 1:
        raise ValueError(f"the parameter ratio must be in (0, 1], got {ratio}")
    total = float(sum(layer_params))
    chosen: list[int] = []
    have = 0.0
    for layer in ordered:
        if have / total >= ratio:
            break
        chosen.append(int(layer))
        have += layer_params[layer]
    return sorted(chosen)
