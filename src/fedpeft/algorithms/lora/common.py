"""What the federated LoRA methods share: the config check, finding the factors, a weighted mean over
some of the trainable tensors, and a digest that proves two processes hold the same frozen tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

import fedpeft
from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.algorithms.lora.factors import LoraPair, lora_pairs


class LoraFedAvgOptions(fedpeft.AlgorithmOptions):
    """Options of a LoRA method that averages what travels (FedAvg with a server step on the mean change)."""

    supports_personalized_eval: ClassVar[bool] = True
    server_lr: float = Field(1.0, gt=0, description="Step on the clients' sample-weighted mean change.")

    def check(self, run: Any) -> None:
        require_lora(run, self.name)


def require_lora(run: Any, algorithm: str) -> None:
    """Refuse a run whose PEFT method is not LoRA (the config check of every method here)."""
    if run.peft.method != "lora":
        raise ValueError(f"algorithm {algorithm} aggregates LoRA's A and B factors: set peft.method: lora "
                         f"(the config has peft.method: {run.peft.method})")


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
              server_lr: float) -> tuple[dict[str, np.ndarray], float]:
    """The global state with ``keys`` moved by server_lr times the clients' sample-weighted mean change
    (FedAvg on those tensors; the others unchanged), and the norm of that mean change."""
    keys = sorted(keys)
    ids = sorted(updates)
    deltas = [{k: updates[c].arrays[k].astype(np.float32) - global_state[k] for k in keys} for c in ids]
    mean = weighted_mean(deltas, [updates[c].meta["num_examples"] for c in ids])
    state = dict(global_state)
    for k in keys:
        state[k] = (global_state[k] + np.float32(server_lr) * mean[k]).astype(np.float32)
    norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in mean.values())))
    return state, norm


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
