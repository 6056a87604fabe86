"""Optimizer steps for several clients' trainable tensors stacked along a leading client axis.

Groundwork for training a round's clients together over the one frozen backbone (issue 37): there, each
trainable tensor holds K clients' copies as one tensor of shape ``(K, ...)``. :class:`StackedOptimizer` steps
every client's slice exactly as ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` (the optimizers of
``train.optimizer``, with their defaults: betas (0.9, 0.999), eps 1e-8, no amsgrad, no Nesterov, no dampening)
would step that client's own tensors: its own learning rate (so its own schedule), its own step count (so its
own bias correction), weight decay, momentum buffer and gradient clipping (:meth:`clip_grad_norm_`, as
``torch.nn.utils.clip_grad_norm_`` over the client's tensors). A client that is not active in a step (it has
run out of batches while others go on) is left exactly as it was: parameters, moments and step count.

On CPU, where torch's optimizers take their one-tensor-at-a-time path, the same float32 operations run in the
same order on each element (the fused kernels included: ``add_`` with ``alpha`` and ``addcdiv_`` round as
``torch.addcmul`` / ``torch.addcdiv`` do here), so a client's slice matches its own optimizer bit for bit
(``tests/test_stacked_optimizer.py`` checks it with ``torch.equal``). CUDA's optimizers take a multi-tensor path
whose kernels order the operations differently: there, expect agreement to float32 rounding, not bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

OptimizerKind = Literal["adamw", "adam", "sgd"]
BETAS = (0.9, 0.999)
EPS = 1e-8


class StackedOptimizer:
    """Per-client AdamW / Adam / SGD over tensors whose first dimension is the client (see the module doc)."""

    def __init__(self, params: Sequence[torch.Tensor], kind: OptimizerKind, *, weight_decay: float = 0.0,
                 momentum: float = 0.0) -> None:
        if kind not in ("adamw", "adam", "sgd"):
            raise ValueError(f"optimizer {kind!r}: one of adamw, adam, sgd")
        if not params:
            raise ValueError("StackedOptimizer needs at least one stacked tensor")
        clients = {p.shape[0] for p in params}
        if len(clients) != 1 or any(p.dim() < 1 for p in params):
            raise ValueError(f"every tensor must have the client axis first, with one size; got sizes {sorted(clients)}")
        self.params = list(params)
        self.kind = kind
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.num_clients = clients.pop()
        self.steps = torch.zeros(self.num_clients, dtype=torch.long)  # each client's optimizer steps so far
        self.exp_avg = [torch.zeros_like(p) for p in self.params] if kind != "sgd" else []
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params] if kind != "sgd" else []
        self.momentum_buffer = [torch.zeros_like(p) for p in self.params] if kind == "sgd" and momentum else []

    def _per_client(self, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        """Python floats (computed in double precision, as torch computes its scalars) as a (K, 1, ..., 1)
        tensor of ``like``'s dtype, to broadcast over each client's slice."""
        column = torch.tensor(list(values), dtype=torch.float64).to(like.dtype)
        return column.reshape((self.num_clients,) + (1,) * (like.dim() - 1))

    def _mask(self, active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return active.reshape((self.num_clients,) + (1,) * (like.dim() - 1))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, active: torch.Tensor | None = None) -> torch.Tensor:
        """Clip each client's gradients to L2 norm ``max_norm`` over all its tensors, as
        ``torch.nn.utils.clip_grad_norm_`` does for one model; returns the K norms before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(self.num_clients)
        # client by client, tensor by tensor, then over the tensors: the reductions torch runs for one model
        norms = torch.stack([torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g[k]) for g in grads]))
                             for k in range(self.num_clients)])
        coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
        if active is not None:
            coef = torch.where(active, coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef.reshape((self.num_clients,) + (1,) * (g.dim() - 1)).to(g.dtype))
        return norms

    @torch.no_grad()
    def step(self, lrs: Sequence[float], active: torch.Tensor | None = None) -> None:
        """One optimizer step of every active client, client k at learning rate ``lrs[k]``."""
        if len(lrs) != self.num_clients:
            raise ValueError(f"give one learning rate per client: {len(lrs)} for {self.num_clients} clients")
        active = torch.ones(self.num_clients, dtype=torch.bool) if active is None else active.to(torch.bool)
        first = self.steps == 0
        self.steps = self.steps + active.long()
        counts = [int(s) for s in self.steps]
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            if self.kind == "sgd":
                self._sgd(i, param, param.grad, lrs, active, first)
            else:
                self._adam(i, param, param.grad, lrs, counts, active)

    def _adam(self, i: int, param: torch.Tensor, grad: torch.Tensor, lrs: Sequence[float], counts: list[int],
              active: torch.Tensor) -> None:
        beta1, beta2 = BETAS
        mask = self._mask(active, param)
        new_param = param.clone()
        if self.weight_decay != 0:
            if self.kind == "adamw":
                new_param.mul_(self._per_client([1 - lr * self.weight_decay for lr in lrs], param))
            else:
                grad = grad.add(param, alpha=self.weight_decay)
        exp_avg = self.exp_avg[i].lerp(grad, 1 - beta1)
        exp_avg_sq = self.exp_avg_sq[i].mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        # an inactive client's count did not move; its (unused) factors are those of its last step
        steps = [max(c, 1) for c in counts]
        step_size = self._per_client([lr / (1 - beta1**s) for lr, s in zip(lrs, steps, strict=True)], param)
        bias_correction2_sqrt = self._per_client([(1 - beta2**s) ** 0.5 for s in steps], param)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(EPS)
        new_param.addcdiv_(step_size.neg() * exp_avg, denom)  # as torch's addcdiv_(exp_avg, denom, value=-lr_t)
        self.exp_avg[i] = torch.where(mask, exp_avg, self.exp_avg[i])
        self.exp_avg_sq[i] = torch.where(mask, exp_avg_sq, self.exp_avg_sq[i])
        param.copy_(torch.where(mask, new_param, param))

    def _sgd(self, i: int, param: torch.Tensor, grad: torch.Tensor, lrs: Sequence[float], active: torch.Tensor,
             first: torch.Tensor) -> None:
        mask = self._mask(active, param)
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum != 0:
            buf = self.momentum_buffer[i]
            continued = buf.mul(self.momentum).add_(grad)
            new_buf = torch.where(self._mask(first, param), grad, continued)  # torch starts the buffer at the grad
            self.momentum_buffer[i] = torch.where(mask, new_buf, buf)
            grad = new_buf
        new_param = torch.addcmul(param, grad, self._per_client([-lr for lr in lrs], param))  # torch's fused a+x*b
        param.copy_(torch.where(mask, new_param, param))
