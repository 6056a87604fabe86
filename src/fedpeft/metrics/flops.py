"""Measured FLOPs that do not depend on which attention kernel torch picks: torch's ``FlopCounterMode`` with
scaled-dot-product attention counted as the model's products on each of torch's kernels.

The simulated clock turns counted FLOPs into time, so the count must not depend on the host. torch's counter
falls short of that in two ways:

* it has no formula for the CPU's fused kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward), so on a CPU a backbone whose ``scaled_dot_product_attention`` takes that kernel (transformers'
  ``sdpa``, the default, without attention dropout) counts its attention as 0 FLOPs;
* its formulas for CUDA's fused kernels (flash, memory-efficient, cuDNN) count the backward as the kernel executes
  it, recomputing the attention scores (five batched products, 2.5x the forward), where the math kernel (the
  CPU's with dropout, ``eager`` attention, CUDA's fallback) is counted by its products, four in the backward.

:func:`flop_counter` counts them as the model's FLOPs, the convention of model-FLOPs utilisation: forward, the two
batched products (scores = Q K^T, then scores V; what torch counts for its fused forward); backward, the product giving each
factor's gradient, twice the forward, with no recomputation. Two limits:

* a fused kernel computes the gradients of query, key and value whether or not they are needed, and its backward
  is counted so; autograd on the math kernel skips the products of a factor that needs no gradient (e.g. the key
  of the first layer when LoRA adapts only the query and the value there): one product less for each such factor,
  up to three of the four;
* attention outside torch's kernels is not counted: ``attn_implementation: flash_attention_2`` (the flash-attn
  package's own ops) counts 0 FLOPs, and torch's varlen entry points (``_flash_attention_backward``,
  ``_efficient_attention_backward``, for nested inputs, which fedpeft's padded batches never are) keep torch's
  2.5x.

The formulas are passed as the counter's ``custom_mapping``, so torch's global formula table is left as it is.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["attention_backward_flops", "attention_forward_flops", "flop_counter"]


def attention_forward_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    """Forward FLOPs of attention with query (batch, heads, length, head dim) and key/value (batch, key/value heads,
    key length, head dim): scores = Q K^T and scores V, 2 FLOPs a multiply-add, every query head counted (grouped
    key/value heads are shared, not fewer products). Written here rather than taken from torch's private
    ``sdpa_flop_count``, which older torch releases refuse for grouped-query shapes."""
    b, heads, q_len, q_dim = query_shape
    k_len, v_dim = key_shape[2], value_shape[3]
    return 2 * b * heads * q_len * k_len * (q_dim + v_dim)


def attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    """Backward FLOPs of attention: for each of the forward's two products, the product giving each factor's
    gradient, so twice the forward (a fused kernel's recomputation of the scores is not model work)."""
    return 2 * attention_forward_flops(query_shape, key_shape, value_shape)


_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu",)
_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward")


@functools.cache
def _attention_formulas() -> dict[Any, Any]:
    """op -> formula for the attention kernels this torch has (an older torch may lack one of them); looked up once,
    not on every sampled step."""
    formulas = {**dict.fromkeys(_FORWARD, attention_forward_flops),
                **dict.fromkeys(_BACKWARD, attention_backward_flops)}
    return {getattr(torch.ops.aten, name): formula for name, formula in formulas.items()
            if hasattr(torch.ops.aten, name)}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that counts attention as the model's FLOPs on torch's kernels (see the module)."""
    return FlopCounterMode(display=False, custom_mapping=_attention_formulas())
