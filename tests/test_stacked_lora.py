"""fedpeft.tuners.stacked_lora: K clients' LoRA updates applied in one pass over a fused batch equal each
client's own LoRA (HF peft's ``lora_B(lora_A(x)) * scaling``), forward and backward, both ways of applying them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedpeft.tuners.stacked_lora import gathered_lora_delta, grouped_lora_delta

K, R, IN, OUT, T = 4, 8, 24, 16, 5
SCALING = 2.0


@pytest.mark.parametrize("delta", [gathered_lora_delta, grouped_lora_delta])
def test_each_row_gets_its_own_clients_update_and_gradients(delta):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(K, R, IN, generator=gen, requires_grad=True)
    b = torch.randn(K, OUT, R, generator=gen, requires_grad=True)
    clients = torch.tensor([2, 0, 2, 3, 0, 2, 3])  # client 1 has no row in this fused batch
    x = torch.randn(len(clients), T, IN, generator=gen)
    fused = delta(x, a, b, clients, SCALING)
    weights = torch.randn(fused.shape, generator=gen)
    (fused * weights).sum().backward()
    own_a = [a[k].detach().clone().requires_grad_(True) for k in range(K)]
    own_b = [b[k].detach().clone().requires_grad_(True) for k in range(K)]
    for i, k in enumerate(clients.tolist()):
        expected = F.linear(F.linear(x[i], own_a[k]), own_b[k]) * SCALING  # peft: lora_B(lora_A(x)) * scaling
        torch.testing.assert_close(fused[i], expected, rtol=1e-5, atol=1e-5)
        (expected * weights[i]).sum().backward()
    for k in range(K):
        ga = own_a[k].grad if own_a[k].grad is not None else torch.zeros_like(own_a[k])
        gb = own_b[k].grad if own_b[k].grad is not None else torch.zeros_like(own_b[k])
        torch.testing.assert_close(a.grad[k], ga, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(b.grad[k], gb, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(a.grad[1]) == 0 and torch.count_nonzero(b.grad[1]) == 0  # absent: untouched


def test_bad_shapes_are_refused_in_one_line():
    a, b, x = torch.zeros(2, 4, 6), torch.zeros(2, 5, 4), torch.zeros(3, 6)
    with pytest.raises(ValueError, match="one client index per row: \\(2,\\) for 3 rows"):
        gathered_lora_delta(x, a, b, torch.tensor([0, 1]), 1.0)
    with pytest.raises(ValueError, match=r"client indices must lie in \[0, 2\)"):
        grouped_lora_delta(x, a, b, torch.tensor([0, 1, 2]), 1.0)
    with pytest.raises(ValueError, match="A must be \\(K, r, in\\) and B \\(K, out, r\\)"):
        gathered_lora_delta(x, a, torch.zeros(2, 5, 3), torch.tensor([0, 1, 1]), 1.0)
