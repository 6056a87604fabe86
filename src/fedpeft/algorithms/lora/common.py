"""What the federated LoRA methods share: the config check, finding the factors, a weighted mean over
some of the trainable tensors, and a digest that proves two processes hold the same frozen tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.options import LoraFedAvgOptions, RankGroup
from fedpeft.tuners.lora_factors import LoraPair, lora_pairs
from fedpeft.wire import Arrays

# (the clients' changes, their sample counts, their ids) -> what the server steps on
Combine = Callable[[list[Arrays], list[float], list[int]], Arrays]


def weighted_combine(deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays:
    """The clients' sample-weighted mean change (FedAvg's)."""
    return weighted_mean(deltas, weights)


def pairs_in(names: Iterable[str], algorithm: str) -> list[LoraPair]:
    names = list(names)
    pairs = lora_pairs(names)
    if not pairs:
        raise ValueError(f"algorithm {algorithm} found no LoRA factors (names with .lora_A. / .lora_B.) among "
                         "the trainable parameters; use peft.method: lora")
    paired = {n for p in pairs for n in (p.a, p.b)}
    other = sorted(n for n in names if "lora_" in n and n not in paired)
    if other:  # e.g. LoRA on an embedding layer (lora_embedding_A/B), which these methods would average as is
        raise ValueError(f"algorithm {algorithm} handles LoRA on linear layers only, not {other[0]!r}: remove that "
                         "layer from peft.target_modules")
    return pairs


def mean_step(global_state: Mapping[str, np.ndarray], updates: Mapping[int, fedpeft.Payload], keys: Iterable[str],
              server_lr: float, combine: Combine = weighted_combine) -> tuple[dict[str, np.ndarray], float]:
    """The global state with ``keys`` moved by server_lr times the clients' sample-weighted mean change
    (FedAvg on those tensors; the others unchanged), or what ``combine`` puts in the mean's place; and the norm of
    that change."""
    keys = sorted(keys)
    ids = sorted(updates)
    deltas = [{k: updates[c].arrays[k].astype(np.float32) - global_state[k] for k in keys} for c in ids]
    mean = combine(deltas, [updates[c].meta["num_examples"] for c in ids], ids)
    state = dict(global_state)
    for k in keys:
        state[k] = (global_state[k] + np.float32(server_lr) * mean[k]).astype(np.float32)
    norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in mean.values())))
    return state, norm


LoraFedAvgOptionsT = TypeVar("LoraFedAvgOptionsT", bound=LoraFedAvgOptions)


class MeanStepServer(fedpeft.ServerAlgorithm[LoraFedAvgOptionsT]):
    """A server that moves some of the trainable tensors by the clients' mean change (:func:`mean_step`, through
    :meth:`combine`, whose place the ``robust`` wrapper takes when the options ask for it)."""

    def step_on(self, rnd: int, updates: Mapping[int, fedpeft.Payload], keys: Iterable[str]) -> float:
        """Move ``keys`` of the global state by the updates' mean change (or the wrapper's aggregate); returns its
        norm."""
        self.global_state, norm = mean_step(self.global_state, updates, keys, self.options.server_lr,
                                            lambda deltas, weights, ids: self.combine(rnd, deltas, weights, ids))
        return norm


def digest(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the names, shapes and float32 bytes of ``arrays`` (in name order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(f"{name}:{value.shape};".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def round_meta(payload: fedpeft.Payload, ctx: fedpeft.ClientContext, result: Any, **extra: Any) -> dict[str, Any]:
    """The update's metadata: round, client, examples and the local training's counters."""
    return {"round": payload.meta["round"], "client": ctx.client_id, "num_examples": ctx.num_examples,
            **result.as_meta(), **extra}


def assign_ranks(num_clients: int, groups: Sequence[RankGroup], seed: int,
                 explicit: Mapping[int, int] | None = None) -> list[int]:
    """Each client's rank: group sizes by largest remainder of share x num_clients (ties to the earlier
    group), members drawn by a permutation seeded by ``seed``; ``explicit`` overrides single clients."""
    quotas = [g.share * num_clients for g in groups]
    counts = [int(np.floor(q)) for q in quotas]
    order = sorted(range(len(groups)), key=lambda j: (-(quotas[j] - counts[j]), j))
    for j in order[: num_clients - sum(counts)]:
        counts[j] += 1
    ranks = [g.rank for g, n in zip(groups, counts) for _ in range(n)]
    perm = np.random.default_rng([seed, 0x4E7A]).permutation(num_clients)
    out = [0] * num_clients
    for position, client in enumerate(perm):
        out[int(client)] = ranks[position]
    for client, rank in (explicit or {}).items():
        out[client] = rank
    return out


def spec_at_rank(expected: Mapping[str, tuple[tuple[int, ...], str]], pairs: Iterable[LoraPair],
                 rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The update spec (name -> (shape, dtype)) of a client of ``rank``: every A cut to its first ``rank`` rows and
    every B to its first ``rank`` columns; the other tensors as ``expected``."""
    spec = dict(expected)
    for p in pairs:
        spec[p.a] = ((rank, *spec[p.a][0][1:]), spec[p.a][1])
        spec[p.b] = ((*spec[p.b][0][:-1], rank), spec[p.b][1])
    return spec
