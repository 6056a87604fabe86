"""P-tuning (Liu et al. 2021) through Hugging Face PEFT (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.p_tuning.options import PTuningOptions


def register() -> None:
    """Register p_tuning (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("p_tuning", options=PTuningOptions, apply="fedpeft.tuners.p_tuning.apply:apply_p_tuning",
                                 save_format="peft", trains_task_head=True,
                                 analytic_ops="fedpeft.tuners.analytic_ops:input_prompts", head_params="fedpeft.heads.layout:prompt_head_params",
                                 row_forwards={"peft:PeftModel": "fedpeft.tuners.prompt_rows:prompt_rows"})
