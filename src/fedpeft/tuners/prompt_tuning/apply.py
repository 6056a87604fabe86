"""Wrapping a backbone for ``peft.method: prompt_tuning`` with Hugging Face PEFT."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.hf_peft import prompt_config_kwargs, wrap
from fedpeft.tuners.registry import TunerContext


def apply_prompt_tuning(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    import peft

    common = prompt_config_kwargs(model, "prompt_tuning", ctx)
    kw = {}
    if opts.init_text:
        kw = {"prompt_tuning_init": peft.PromptTuningInit.TEXT, "prompt_tuning_init_text": opts.init_text,
              "tokenizer_name_or_path": ctx.tokenizer_path}
    return wrap(model, peft.PromptTuningConfig(num_virtual_tokens=opts.num_virtual_tokens, **kw, **common))
