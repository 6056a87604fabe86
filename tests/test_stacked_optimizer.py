"""fedpeft.training.stacked: K clients' tensors stacked along a client axis step exactly (bit for bit, on CPU) as
each client's own torch optimizer would (own learning rate and schedule, own step count, weight decay, momentum, clipping), and
a client that is not active in a step is left untouched."""

from __future__ import annotations

import pytest
import torch

from fedpeft.training.stacked import StackedOptimizer

SHAPES = [(4, 5), (7,), (2, 3, 2)]
K = 3
STEPS = 7
# client 1 sits out steps 2-3 (no batch that step), client 2 stops after step 4 (out of batches)
ACTIVE = [[True, True, True], [True, True, True], [True, False, True], [True, False, True], [True, True, True],
          [True, True, False], [True, True, False]]
TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _reference_optimizer(kind: str, params: list[torch.Tensor], weight_decay: float, momentum: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    return TORCH[kind](params, lr=0.1, weight_decay=weight_decay)


@pytest.mark.parametrize("kind, weight_decay, momentum", [
    ("adamw", 0.0, 0.0), ("adamw", 0.05, 0.0), ("adam", 0.0, 0.0), ("adam", 0.05, 0.0),
    ("sgd", 0.0, 0.0), ("sgd", 0.05, 0.0), ("sgd", 0.0, 0.9), ("sgd", 0.05, 0.9),
])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_each_client_steps_as_its_own_torch_optimizer(kind, weight_decay, momentum, clip):
    gen = torch.Generator().manual_seed(0)
    stacked = [torch.randn((K, *shape), generator=gen, requires_grad=True) for shape in SHAPES]
    own = [[p[k].detach().clone().requires_grad_(True) for p in stacked] for k in range(K)]
    optimizer = StackedOptimizer(stacked, kind, weight_decay=weight_decay, momentum=momentum)
    references = [_reference_optimizer(kind, own[k], weight_decay, momentum) for k in range(K)]
    for step in range(STEPS):
        grads = [torch.randn((K, *shape), generator=gen) * (1 + 3 * step) for shape in SHAPES]  # some get clipped
        lrs = [0.01 * (k + 1) * (1 - step / (2 * STEPS)) for k in range(K)]  # each client its own schedule
        active = torch.tensor(ACTIVE[step])
        for p, g in zip(stacked, grads, strict=True):
            p.grad = g.clone()
        norms = optimizer.clip_grad_norm_(clip, active) if clip is not None else None
        optimizer.step(lrs, active)
        for k in range(K):
            if not ACTIVE[step][k]:
                continue
            for p, g in zip(own[k], grads, strict=True):
                p.grad = g[k].clone()
            if clip is not None:
                expected = torch.nn.utils.clip_grad_norm_(own[k], clip)
                assert torch.equal(norms[k], expected)
            references[k].param_groups[0]["lr"] = lrs[k]
            references[k].step()
        for k in range(K):
            for p, q in zip(stacked, own[k], strict=True):
                # bit for bit on CPU, where torch steps one tensor at a time with the same kernels
                assert torch.equal(p[k].detach(), q.detach()), f"{kind} client {k} after step {step}"
    assert optimizer.steps.tolist() == [sum(a[k] for a in ACTIVE) for k in range(K)]


def test_an_inactive_client_is_left_exactly_as_it_was():
    stacked = [torch.randn(K, 6, requires_grad=True)]
    optimizer = StackedOptimizer(stacked, "adamw", weight_decay=0.1)
    stacked[0].grad = torch.randn(K, 6)
    optimizer.step([0.1] * K)
    before = (stacked[0].detach().clone(), optimizer.exp_avg[0].clone(), optimizer.exp_avg_sq[0].clone())
    stacked[0].grad = torch.randn(K, 6)
    optimizer.step([0.1] * K, torch.tensor([True, False, True]))
    assert torch.equal(stacked[0][1], before[0][1]) and torch.equal(optimizer.exp_avg[0][1], before[1][1])
    assert torch.equal(optimizer.exp_avg_sq[0][1], before[2][1]) and optimizer.steps.tolist() == [2, 1, 2]
    assert not torch.equal(stacked[0][0], before[0][0])


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="one of adamw, adam, sgd"):
        StackedOptimizer([torch.zeros(2, 3)], "lion")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="client axis first, with one size"):
        StackedOptimizer([torch.zeros(2, 3), torch.zeros(3, 3)], "adamw")
    optimizer = StackedOptimizer([torch.zeros(2, 3, requires_grad=True)], "sgd")
    with pytest.raises(ValueError, match="one learning rate per client: 3 for 2 clients"):
        optimizer.step([0.1, 0.1, 0.1])
