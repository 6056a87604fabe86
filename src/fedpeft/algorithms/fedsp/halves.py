"""FedSP (paper 003): soft prompts are the messengers; the server's model never leaves the server.

Before round 1 the server builds the auxiliary model from its global model (k blocks, cross-layer
sharing: :mod:`fedpeft.algorithms.fedsp.auxiliary`) and distils it on its own data shard (last hidden states,
:mod:`fedpeft.algorithms.fedsp.distill`). A client receives the auxiliary model once, in its first payload,
and from then on only the prefix prompts; the payload never holds any other tensor of the global model.

Each round a client loads the prompts into its own copy of the auxiliary model and trains in two
phases (``client_training: alternating``): first the auxiliary model with the prompts frozen (global
model alignment), then the prompts with the auxiliary model frozen (local knowledge); only the prompts
go back. ``joint`` trains both at once (the "w/o AT" ablation), ``prompts`` never updates the auxiliary
model (FedPrompt-Single). The server averages the prompts (FedAvg, weighted by examples), plugs them
into the global model, tunes them there on its shard for ``server_steps`` steps, and sends them out.

Without cross-layer sharing the auxiliary model has k block positions and takes k layers' prompts: the
server sends client layer j the mean of global layers j, j + k, j + 2k, ... and writes the client's
layer j back to all of those (the reference code's tiling).

Each client keeps its auxiliary model between rounds (in client state: only the parameters it trains,
``client_trains``); the parameters no client trains are the same for all clients and held once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from fedpeft.algorithms.aggregate import deltas as update_deltas
from fedpeft.algorithms.aggregate import fedavg_step, l2_norm, weighted_mean
from fedpeft.algorithms.base import (
    ClientAlgorithm,
    ClientContext,
    RuntimeNeeds,
    ServerAlgorithm,
    check_update,
)
from fedpeft.algorithms.fedsp.options import FedSPOptions
from fedpeft.tuners.prefix_layers import PrefixLayout
from fedpeft.wire import Payload

log = logging.getLogger("fedpeft")
Arrays = dict[str, np.ndarray]
AUX = "aux/"  # payload names of the auxiliary model's parameters


def fold_layers(prefix: np.ndarray, layout: PrefixLayout, k: int) -> np.ndarray:
    """An L-layer prompt as k layers: client layer j = mean of global layers j, j + k, ..."""
    blocks = layout.split(prefix)
    return np.concatenate([np.mean([blocks[l] for l in range(j, layout.num_layers, k)], axis=0) for j in range(k)],
                          axis=1).astype(np.float32)


def tile_layers(prefix: np.ndarray, layout: PrefixLayout, k: int) -> np.ndarray:
    """A k-layer prompt as L layers: global layer l = client layer l mod k."""
    width = layout.width
    return np.concatenate([prefix[:, (l % k) * width:(l % k + 1) * width] for l in range(layout.num_layers)],
                          axis=1).astype(np.float32)


class FedSPServer(ServerAlgorithm[FedSPOptions]):
    @classmethod
    def runtime_needs(cls, options: FedSPOptions) -> RuntimeNeeds:
        return RuntimeNeeds(server_model=True, server_data_fraction=options.server_data_fraction)

    state_attrs = ("global_state", "aux_state", "aux_info")

    def __init__(self, options: FedSPOptions, initial_state: Arrays, **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        if self.server_model is None:
            raise ValueError("fedsp needs the server's model (the runtime passes it as server_model)")
        self.aux_state: Arrays | None = None  # the distilled auxiliary model, as sent to clients
        self.aux_info: dict[str, Any] = {}
        self.aux_holders: set[int] = set()  # not checkpointed: after a resume every client gets it again
        self._info: dict[str, Any] = {}  # this round's entries for metrics.jsonl
        self._once: dict[str, Any] = {}  # the auxiliary model's, reported with the first round
        self._expected: dict[str, tuple[tuple[int, ...], str]] | None = None
        layers = int(self.server_model.base_model().config.num_hidden_layers)
        if not 1 <= options.aux_layers <= layers:
            raise ValueError(f"algorithm.aux_layers must lie in [1, {layers}] (the global model's blocks)")

    # -- the auxiliary model ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build and distil the auxiliary model (once, before the first payload)."""
        if self.aux_state is not None:
            return
        from fedpeft.algorithms.fedsp.auxiliary import build_auxiliary, public_config
        from fedpeft.algorithms.fedsp.distill import distill_hidden_states

        o, sm = self.options, self.server_model
        teacher = sm.base_model()
        aux, info = build_auxiliary(teacher, o.aux_layers, o.aux_position, o.share_layers)
        aux.to(sm.device)
        distilled: dict[str, Any] = {"distill_steps": 0}
        if o.distill_steps:
            res = distill_hidden_states(aux, teacher, sm.data, steps=o.distill_steps, lr=o.distill_lr,
                                        batch_size=o.distill_batch_size, pad_id=sm.pad_id, seed=sm.seed,
                                        device=sm.device)
            distilled = {"distill_steps": res.steps, "distill_loss_first": res.first_loss,
                         "distill_loss_last": res.last_loss, "distill_seconds": res.seconds}
            log.info("auxiliary model distilled: %d steps, loss %.4g -> %.4g in %.0f s", res.steps, res.first_loss,
                     res.last_loss, res.seconds)
        self.aux_state = {AUX + n: p.detach().to("cpu", torch.float32).numpy().copy() for n, p in aux.named_parameters()}
        self.aux_info = {**asdict(info), **distilled, "config": public_config(aux),
                         "global_layers": int(teacher.config.num_hidden_layers)}
        self._once = {**{f"aux_{k}": v for k, v in asdict(info).items()}, **distilled,
                      "aux_global_layers": self.aux_info["global_layers"]}

    def _convert(self, arrays: Mapping[str, np.ndarray], *, to_client: bool) -> Arrays:
        """Prompts between the global model's L layers and the clients' positions: unchanged with sharing (L
        positions), folded to / tiled from k layers without it."""
        positions = int(self.aux_info["positions"])
        if positions == self.aux_info["global_layers"]:
            return dict(arrays)
        if self.layout is None:
            from fedpeft.tuners.prefix_layers import prefix_layout

            self.layout = prefix_layout(self.server_model.tuned)
        lay, convert = self.layout, fold_layers if to_client else tile_layers
        return {n: convert(v, lay, positions) if n == lay.name else v for n, v in arrays.items()}

    # -- rounds -----------------------------------------------------------------------------------------
    def configure(self, rnd: int, clients: list[int]) -> dict[int, Payload]:
        self.prepare()
        assert self.aux_state is not None
        prompts = self._convert(self.global_state, to_client=True)
        out = {}
        for c in clients:
            meta: dict[str, Any] = {"round": rnd, "client": c}
            arrays = dict(prompts)
            if c not in self.aux_holders:  # first contact: the auxiliary model, once
                arrays.update(self.aux_state)
                meta["aux"] = {"config": self.aux_info["config"], "num_blocks": len(self.aux_info["blocks"]),
                               "positions": self.aux_info["positions"]}
            out[c] = Payload(arrays, meta)
        return out

    def validate(self, rnd: int, payload: Payload) -> None:
        if self._expected is None:  # the clients' prompt shapes, fixed once the auxiliary model exists
            self._expected = {k: (tuple(v.shape), "float32")
                              for k, v in self._convert(self.global_state, to_client=True).items()}
        check_update(payload, self._expected, rnd)

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        self.aux_holders -= set(failures)  # it may not have stored the auxiliary model

    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        self._info = {}
        if not updates:
            return {"update_norm": 0.0}
        ids = sorted(updates)
        self.aux_holders |= set(ids)
        ds = [update_deltas(self.global_state, self._convert(updates[c].arrays, to_client=False)) for c in ids]
        delta = weighted_mean(ds, [updates[c].meta["num_examples"] for c in ids])
        self.global_state = fedavg_step(self.global_state, delta, 1.0)
        metrics = {"update_norm": l2_norm(delta)}
        if self.options.server_steps:
            from fedpeft.training.local import NonFiniteLoss

            try:
                res = self.server_model.tune(self.global_state, self.options.server_steps, rnd)
            except NonFiniteLoss as exc:
                log.warning("round %d: the server's prompt tuning failed (%s); the averaged prompts are kept", rnd, exc)
                self._info["server_step_skipped"] = 1.0
            else:
                self.global_state = {k: v.astype(np.float32) for k, v in res.pop("state").items()}
                self._info.update(res)
        return metrics

    def round_info(self) -> dict[str, Any]:
        info, self._once = {**self._once, **self._info}, {}
        return info


