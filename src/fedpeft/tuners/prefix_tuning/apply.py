"""Wrapping a backbone for ``peft.method: prefix_tuning`` with Hugging Face PEFT."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.hf_peft import prompt_config_kwargs, wrap
from fedpeft.tuners.registry import TunerContext


def apply_prefix_tuning(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    import peft

    common = prompt_config_kwargs(model, "prefix_tuning", ctx)
    wrapped = wrap(model, peft.PrefixTuningConfig(num_virtual_tokens=opts.num_virtual_tokens,
                                                   prefix_projection=opts.projection,
                                                   encoder_hidden_size=opts.encoder_hidden_size, **common))
    if opts.init_text:
        from fedpeft.tuners.prefix_tuning.prefix_init import init_prefix_from_text

        if ctx.tokenizer is None:
            raise ValueError("peft.init_text needs the model's tokenizer (pass tokenizer= to apply_tuner)")
        init_prefix_from_text(wrapped, ctx.tokenizer, opts.init_text)
    return wrapped
