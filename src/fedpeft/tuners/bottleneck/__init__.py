"""Bottleneck adapters: Houlsby (after attention and feed-forward) and Pfeiffer (after feed-forward) (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.bottleneck.options import HoulsbyOptions, PfeifferOptions


def register() -> None:
    """Register houlsby and pfeiffer (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("houlsby", options=HoulsbyOptions, apply="fedpeft.tuners.bottleneck.apply:apply_bottleneck",
                                 analytic_ops="fedpeft.tuners.analytic_ops:frozen_backbone")
    fedpeft.register_peft_method("pfeiffer", options=PfeifferOptions, apply="fedpeft.tuners.bottleneck.apply:apply_bottleneck",
                                 analytic_ops="fedpeft.tuners.analytic_ops:frozen_backbone")
