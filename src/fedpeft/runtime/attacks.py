"""Simulated Byzantine clients (``federation.attackers``), the same in every runtime.

Which clients attack is a pure function of the run's seed, so the server process and every client process
agree without talking about it (the server is never told; it only logs who attacked, for the analysis).
An attacker trains like everyone else (label_flip: on flipped labels) and then poisons what it sends: every
float tensor of its update that it also received (same name and shape) becomes
``received + poison(update - received)``; other tensors (e.g. headprune's importance scores) go out as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np

from fedpeft.config import RunConfig
from fedpeft.data.batching import Encoded, ImageEncoded
from fedpeft.wire import Payload

EncodedT = TypeVar("EncodedT", Encoded, ImageEncoded)

ATTACK_SEED = 0xA77AC4


def attacker_ids(cfg: RunConfig) -> frozenset[int]:
    """The attacking clients: round(fraction x num_clients) of them, drawn once from the run's seed."""
    attackers = cfg.federation.attackers
    if attackers is None or attackers.fraction == 0:
        return frozenset()
    n = cfg.federation.num_clients
    rng = np.random.default_rng([cfg.seed, ATTACK_SEED])
    return frozenset(int(c) for c in rng.choice(n, size=attackers.count(n), replace=False))


def flip_labels(data: EncodedT, num_labels: int) -> EncodedT:
    """The examples (texts or images) with class label y replaced by num_labels - 1 - y (label_flip)."""
    return dataclasses.replace(data, labels=[num_labels - 1 - int(y) for y in data.labels])


def poison(update: Payload, received: Payload, cfg: RunConfig, rnd: int, cid: int) -> Payload:
    """The update an attacking client sends in place of its honest ``update`` (sign_flip, scale, noise; a
    label_flip attacker's update is already poisoned by its data and goes out as it is)."""
    attackers = cfg.federation.attackers
    if attackers is None or attackers.attack == "label_flip":
        return update
    rng = np.random.default_rng([cfg.seed, rnd, cid, ATTACK_SEED])
    arrays = dict(update.arrays)
    poisoned = 0
    for name in sorted(update.arrays):
        sent = update.arrays[name]
        base = received.arrays.get(name)
        if base is not None and base.ndim == sent.ndim and base.shape != sent.shape and all(
                s <= b for s, b in zip(sent.shape, base.shape)):  # a tensor the client cut (a HetLoRA client that
            base = base[tuple(slice(0, s) for s in sent.shape)]  # pruned its rank): the change of what it kept
        if base is None or base.shape != sent.shape or not np.issubdtype(sent.dtype, np.floating):
            continue  # not a change of something received (e.g. headprune's importance scores): sent as it is
        honest = sent.astype(np.float64) - base.astype(np.float64)
        if attackers.attack == "noise":
            change = rng.normal(0.0, attackers.std, size=honest.shape)
        else:
            change = attackers.scale * honest
        arrays[name] = (base.astype(np.float64) + change).astype(sent.dtype)
        poisoned += 1
    if update.arrays and not poisoned:
        raise ValueError(f"federation.attackers: nothing in algorithm {cfg.algorithm.name}'s update changes a tensor "
                         f"the client received, so attack {attackers.attack} has nothing to poison; the algorithm "
                         "should declare why in its options' update_poisoning_unavailable (label_flip works with any)")
    return Payload(arrays, dict(update.meta))
