"""Wrapping a backbone for ``peft.method: p_tuning`` with Hugging Face PEFT."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.hf_peft import prompt_config_kwargs, wrap
from fedpeft.tuners.registry import TunerContext


def apply_p_tuning(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    import peft

    common = prompt_config_kwargs(model, "p_tuning", ctx)
    enc = {"mlp": peft.PromptEncoderReparameterizationType.MLP,
           "lstm": peft.PromptEncoderReparameterizationType.LSTM}[opts.encoder_type]
    return wrap(model, peft.PromptEncoderConfig(num_virtual_tokens=opts.num_virtual_tokens,
                                                 encoder_reparameterization_type=enc,
                                                 encoder_hidden_size=opts.encoder_hidden_size, **common))
