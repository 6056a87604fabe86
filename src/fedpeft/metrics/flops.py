"""Measured FLOPs that do not depend on the attention kernel: torch's ``FlopCounterMode`` with attention counted
as the model's FLOPs, the same whichever kernel ran it.

The simulated clock turns counted FLOPs into time, so the count must not depend on the host. torch's counter
falls short of that in two ways:

* it has no formula for the CPU's fused kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward), so on a CPU a backbone whose ``scaled_dot_product_attention`` takes that kernel (transformers'
  ``sdpa``, the default, without attention dropout) counts its attention as 0 FLOPs;
* its formulas for CUDA's fused kernels (flash, memory-efficient, cuDNN) count the backward as the kernel executes
  it, recomputing the attention scores (five batched products), where the math kernel (the CPU's with dropout,
  ``eager`` attention, CUDA's fallback) is counted by its products, four in the backward.

:func:`flop_counter` counts every one of them as the model's FLOPs, the convention of model-FLOPs utilisation:
forward, the two batched products (scores = Q K^T, then scores V); backward, the two products that each of
those takes (the gradients of both its factors), so twice the forward; no recomputation. A kernel that recomputes
does more work on the device than is counted, and that is the point: the count is the model's, not the kernel's.
The formulas are passed as the counter's ``custom_mapping``, so torch's global formula table is left as it is.
Nested (jagged) attention inputs are not covered (fedpeft's batches are padded dense tensors).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = ["attention_backward_flops", "attention_forward_flops", "flop_counter"]


def attention_forward_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    """Forward FLOPs of attention with query/key/value of shape (batch, heads, length, head dim): its two batched
    products at 2 FLOPs a multiply-add (torch's own formula for the fused kernels' forward)."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    """Backward FLOPs of attention: for each of the forward's two products, the product giving each factor's
    gradient, so twice the forward (a fused kernel's recomputation of the scores is not model work)."""
    return 2 * attention_forward_flops(query_shape, key_shape, value_shape)


def _attention_formulas() -> dict[Any, Any]:
    ops = torch.ops.aten
    return {ops._scaled_dot_product_flash_attention_for_cpu: attention_forward_flops,
            ops._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
            ops._scaled_dot_product_flash_attention_backward: attention_backward_flops,
            ops._scaled_dot_product_efficient_attention_backward: attention_backward_flops,
            ops._scaled_dot_product_cudnn_attention_backward: attention_backward_flops}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that counts attention as the model's FLOPs on every kernel (see the module)."""
    return FlopCounterMode(display=False, custom_mapping=_attention_formulas())
