"""Wrapping a backbone for ``peft.method: lora`` with Hugging Face PEFT."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.hf_peft import config_kwargs, wrap
from fedpeft.tuners.registry import TunerContext


def apply_lora(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    import peft

    targets = opts.target_modules or list(ctx.require_spec("lora").qkv)
    return wrap(model, peft.LoraConfig(r=opts.r, lora_alpha=opts.alpha, lora_dropout=opts.dropout,
                                        target_modules=targets, **config_kwargs(model, ctx)))
