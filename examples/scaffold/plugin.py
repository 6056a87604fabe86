"""A fedpeft plugin with client state: SCAFFOLD (Karimireddy et al. 2020), control variates that correct
each client's drift under non-IID data. Written against ``import fedpeft`` only.

Server: global state x and control variate c. Each selected client gets (x, c), starts from x, and takes
SGD steps on the corrected gradient, y <- y - lr (g(y) - c_i + c) (the paper's local step), where c_i is its
own control variate (kept in the client's state between its rounds). The correction is added to the gradient
before ``train.max_grad_norm`` clips it, so a clipped step is lr times the clipped corrected gradient
(``train.max_grad_norm: null``, as in this example's config, takes the paper's step exactly; fedpeft's default
1.0 clips). It then updates c_i <- c_i - c + (x - y) / (K lr) (the paper's
option II; y: its trained state, K: its steps) and sends y and the change of c_i. The server moves x along
the mean change of y and c by the sum of the control changes over all N clients. The options refuse what the
correction cannot account for: another optimizer or schedule, momentum, weight decay and fp16.

    fedpeft run examples/scaffold/config.yaml --plugin examples/scaffold/plugin.py
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

import fedpeft

CONTROL = "control/"  # payload arrays named control/<parameter> carry control variates


class ScaffoldOptions(fedpeft.AlgorithmOptions):
    """algorithm: {name: scaffold, server_lr: 1.0}"""

    name: Literal["scaffold"] = "scaffold"
    server_lr: float = Field(1.0, gt=0, description="Global step size on the mean model change.")

    def check(self, run: fedpeft.RunConfig) -> None:
        t = run.train
        if t.optimizer != "sgd" or t.scheduler != "constant" or t.momentum or t.warmup_ratio:
            raise ValueError("algorithm scaffold corrects plain SGD steps: set train.optimizer: sgd, "
                             "train.scheduler: constant, train.momentum: 0 and train.warmup_ratio: 0")
        if t.weight_decay:
            raise ValueError("train.weight_decay: algorithm scaffold's step is y - lr (g + c - c_i); SGD's decay would "
                             "add lr wd y outside the corrected, clipped gradient: set train.weight_decay: 0")
        if run.runtime.precision == "fp16":
            raise ValueError("runtime.precision fp16: algorithm scaffold adds its correction to the gradients, which "
                             "fp16's loss scaling holds scaled (and a skipped step would still be corrected); use "
                             "bf16 or fp32")


class ScaffoldServer(fedpeft.ServerAlgorithm[ScaffoldOptions]):
    state_attrs = ("global_state", "control")

    def __init__(self, options: ScaffoldOptions, initial_state: dict[str, np.ndarray], **kwargs: Any):
        super().__init__(options, initial_state, **kwargs)
        self.control = {k: np.zeros_like(v) for k, v in self.global_state.items()}
        self.update_spec = {**self.expected, **{CONTROL + k: spec for k, spec in self.expected.items()}}

    def configure(self, rnd: int, clients: list[int]) -> dict[int, fedpeft.Payload]:
        arrays = {**self.global_state, **{CONTROL + k: v for k, v in self.control.items()}}
        return {c: fedpeft.Payload(arrays, {"round": rnd, "client": c}) for c in clients}

    def validate(self, rnd: int, payload: fedpeft.Payload) -> None:
        fedpeft.check_update(payload, self.update_spec, rnd)  # the state and its control changes, all finite

    def aggregate(self, rnd: int, updates: dict[int, fedpeft.Payload]) -> dict[str, float]:
        if not updates:
            return {"control_norm": float("nan")}
        ids = sorted(updates)
        for k, x in self.global_state.items():
            dy = np.mean([updates[c].arrays[k] - x for c in ids], axis=0)
            self.global_state[k] = (x + np.float32(self.options.server_lr) * dy).astype(np.float32)
            dc = np.sum([updates[c].arrays[CONTROL + k] for c in ids], axis=0) / self.num_clients
            self.control[k] = (self.control[k] + dc).astype(np.float32)
        return {"control_norm": float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in self.control.values())))}


class ScaffoldClient(fedpeft.ClientAlgorithm):
    def __init__(self, options: ScaffoldOptions):
        self.options = options

    def fit(self, payload: fedpeft.Payload, ctx: fedpeft.ClientContext) -> fedpeft.Payload:
        x = {k: v for k, v in payload.arrays.items() if not k.startswith(CONTROL)}
        c = {k[len(CONTROL):]: v for k, v in payload.arrays.items() if k.startswith(CONTROL)}
        c_i = ctx.state.get("control") or {k: np.zeros_like(v) for k, v in x.items()}
        lr = float(ctx.resources["client_lr"])
        ctx.tuned.load_state(x)
        params = ctx.tuned.params  # name -> the trainable torch parameter
        shift = {k: torch.from_numpy(c[k] - c_i[k]).to(p.device, p.dtype) for k, p in params.items()}

        def correct() -> None:  # before every optimizer step (and its clipping): g <- g - c_i + c
            with torch.no_grad():
                for k, p in params.items():
                    if p.grad is None:
                        p.grad = shift[k].clone()
                    else:
                        p.grad.add_(shift[k])

        result = ctx.train(before_step=correct)
        y = ctx.tuned.state()
        scale = 1.0 / (max(result.steps, 1) * lr)
        new_c_i = {k: (c_i[k] - c[k] + (x[k] - y[k]) * scale).astype(np.float32) for k in x}
        ctx.state["control"] = new_c_i
        arrays = {**y, **{CONTROL + k: (new_c_i[k] - c_i[k]).astype(np.float32) for k in x}}
        meta = {"round": payload.meta["round"], "num_examples": ctx.num_examples, **result.as_meta()}
        return fedpeft.Payload(arrays, meta)


fedpeft.register_algorithm("scaffold", options=ScaffoldOptions, server=ScaffoldServer, client=ScaffoldClient)
