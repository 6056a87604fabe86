"""PEFT methods: wrapping a backbone and reading/writing its trainable state by name.

Named ``tuners`` (as in HF peft) so that it does not shadow the ``peft`` package. The built-in methods
register below through :func:`fedpeft.tuners.registry.register_peft_method`, the same function a plugin
calls (``fedpeft.register_peft_method``).
"""

from fedpeft.config import schema as S
from fedpeft.heads.layout import prefix_head_params, prompt_head_params, qkv_head_params
from fedpeft.tuners import hf_peft
from fedpeft.tuners.bitfit import apply_bitfit
from fedpeft.tuners.bottleneck import apply_bottleneck
from fedpeft.tuners.full import apply_full
from fedpeft.tuners.registry import (
    PEFT_METHODS,
    PeftMethod,
    TunerContext,
    register_peft_method,
    registered_peft_method,
)
from fedpeft.tuners.tuned import StateError, TunedModel, apply_tuner, method_options

# analytic_ops: the rows of paper 000's Table 6 that count the method (see fedpeft.metrics.ops for the reading)
BACKBONE = ("qkv", "attention", "fc")
INPUT_PROMPTS = ("qkv", "fc", "prompt_tuning")  # the prompt row replaces the attention row

register_peft_method("full", options=S.FullFineTuning, apply=apply_full, save_format="model",
                     analytic_ops=BACKBONE)
register_peft_method("lora", options=S.LoraOptions, apply=hf_peft.apply_lora, save_format="peft",
                     trains_task_head=True, analytic_ops=(*BACKBONE, "lora"), head_params=qkv_head_params)
register_peft_method("ia3", options=S.IA3Options, apply=hf_peft.apply_ia3, save_format="peft",
                     trains_task_head=True, analytic_ops=(*BACKBONE, "ia3"), head_params=qkv_head_params)
register_peft_method("prompt_tuning", options=S.PromptTuningOptions, apply=hf_peft.apply_prompt_tuning,
                     save_format="peft", trains_task_head=True, analytic_ops=INPUT_PROMPTS,
                     head_params=prompt_head_params)
register_peft_method("p_tuning", options=S.PTuningOptions, apply=hf_peft.apply_p_tuning, save_format="peft",
                     trains_task_head=True, analytic_ops=INPUT_PROMPTS, head_params=prompt_head_params)
register_peft_method("prefix_tuning", options=S.PrefixTuningOptions, apply=hf_peft.apply_prefix_tuning,
                     save_format="peft", trains_task_head=True, analytic_ops=("qkv", "fc", "p_tuning"),
                     head_params=prefix_head_params)
register_peft_method("houlsby", options=S.HoulsbyOptions, apply=apply_bottleneck,
                     analytic_ops=BACKBONE)
register_peft_method("pfeiffer", options=S.PfeifferOptions, apply=apply_bottleneck,
                     analytic_ops=BACKBONE)
register_peft_method("bitfit", options=S.BitFitOptions, apply=apply_bitfit, analytic_ops=BACKBONE)

__all__ = [
    "PEFT_METHODS",
    "PeftMethod",
    "StateError",
    "TunedModel",
    "TunerContext",
    "apply_tuner",
    "method_options",
    "register_peft_method",
    "registered_peft_method",
]
