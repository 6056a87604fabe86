"""Prompt tuning (Lester et al. 2021) through Hugging Face PEFT (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.prompt_tuning.options import PromptTuningOptions


def register() -> None:
    """Register prompt_tuning (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("prompt_tuning", options=PromptTuningOptions, apply="fedpeft.tuners.prompt_tuning.apply:apply_prompt_tuning",
                                 save_format="peft", trains_task_head=True,
                                 analytic_ops="fedpeft.tuners.analytic_ops:input_prompts", head_params="fedpeft.heads.layout:prompt_head_params",
                                 row_forwards={"peft:PeftModel": "fedpeft.tuners.prompt_rows:prompt_rows"})
