"""Byzantine-robust aggregation (``algorithm.robust``): rules registered by name, each in its own module with its
options, applied by wrapping the server half of any algorithm that has a ``robust`` option.

* median: coordinate-wise median (Yin et al. 2018), :mod:`.median`;
* trimmed mean: per coordinate, drop the floor(beta n) largest and smallest values, average the rest (same paper),
  :mod:`.trimmed_mean`;
* Krum / Multi-Krum (Blanchard et al. 2017), :mod:`.krum`;
* norm bounding (Sun et al. 2019): each update scaled to L2 norm <= bound, then the sample-weighted mean,
  :mod:`.norm_bound`.

:mod:`.core` holds what the rules share, :mod:`.registry` the registration a plugin calls too
(``fedpeft.register_robust_rule``), :mod:`.wrapper` the server wrapper. Importing this package registers nothing
and imports no torch.
"""

import fedpeft
from fedpeft.algorithms.robust.krum import KrumRule, MultiKrumRule
from fedpeft.algorithms.robust.median import MedianRule
from fedpeft.algorithms.robust.norm_bound import NormBoundRule
from fedpeft.algorithms.robust.trimmed_mean import TrimmedMeanRule

RULES = "fedpeft.algorithms.robust"


def register() -> None:
    """Register median, trimmed_mean, krum, multi_krum and norm_bound (fedpeft.builtins.register calls this)."""
    fedpeft.register_robust_rule("median", options=MedianRule, aggregate=f"{RULES}.median:aggregate")
    fedpeft.register_robust_rule("trimmed_mean", options=TrimmedMeanRule, aggregate=f"{RULES}.trimmed_mean:aggregate")
    fedpeft.register_robust_rule("krum", options=KrumRule, aggregate=f"{RULES}.krum:aggregate_krum")
    fedpeft.register_robust_rule("multi_krum", options=MultiKrumRule, aggregate=f"{RULES}.krum:aggregate_multi_krum")
    fedpeft.register_robust_rule("norm_bound", options=NormBoundRule, aggregate=f"{RULES}.norm_bound:aggregate")
