"""Full fine-tuning: every weight of the backbone trains and travels (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.full.options import FullFineTuning


def register() -> None:
    """Register full (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("full", options=FullFineTuning, apply="fedpeft.tuners.full.apply:apply_full",
                                 save_format="model", analytic_ops="fedpeft.tuners.full.ops:full_ops",
                                 trains_batched=False)  # every weight is each client's own: nothing to share
