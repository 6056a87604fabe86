"""LoRA (Hu et al. 2022) through Hugging Face PEFT (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.lora.options import LoraOptions


def register() -> None:
    """Register lora (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("lora", options=LoraOptions, apply="fedpeft.tuners.lora.apply:apply_lora",
                                 save_format="peft", trains_task_head=True, analytic_ops="fedpeft.tuners.lora.ops:lora_ops",
                                 head_params="fedpeft.heads.layout:qkv_head_params")
