"""Assortment of attention heads (paper 000): head pruning, head-weighted aggregation and
loss-difference client selection, with the paper's baselines under the same code.

Options (``algorithm.name: headprune``):

* ``pruning``: ``importance`` (Eq. 6 + 7), ``random`` (baseline B2) or ``none`` (baseline B1, dense);
* ``aggregation``: ``importance`` (Eq. 8 for head slices) or ``fedavg`` (Eq. 5 over the clients that
  sent the slice); non-head parameters always follow Eq. 5;
* ``selection``: ``loss`` (Eq. 9) or ``random``.

The paper's method is importance / importance / loss; B1 is none / fedavg; B2 is random / fedavg.

Client, per round: load the global state; if pruning by importance, compute alpha (Eq. 6) on (a sample
of) the local data with the received model; choose the kept heads; train with the pruned slices frozen
(their gradients are zeroed before every optimizer step and their values restored after it, so neither
the gradient, the optimizer's moments nor weight decay move them); upload the sparse payload
(fedpeft.heads.sparse).

Server: Eq. 8 per head slice, ``p += eta * sum_c a_c dp_c / (sum_c a_c + eps)`` over the clients that
kept it, where a_c is alpha of the slice's head (a grouped key/value slice serves several query heads:
a_c is the mean alpha of those of them the client kept).

Selection (Eq. 9): top-K clients by ``L_c - L_g``. ``L_c`` is the client's last reported training loss
(mean over its last local epoch); ``L_g`` is the global model's loss on the server's evaluation set at
the latest evaluation (``eval_loss``). ``L_g`` is the same for every client, so it shifts the scores but
never changes the ranking; it is logged with them. Clients never seen score +inf and so come first;
ties are broken by a seeded permutation of the round (deterministic).

With loss selection, failed clients back off (our rule; the paper is silent): a selected client whose update did not arrive
or was rejected scores -inf, so it is chosen only when fewer than K other clients remain, for 2^(f-1)
rounds after its f-th consecutive failure (1, 2, 4, ... rounds, at most 64); then it gets its score
back (+inf if it was never seen, else its last loss difference). A valid update resets the count.
Without this, a never-seen client whose update keeps failing would keep +inf and be chosen every round.
A round that aggregates nothing (fewer accepted updates than ``federation.min_replies``) records no loss
and clears no count. Random selection ignores the counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms.base import (
    MAX_EXAMPLES,
    Arrays,
    ClientAlgorithm,
    ClientContext,
    ClockValue,
    RuntimeNeeds,
    ServerAlgorithm,
    UpdateMeta,
    UpdateRejected,
    check_update,
)
from fedpeft.algorithms.headprune.options import HeadPruneOptions
from fedpeft.heads import (
    ALPHA_KEY,
    KEPT_KEY,
    HeadLayout,
    head_importance,
    kept_at_random,
    kept_by_importance,
    pack,
)
from fedpeft.heads.sparse import keep_count, pruned_mask, unpack_into
from fedpeft.wire import Payload, clock_seconds, clock_text

MAX_BACKOFF_ROUNDS = 64


def loss_difference_selection(last_loss: dict[int, float], global_loss: float | None, num_clients: int, k: int,
                              seed: int, rnd: int, backing_off: set[int] | frozenset[int] = frozenset(),
                              population: Sequence[int] | None = None) -> tuple[list[int], dict[int, float]]:
    """Eq. 9: the K clients with the largest (last local loss - global loss); never seen = +inf; clients
    in ``backing_off`` (recent failures) = -inf, chosen only when fewer than K others remain. ``population``: the
    clients to choose from (default: all)."""
    lg = 0.0 if global_loss is None else float(global_loss)
    scores = np.full(num_clients, np.inf)
    for c, loss in last_loss.items():
        scores[c] = loss - lg
    for c in backing_off:
        scores[c] = -np.inf
    tiebreak = np.random.default_rng([seed, rnd, 0x10555]).permutation(num_clients)
    order = np.lexsort((tiebreak, -scores))
    if population is not None:
        order = order[np.isin(order, np.asarray(list(population), dtype=np.int64))]
    chosen = sorted(int(c) for c in order[:k])
    return chosen, {c: float(scores[c]) for c in chosen}


class HeadPruneMeta(UpdateMeta):
    """A head-pruning update's own metadata: how long the importance scores took, on how many examples."""

    importance_seconds: ClockValue | None = None
    importance_examples: int | None = Field(None, ge=0, le=MAX_EXAMPLES)


