"""BitFit (Ben Zaken et al. 2022): only the biases train (:mod:`.apply`)."""

import fedpeft
from fedpeft.tuners.bitfit.options import BitFitOptions


def register() -> None:
    """Register bitfit (fedpeft.builtins.register calls this)."""
    fedpeft.register_peft_method("bitfit", options=BitFitOptions, apply="fedpeft.tuners.bitfit.apply:apply_bitfit",
                                 analytic_ops="fedpeft.tuners.analytic_ops:frozen_backbone")