class FedSPClient(ClientAlgorithm):
    """Keeps one auxiliary model per process (built from the first payload) and each client's trained part."""

    def __init__(self, options: FedSPOptions):
        self.options = options
        self.aux = None  # fedpeft.tuners.TunedModel over the auxiliary model; the parameters no client trains
        # keep the values received with the auxiliary model, so only each client's trained part is swapped in

    def _build(self, spec: dict[str, Any], arrays: Mapping[str, np.ndarray], ctx: ClientContext) -> None:
        from fedpeft.algorithms.fedsp.auxiliary import auxiliary_from_config, client_trained_names
        from fedpeft.tuners import apply_tuner

        model = auxiliary_from_config(spec["config"], blocks=int(spec["num_blocks"]), positions=int(spec["positions"]))
        if self.options.client_training == "prompts":
            self.trained_names: list[str] = []
        elif self.options.client_trains == "all":
            self.trained_names = [n for n, _ in model.named_parameters()]
        else:
            self.trained_names = client_trained_names(model)
        peft_options = ctx.resources["peft"].model_copy(update={"init_text": None})  # the prompts come from the server
        self.aux = apply_tuner(model, peft_options, "causal")
        self.aux.module.to(ctx.resources["device"])

    def _aux_params(self) -> dict[str, torch.nn.Parameter]:
        base = self.aux.module.get_base_model()
        return dict(base.named_parameters())

    def _load_aux(self, arrays: Mapping[str, np.ndarray]) -> None:
        params = self._aux_params()
        with torch.no_grad():
            for name, value in arrays.items():
                p = params.get(name)
                if p is None or tuple(p.shape) != tuple(value.shape):
                    raise ValueError(f"auxiliary parameter {name!r} does not fit the auxiliary model")
                p.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(p.dtype))

    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        from fedpeft.tuners import TunedModel

        received_aux = {k[len(AUX):]: v for k, v in payload.arrays.items() if k.startswith(AUX)}
        prompts = {k: v for k, v in payload.arrays.items() if not k.startswith(AUX)}
        if received_aux:
            if self.aux is None:
                self._build(payload.meta["aux"], received_aux, ctx)
            self._load_aux(received_aux)
            ctx.state.setdefault("aux", {k: v for k, v in received_aux.items() if k in self.trained_names})
        if self.aux is None or "aux" not in ctx.state:
            raise RuntimeError(f"client {ctx.client_id} holds no auxiliary model and none was sent")
        self._load_aux(ctx.state["aux"])
        module = self.aux.module
        self.aux.load_state(prompts)
        ctx.evaluate_personal(self.aux)  # the client's auxiliary model with the received prompts
        params = self._aux_params()
        prompt_params = [p for n, p in module.named_parameters() if "prompt_encoder" in n]

        trained = set(self.trained_names)

        def phase(model_on: bool, prompts_on: bool, lr: float | None = None):
            for n, p in params.items():
                p.requires_grad_(model_on and n in trained)
            for p in prompt_params:
                p.requires_grad_(prompts_on)
            return ctx.train(tuned=TunedModel(module, self.aux.method, self.aux.options, self.aux.save_format,
                                                "causal"), lr=lr)

        mode = self.options.client_training
        meta: dict[str, Any] = {}
        if mode == "alternating":  # both phases count as this client's training (steps, time, FLOPs)
            aligned = phase(True, False, self.options.aux_lr)
            meta["align_loss"] = aligned.loss
            result = aligned.plus(phase(False, True))
        elif mode == "joint":  # one lr for both (the ablation of the alternation)
            result = phase(True, True)
        else:
            result = phase(False, True)
        for p in params.values():
            p.requires_grad_(False)
        for p in prompt_params:
            p.requires_grad_(True)
        ctx.state["aux"] = {n: params[n].detach().to("cpu", torch.float32).numpy().copy() for n in self.trained_names}
        out = {n: p.detach().to("cpu", torch.float32).numpy().copy() for n, p in module.named_parameters()
               if n in prompts}
        return Payload(out, {"round": ctx.round, "num_examples": ctx.num_examples, **result.as_meta(), **meta})