class HeadPruneServer(ServerAlgorithm[HeadPruneOptions]):
    update_meta = HeadPruneMeta

    @classmethod
    def runtime_needs(cls, options: HeadPruneOptions) -> RuntimeNeeds:
        return RuntimeNeeds(layout="fedpeft.heads.layout:head_layout")

    state_attrs = ("global_state", "last_loss", "global_loss", "failures", "backoff_until")

    def __init__(self, options: HeadPruneOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        if self.layout is None:
            raise ValueError("headprune needs the model's head layout")
        self.last_loss: dict[int, float] = {}  # only clients seen so far
        self.global_loss: float | None = None
        self.failures: dict[int, int] = {}  # consecutive failed or rejected updates per client
        self.backoff_until: dict[int, int] = {}  # client -> last round of its back-off
        self._round_info: dict[str, Any] = {}

    # -- selection ----------------------------------------------------------------------------------
    def select(self, rnd: int) -> list[int]:
        if self.options.selection == "random":
            self._round_info = {}
            return super().select(rnd)
        backing_off = {c for c, last in self.backoff_until.items() if rnd <= last}
        chosen, scores = loss_difference_selection(self.last_loss, self.global_loss, self.num_clients,
                                                   self.clients_per_round, self.seed, rnd, backing_off,
                                                   self.online)
        # metrics.jsonl holds JSON numbers only: never-seen clients (+inf) are listed apart, as are backing-off ones
        self._round_info = {"selection_scores": {str(c): s for c, s in scores.items() if math.isfinite(s)},
                            "selection_global_loss": self.global_loss}
        unseen = sorted(c for c, s in scores.items() if s == math.inf)
        if unseen:
            self._round_info["selection_unseen"] = unseen
        if backing_off:
            self._round_info["selection_backing_off"] = sorted(backing_off)
        return chosen

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        for c in failures:
            count = self.failures.get(c, 0) + 1
            self.failures[c] = count
            self.backoff_until[c] = rnd + min(2 ** (count - 1), MAX_BACKOFF_ROUNDS)

    def load_state_dict(self, state) -> None:
        # checkpoints written before the back-off rule have no failure counts: nobody is backing off
        super().load_state_dict({"failures": {}, "backoff_until": {}, **state})

    def observe_evaluation(self, rnd: int, metrics: dict[str, Any]) -> None:
        if metrics.get("eval_loss") is not None:
            self.global_loss = float(metrics["eval_loss"])

    def round_info(self) -> dict[str, Any]:
        return self._round_info

    # -- checking ------------------------------------------------------------------------------------
    def validate(self, rnd: int, payload: Payload) -> None:
        n = self.layout.num_heads
        if self.options.pruning == "none":
            expected = dict(self.expected)
            if self.options.aggregation == "importance":
                expected[ALPHA_KEY] = ((n,), "float32")
            check_update(payload, expected, rnd)
            self._check_alpha(payload)
            return
        arrays = payload.arrays
        kept = arrays.get(KEPT_KEY)
        if kept is None:
            raise UpdateRejected(f"missing {KEPT_KEY!r} (the kept head ids)")
        if kept.dtype != np.int32 or kept.ndim != 1:
            raise UpdateRejected(f"{KEPT_KEY}: expected a 1-d int32 array, got {kept.dtype} {kept.shape}")
        if len(kept) == 0 or np.any(kept < 0) or np.any(kept >= n) or np.any(np.diff(kept) <= 0):
            raise UpdateRejected(f"{KEPT_KEY}: head ids must be sorted, unique and in [0, {n})")
        allowed = (self.layout.num_modules * keep_count(self.layout.heads_per_module, self.options.sparsity)
                   if self.options.per_layer else keep_count(n, self.options.sparsity))
        if len(kept) > allowed:
            raise UpdateRejected(f"{KEPT_KEY}: {len(kept)} heads kept, sparsity {self.options.sparsity} allows {allowed}")
        expected = {KEPT_KEY: (tuple(kept.shape), "int32")}
        kept_set = {int(h) for h in kept}
        for name, (shape, dtype) in self.expected.items():
            param = self.layout.params.get(name)
            expected[name] = (shape if param is None else param.packed_shape(kept_set), dtype)
        if self.options.aggregation == "importance":
            expected[ALPHA_KEY] = ((n,), "float32")
        check_update(payload, expected, rnd)
        self._check_alpha(payload)

    @staticmethod
    def _check_alpha(payload: Payload) -> None:
        if ALPHA_KEY in payload.arrays and np.any(payload.arrays[ALPHA_KEY] < 0):
            raise UpdateRejected(f"{ALPHA_KEY}: importance scores must be non-negative")
        loss = payload.meta.get("train_loss")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise UpdateRejected(f"train_loss must be a finite number, got {loss!r}")

    # -- aggregation -----------------------------------------------------------------------------------
    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        for c, p in updates.items():
            self.last_loss[c] = float(p.meta["train_loss"])
            self.failures.pop(c, None)
            self.backoff_until.pop(c, None)
        if not updates:
            return {"update_norm": 0.0}
        ids = sorted(updates)
        n = np.array([updates[c].meta["num_examples"] for c in ids], dtype=np.float64)
        eta = self.options.server_lr
        new_state: A.Arrays = {}
        sq = 0.0
        kept_sets = [self._kept(updates[c]) for c in ids]
        for name, old in self.global_state.items():
            param = self.layout.params.get(name)
            if param is None or (self.options.pruning == "none" and self.options.aggregation == "fedavg"):
                delta = sum(w * (updates[c].arrays[name].astype(np.float64) - old) for w, c in zip(n / n.sum(), ids))
            else:
                delta = self._per_head(name, param, old, updates, ids, kept_sets, n)
            new_state[name] = (old + eta * delta).astype(np.float32)
            sq += float(np.sum(np.square(delta)))
        self.global_state = new_state
        kept_counts = [len(k) for k in kept_sets]
        out = {"update_norm": math.sqrt(sq), "kept_heads_mean": float(np.mean(kept_counts)),
               "sparsity_mean": float(1.0 - np.mean(kept_counts) / self.layout.num_heads)}
        seconds = [s for c in ids if (s := clock_seconds(updates[c].meta, "importance_seconds")) is not None]
        if seconds:
            out["importance_s_mean"] = float(np.mean(seconds))
        return out

    def _kept(self, p: Payload) -> set[int]:
        if KEPT_KEY in p.arrays:
            return {int(h) for h in p.arrays[KEPT_KEY]}
        return set(range(self.layout.num_heads))

    def _alpha(self, p: Payload) -> np.ndarray | None:
        return p.arrays[ALPHA_KEY].astype(np.float64) if ALPHA_KEY in p.arrays else None

    def _per_head(self, name, param, old, updates, ids, kept_sets, n) -> np.ndarray:
        """Eq. 8 (importance) or Eq. 5 restricted to the senders (fedavg) for every head slice."""
        num = np.zeros_like(old, dtype=np.float64)
        den = np.zeros(len(param.units))
        for c, kept, n_c in zip(ids, kept_sets, n):
            full = np.zeros_like(old, dtype=np.float64)
            unpack_into(param, updates[c].arrays[name].astype(np.float64), kept, full)
            alpha = self._alpha(updates[c])
            for i, u in enumerate(param.units):
                heads = [h for h in u.heads if h in kept]
                if not heads:
                    continue
                w = float(np.mean(alpha[heads])) if (self.options.aggregation == "importance" and alpha is not None) else float(n_c)
                sl = _slice(param, u, old.ndim)
                num[sl] += w * (full[sl] - old[sl])
                den[i] += w
        delta = np.zeros_like(old, dtype=np.float64)
        eps = self.options.eps if self.options.aggregation == "importance" else 0.0
        for i, u in enumerate(param.units):
            if den[i] > 0:
                sl = _slice(param, u, old.ndim)
                delta[sl] = num[sl] / (den[i] + eps)
        return delta


def _slice(param, unit, ndim: int) -> tuple:
    index = [slice(None)] * ndim
    index[param.axis] = slice(unit.start, unit.stop)
    return tuple(index)


class HeadPruneClient(ClientAlgorithm):
    def __init__(self, options: HeadPruneOptions):
        self.options = options

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        o = self.options
        layout: HeadLayout = ctx.resources["layout"]
        ctx.tuned.load_state(payload.arrays)
        meta: dict[str, Any] = {"round": payload.meta["round"], "client": ctx.client_id, "num_examples": ctx.num_examples}
        alpha = None
        rng = np.random.default_rng([ctx.resources.get("seed", 0), ctx.round, ctx.client_id, 0xA1FA])
        if o.pruning == "importance" or (o.aggregation == "importance"):
            imp = head_importance(
                ctx.tuned, ctx.data, layout, pad_id=ctx.resources["pad_id"],
                exclude_token_ids=ctx.resources["exclude_token_ids"], device=ctx.resources["device"],
                batch_size=ctx.resources.get("batch_size", 16), max_examples=o.importance_examples, rng=rng,
            )
            alpha = imp.alpha
            # the full Eq. 6 scores (before Eq. 7 zeroes the pruned ones), for analysis such as paper 000's
            # Fig. 5: to the run's observers, never on the wire
            ctx.report("importance", alpha.copy())
            meta["importance_seconds"] = clock_text(imp.seconds)
            meta["importance_examples"] = imp.examples
        if o.pruning == "importance":
            kept = kept_by_importance(alpha, o.sparsity, layout, per_module=o.per_layer)
        elif o.pruning == "random":
            kept = kept_at_random(layout, o.sparsity, rng, per_module=o.per_layer)
        else:
            kept = np.arange(layout.num_heads, dtype=np.int32)
        kept_set = {int(h) for h in kept}
        before, after = _freeze_pruned(ctx.tuned, layout, kept_set) if o.pruning != "none" else (None, None)
        result = ctx.train(before_step=before, after_step=after, head_fraction=len(kept) / layout.num_heads)
        meta.update(result.as_meta())
        state = ctx.tuned.state()
        if o.pruning == "none":
            arrays = state
            if alpha is not None and o.aggregation == "importance":
                arrays = {**state, ALPHA_KEY: alpha.astype(np.float32)}
        else:
            arrays = pack(state, layout, kept)
            if o.aggregation == "importance":
                a = np.zeros(layout.num_heads, dtype=np.float32)
                a[kept] = alpha[kept]  # Eq. 7: pruned heads' scores are 0
                arrays[ALPHA_KEY] = a
        return Payload(arrays, meta)


def _freeze_pruned(tuned, layout: HeadLayout, kept: set[int]):
    """Hooks that keep the pruned head slices exactly at their received values during training."""
    masks: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
    for name, param in layout.params.items():
        mask = pruned_mask(param, kept)
        if mask.any():
            p = tuned.params[name]
            m = torch.from_numpy(mask).to(p.device)
            masks.append((p, m, p.detach().clone()))

    def before_step() -> None:
        for p, m, _ in masks:
            if p.grad is not None:
                p.grad.masked_fill_(m, 0.0)

    def after_step() -> None:
        with torch.no_grad():
            for p, m, saved in masks:
                p.copy_(torch.where(m, saved, p))

    return before_step, after_step
