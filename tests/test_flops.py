"""Measured FLOPs count the CPU's fused attention (fedpeft.metrics.flops), so a run's counted work, and the
simulated clock built on it, do not depend on whether the host's attention kernel is fused or not."""

import pytest
import torch
import torch.nn.functional as F

from fedpeft.metrics.flops import flop_counter
from fedpeft.models import registry


def attention_inputs(masked: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 10, 10)
    if masked:
        mask[..., 7:] = float("-inf")
    return q, k, v, mask


def math_attention_flops(q, k, v) -> int:
    """What the counter gives attention written out as products (``eager`` attention; the math kernel)."""
    with flop_counter() as counter:
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        (scores.softmax(-1) @ v).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(("masked", "causal"), [(False, False), (True, False), (False, True)])
def test_the_cpu_fused_attention_counts_what_its_products_count(masked, causal):
    from torch.utils.flop_counter import flop_registry

    table = dict(flop_registry)
    q, k, v, mask = attention_inputs(masked)
    with flop_counter() as counter:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None, is_causal=causal)
        out.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    forward = 4 * 2 * 3 * 10 * 10 * 8  # (10 x 8)(8 x 10) and (10 x 10)(10 x 8) per head, 2 FLOPs a multiply-add
    assert counts == {"aten._scaled_dot_product_flash_attention_for_cpu": forward,
                      "aten._scaled_dot_product_flash_attention_for_cpu_backward": 2 * forward}
    assert counter.get_total_flops() == math_attention_flops(q, k, v) == 3 * forward
    assert dict(flop_registry) == table  # torch's global formula table is left as it is


def test_a_factor_without_gradient_costs_the_math_kernel_one_product_but_not_the_fused_kernel():
    # the documented limit: a fused kernel computes (and is counted for) all three gradients
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = attention_inputs(False)
    k = k.detach()
    forward = 4 * 2 * 3 * 10 * 10 * 8
    with flop_counter() as fused:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert {str(op) for op in fused.get_flop_counts()["Global"]} == {
        "aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward"}
    assert fused.get_total_flops() == 3 * forward
    with flop_counter() as math, sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert math.get_total_flops() == math_attention_flops(q, k, v) == forward + 3 * forward // 2 == 48_000


def test_every_fused_attention_backward_torch_knows_is_counted_as_the_model_s_products():
    # CUDA's kernels cannot run here: their formulas are checked on shapes (the model's products: twice the
    # forward, as the math kernel counts them; torch's own formulas add the scores' recomputation)
    from torch.utils.flop_counter import flop_registry

    from fedpeft.metrics.flops import (
        _attention_formulas,
        attention_backward_flops,
        attention_forward_flops,
    )

    formulas = _attention_formulas()
    fused_backward = {op for op in flop_registry if "scaled_dot_product" in str(op) and "backward" in str(op)}
    assert fused_backward and fused_backward <= set(formulas), sorted(map(str, fused_backward - set(formulas)))
    q, kv = (2, 8, 16, 64), (2, 2, 24, 64)  # grouped-query: 8 query heads on 2 key/value heads
    forward = attention_forward_flops(q, kv, kv)
    assert forward == 2 * (2 * 8 * 16 * 24 * 64) * 2  # two products per query head, 2 FLOPs a multiply-add
    assert attention_backward_flops(q, q, kv, kv) == 2 * forward


def train_step_flops(attn_implementation: str, dropout: bool) -> int:
    tok = registry.load_tokenizer("minilm-l6")
    model = registry.load_model("minilm-l6", "classification", num_labels=2, tokenizer=tok, seed=0,
                                attn_implementation=attn_implementation)
    model.train(dropout)  # without dropout the CPU takes its fused kernel; with it, the math kernel
    batch = tok(["a short one", "a longer sentence with a few more words in it"], padding=True, return_tensors="pt")
    with flop_counter() as counter:
        model(**batch, labels=torch.tensor([0, 1])).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("dropout", [False, True])
def test_a_real_backbone_counts_the_same_training_flops_with_fused_and_eager_attention(dropout):
    # before the CPU's kernel was counted, sdpa without dropout gave the backbone's attention as 0 FLOPs
    assert train_step_flops("sdpa", dropout) == train_step_flops("eager", dropout) > 0
