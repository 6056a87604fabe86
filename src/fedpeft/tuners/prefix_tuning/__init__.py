"""Prefix tuning / P-tuning v2 (deep prompts) through Hugging Face PEFT (:mod:`.apply`), with the
initialisation from a text's keys and values (:mod:`.prefix_init`); the prompt's per-layer layout, which FedPepTAO
and FedSP use, is below them in :mod:`fedpeft.tuners.prefix_layers`."""

import fedpeft
from fedpeft.tuners.prefix_tuning.options import PrefixTuningOptions


def register() -> None:
    """Register prefix_tuning (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("prefix_tuning", options=PrefixTuningOptions, apply="fedpeft.tuners.prefix_tuning.apply:apply_prefix_tuning",
                                 save_format="peft", trains_task_head=True,
                                 analytic_ops="fedpeft.tuners.prefix_tuning.ops:prefix_ops", head_params="fedpeft.tuners.prefix_tuning.heads:prefix_head_params")
