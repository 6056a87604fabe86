"""Wrapping a backbone for ``peft.method: ia3`` with Hugging Face PEFT."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.hf_peft import config_kwargs, wrap
from fedpeft.tuners.registry import TunerContext


def apply_ia3(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    import peft

    kw = {}
    spec = ctx.spec
    if opts.target_modules:
        kw["target_modules"] = opts.target_modules
        kw["feedforward_modules"] = opts.feedforward_modules or []
    elif (spec is not None and len(spec.qkv) == 3
          and model.config.model_type not in peft.utils.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING):
        # peft has no default for this architecture (e.g. DistilBERT): key, value and the feed-forward
        # output, IA3's original choice (peft's own defaults vary by architecture)
        kw["target_modules"] = [spec.qkv[1], spec.qkv[2], spec.ffn_out]
        kw["feedforward_modules"] = [spec.ffn_out]
    elif spec is not None and not spec.attn_out:  # no attention (ConvNeXt): IA3's feed-forward scaling only
        kw["target_modules"] = kw["feedforward_modules"] = [spec.ffn_out]
    return wrap(model, peft.IA3Config(**kw, **config_kwargs(model, ctx)))
