"""FedPepTAO (paper 002): deep prompts whose selected layers travel, adaptive optimization on both sides.

Round schedule (t = ``selection_round``):

* Rounds 1..t: every layer's prompt travels. Each selected client first scores the layers (Eq. 2-3,
  :mod:`fedpeft.algorithms.fedpeptao.prompt_probes`) with the prompts it received, then trains. At round t the
  clients also send the kept ratio of their prompt Hessian's spectrum (Algorithm 1).
* After round t's aggregation the server ranks the layers by the sample-weighted mean score over all
  clients that reported (Formula 4; a client that reported twice counts with its latest scores), takes
  the sample-weighted mean of the round-t ratios (the reference averages them unweighted) and selects
  layers until that share of the prompt parameters is reached. The selection is fixed for the rest of
  the run (if no ratio arrived at round t, the next round asks again).
* Later rounds: only the selected layers' prompts (and the task head) travel, as arrays named
  ``<prefix parameter>#layer<l>``. Each client keeps its full prompt between rounds: the layers that do
  not travel stay personal, as in the reference code. A client that holds no personal prompt yet (first
  selected after round t) receives the whole prompt once; the server's copy of an unselected layer keeps
  its last aggregated value, which is what the server's evaluation uses.

Server (Algorithm 2, :mod:`fedpeft.algorithms.fedpeptao.adaptive_server`): control variates c_i for the clients
seen so far only (none for clients never selected), a global c, momentum, the previous aggregated
update and the decaying server learning rate; all over the exchanged arrays. Clients train with the run's
``train`` optimizer (Adam/AdamW for the method; SGD, with or without momentum, for the MomD/FedAvg
baselines) and report their local steps and learning rate, from which the server computes c_i without
any extra communication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms.aggregate import l2_norm
from fedpeft.algorithms.base import (
    ClientAlgorithm,
    ClientContext,
    RuntimeNeeds,
    ServerAlgorithm,
    UpdateRejected,
    check_update,
    finite_number,
    log,
)
from fedpeft.algorithms.fedpeptao import adaptive_server as AS
from fedpeft.algorithms.fedpeptao.layer_selection import (
    aggregate_scores,
    layer_order,
    select_layers,
)
from fedpeft.algorithms.fedpeptao.options import FedPepTAOOptions
from fedpeft.algorithms.fedpeptao.prompt_probes import (
    client_kept_ratio,
    client_layer_scores,
    sample_batch,
)
from fedpeft.tuners.prefix_layers import PrefixLayout
from fedpeft.wire import Payload

Arrays = dict[str, np.ndarray]
MAX_LOCAL_STEPS = 10**7


def all_finite(*trees: Mapping[str, np.ndarray] | None) -> bool:
    return all(tree is None or all(np.all(np.isfinite(v)) for v in tree.values()) for tree in trees)


def block_name(prefix_name: str, layer: int) -> str:
    return f"{prefix_name}#layer{layer}"


def to_blocks(arrays: Mapping[str, np.ndarray], layout: PrefixLayout) -> Arrays:
    """Exchanged arrays with a whole prefix split into per-layer blocks (other arrays unchanged)."""
    out = {k: v for k, v in arrays.items() if k != layout.name}
    if layout.name in arrays:
        out.update({block_name(layout.name, l): b for l, b in layout.split(arrays[layout.name]).items()})
    return out


class FedPepTAOServer(ServerAlgorithm[FedPepTAOOptions]):
    @classmethod
    def runtime_needs(cls, options: FedPepTAOOptions) -> RuntimeNeeds:
        return RuntimeNeeds(layout="fedpeft.tuners.prefix_layers:prefix_layout")

    state_attrs = ("global_state", "selected", "c_clients", "c_global", "momentum", "prev_update", "score_reports",
                   "ratio", "holders")

    def __init__(self, options: FedPepTAOOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        layout = self.layout
        if not isinstance(layout, PrefixLayout) or layout.name not in self.global_state:
            raise ValueError("fedpeptao needs the per-layer prefix layout of a prefix_tuning model")
        self.head_names = sorted(k for k in self.global_state if k != layout.name)
        self.selected: list[int] | None = None  # None: every layer travels
        self.c_clients: dict[int, Arrays] = {}  # only clients seen so far
        self.c_global: Arrays | None = None
        self.momentum: Arrays | None = None
        self.prev_update: Arrays | None = None
        self.score_reports: dict[int, list[Any]] = {}  # client -> [scores, num_examples]
        self.ratio: float | None = None  # the kept ratio used for the selection
        self.holders: list[int] = []  # clients known to hold a personal prompt (an accepted update)
        self._info: dict[str, Any] = {}

    # -- what travels --------------------------------------------------------------------------------
    @property
    def selection_done(self) -> bool:
        return self.options.layer_selection == "all" or self.selected is not None

    def exchanged_keys(self) -> list[str]:
        layers = range(self.layout.num_layers) if self.selected is None else self.selected
        return [block_name(self.layout.name, l) for l in layers] + self.head_names

    def global_blocks(self) -> Arrays:
        blocks = to_blocks(self.global_state, self.layout)
        return {k: blocks[k] for k in self.exchanged_keys()}

    def wants_scores(self, rnd: int) -> bool:
        return self.options.layer_selection == "score" and not self.selection_done

    def wants_ratio(self, rnd: int) -> bool:
        return (not self.selection_done and self.options.ratio == "hessian"
                and rnd >= self.options.selection_round)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Payload]:
        meta = {"round": rnd, "layers": self.selected, "scores": self.wants_scores(rnd),
                "hessian": self.wants_ratio(rnd)}
        blocks = self.global_blocks()
        out = {}
        for c in clients:
            if self.selected is not None and c in self.holders:
                arrays = blocks
            else:  # every layer; after the selection once per client, to keep as its personal copy
                arrays = {k: self.global_state[k] for k in [self.layout.name, *self.head_names]}
            out[c] = Payload(arrays, {**meta, "client": c})
        return out

    # -- checks ---------------------------------------------------------------------------------------
    def expected_update(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self.selected is None:
            return dict(self.expected)
        shape = (self.global_state[self.layout.name].shape[0], self.layout.width)
        out = {block_name(self.layout.name, l): (shape, "float32") for l in self.selected}
        out.update({k: self.expected[k] for k in self.head_names})
        return out

    def validate(self, rnd: int, payload: Payload) -> None:
        check_update(payload, self.expected_update(), rnd)
        meta = payload.meta
        steps = meta.get("train_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 < steps <= MAX_LOCAL_STEPS:
            raise UpdateRejected(f"train_steps must be an integer in [1, {MAX_LOCAL_STEPS}], got {steps!r}")
        lr = finite_number(meta.get("client_lr"), "client_lr")
        if lr <= 0 or (self.client_lr is not None and not math.isclose(lr, self.client_lr, rel_tol=1e-6)):
            raise UpdateRejected(f"client_lr {lr!r} is not the run's train.lr {self.client_lr!r}")
        scores = meta.get("layer_scores")
        if scores is not None:
            if not isinstance(scores, list) or len(scores) != self.layout.num_layers:
                raise UpdateRejected(f"layer_scores must be a list of {self.layout.num_layers} numbers")
            for x in scores:
                finite_number(x, "layer_scores")
        if meta.get("kept_ratio") is not None:
            ratio = finite_number(meta["kept_ratio"], "kept_ratio")
            if not 0 <= ratio <= 1:
                raise UpdateRejected(f"kept_ratio must be in [0, 1], got {ratio!r}")

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        # a client whose round failed may have lost its personal prompt: it gets the whole prompt next time
        if failures:
            self.holders = sorted(set(self.holders) - set(failures))

    # -- aggregation ----------------------------------------------------------------------------------
    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        o = self.options
        self._info = {"exchanged_layers": self.layout.num_layers if self.selected is None else len(self.selected)}
        if not updates:
            return {"update_norm": 0.0}
        ids = sorted(updates)
        w = self.global_blocks()
        client_blocks = [to_blocks(updates[c].arrays, self.layout) for c in ids]
        deltas = [A.deltas(w, u) for u in client_blocks]
        n = [updates[c].meta["num_examples"] for c in ids]
        eta = AS.server_lr(rnd, o.server_lr, o.server_lr_decay, o.server_lr_min)
        # what takes the plain FedAvg step: everything (server_optimizer fedavg) or the task head
        plain = set(w) if o.server_optimizer == "fedavg" else set(self.head_names if o.head_server_step == "fedavg" else [])
        plain_delta = A.weighted_mean([{k: d[k] for k in plain} for d in deltas], n) if plain else {}
        new = A.fedavg_step({k: w[k] for k in plain}, plain_delta, 1.0)
        delta = dict(plain_delta)
        if not all_finite(new):
            log.warning("round %d: the mean update overflowed float32; the global state is left unchanged", rnd)
            return {"server_step_skipped": 1.0}
        if o.server_optimizer != "fedavg":
            w = {k: v for k, v in w.items() if k not in plain}
            deltas = [{k: d[k] for k in w} for d in deltas]
            stepped, m, cg, c_new, momentum_delta = AS.adaptive_step(
                w, deltas, n, [updates[c].meta["train_steps"] for c in ids],
                [self.client_lr or float(updates[c].meta["client_lr"]) for c in ids],
                [self._restrict(self.c_clients.get(c), w) for c in ids], self._restrict(self.c_global, w),
                self._restrict(self.momentum, w), self._restrict(self.prev_update, w),
                beta=o.beta, eta=eta, sampled_fraction=len(ids) / self.num_clients,
                control_variates=o.server_optimizer == "adaptive",
            )
            new.update(stepped)
            delta.update(momentum_delta)
            if not all_finite(new, m, cg, *c_new):
                log.warning("round %d: the server step overflowed (updates too large for the control variates); "
                            "the global state is left unchanged", rnd)
                return {"server_step_skipped": 1.0}
            if o.server_optimizer == "adaptive":
                for c, ci in zip(ids, c_new):
                    self.c_clients[c] = {**self.c_clients.get(c, {}), **ci}
                self.c_global = {**(self.c_global or {}), **cg}
            if m is not None:
                self.momentum = {**(self.momentum or {}), **m}
            self._info["server_lr"] = eta
        self.prev_update = {**(self.prev_update or {}), **delta}
        self._write_back(new)
        self.holders = sorted(set(self.holders) | set(ids))  # they keep the full prompt they trained
        self._collect_reports(rnd, updates)
        return {"update_norm": l2_norm(delta)}

    @staticmethod
    def _restrict(arrays: Mapping[str, np.ndarray] | None, like: Arrays) -> Arrays | None:
        """``arrays`` on the keys of ``like`` (a key it lacks, i.e. never exchanged yet, as zeros)."""
        if arrays is None:
            return None
        return {k: arrays[k] if k in arrays else np.zeros_like(v) for k, v in like.items()}

    def _write_back(self, new: Arrays) -> None:
        prefix_blocks = {int(k.rsplit("#layer", 1)[1]): v for k, v in new.items() if "#layer" in k}
        state = dict(self.global_state)
        state[self.layout.name] = self.layout.merge(state[self.layout.name], prefix_blocks).astype(np.float32)
        state.update({k: new[k] for k in self.head_names})
        self.global_state = state

    def _collect_reports(self, rnd: int, updates: dict[int, Payload]) -> None:
        for c, p in updates.items():
            if p.meta.get("layer_scores") is not None:
                self.score_reports[c] = [list(p.meta["layer_scores"]), int(p.meta["num_examples"])]
        if self.selection_done or rnd < self.options.selection_round:
            return
        o = self.options
        if o.ratio == "hessian":
            ratios = [(p.meta["kept_ratio"], p.meta["num_examples"]) for p in updates.values()
                      if p.meta.get("kept_ratio") is not None]
            if not ratios:
                return  # asked again next round
            r = sum(x * n for x, n in ratios) / sum(n for _, n in ratios)
            ratio = float(min(1.0, max(r, 1.0 / self.layout.num_layers)))  # at least one layer travels
        else:
            ratio = float(o.ratio)
        scores = np.zeros(self.layout.num_layers)
        if o.layer_selection == "score":
            if not self.score_reports:
                return
            reports = list(self.score_reports.values())
            scores = aggregate_scores([s for s, _ in reports], [n for _, n in reports])
        order = layer_order(list(scores), o.layer_selection, seed=self.seed)
        self.selected = select_layers(order, [1] * self.layout.num_layers, ratio)
        self.ratio = ratio
        self._info.update({"selected_layers": self.selected, "kept_ratio": ratio,
                           "layer_scores": [float(x) for x in scores] if o.layer_selection == "score" else None})

    def round_info(self) -> dict[str, Any]:
        info = {k: v for k, v in self._info.items() if v is not None}
        self._info = {}
        return info

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.c_clients = {int(c): v for c, v in (self.c_clients or {}).items()}
        self.score_reports = {int(c): v for c, v in (self.score_reports or {}).items()}
        self.holders = [int(c) for c in self.holders or []]


class FedPepTAOClient(ClientAlgorithm):
    """Assemble the prompt (received layers over the personal copy), optionally score the layers, train,
    optionally measure the Hessian ratio, keep the full prompt, and send back the exchanged layers."""

    def __init__(self, options: FedPepTAOOptions):
        self.options = options

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        layout: PrefixLayout = ctx.resources["layout"]
        o = self.options
        meta_in = payload.meta
        arrays = payload.arrays
        layers = meta_in.get("layers")
        if layout.name in arrays:
            prefix = arrays[layout.name]
        else:
            personal = ctx.state.get("prefix")
            if personal is None:
                raise ValueError(f"client {ctx.client_id} holds no personal prompt for the layers that do not "
                                 "travel (its state was lost); the server sends the whole prompt to clients "
                                 "it has not served since the layer selection")
            blocks = {l: arrays[block_name(layout.name, l)] for l in layers}
            prefix = layout.merge(personal, blocks)
        head = {k: v for k, v in arrays.items() if k != layout.name and "#layer" not in k}
        ctx.tuned.load_state({**head, layout.name: prefix})
        ctx.evaluate_personal()  # the received layers over the client's own prompt
        rng = np.random.default_rng([ctx.resources.get("seed", 0), ctx.round, ctx.client_id, 0x9E9])
        device, pad_id = ctx.resources["device"], ctx.resources["pad_id"]
        meta: dict[str, Any] = {}
        if meta_in.get("scores"):
            batch = sample_batch(ctx.data, o.score_examples, rng, pad_id, device)
            scores = client_layer_scores(ctx.tuned, batch, layout.num_layers)
            if scores is not None:
                meta["layer_scores"] = scores
        moments = ctx.state.setdefault("optimizer", {}) if o.keep_client_moments else None
        result = ctx.train(optimizer_state=moments)
        if meta_in.get("hessian"):
            batch = sample_batch(ctx.data, o.hessian_examples, rng, pad_id, device)
            meta["kept_ratio"] = client_kept_ratio(ctx.tuned, batch, layout.name, steps=o.hessian_steps,
                                                   probes=o.hessian_probes, seed=int(rng.integers(2**31)))
        state = ctx.tuned.state()
        ctx.state["prefix"] = state[layout.name]
        out = {k: state[k] for k in head}
        if layers is None:
            out[layout.name] = state[layout.name]
        else:
            out.update({block_name(layout.name, l): b for l, b in layout.split(state[layout.name], layers).items()})
        return Payload(out, {"round": meta_in["round"], "client": ctx.client_id, "num_examples": ctx.num_examples,
                             "client_lr": float(ctx.resources["client_lr"]), **result.as_meta(), **meta})
