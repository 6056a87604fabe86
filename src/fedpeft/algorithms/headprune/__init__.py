"""Paper 000 (Assortment of Attention Heads): head importance, head pruning, head-weighted aggregation and
loss-difference client selection (:mod:`.halves`; the head maths live in :mod:`fedpeft.heads`)."""

import fedpeft
from fedpeft.algorithms.headprune.options import HeadPruneOptions


def register() -> None:
    """Register headprune (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("headprune", options=HeadPruneOptions, server="fedpeft.algorithms.headprune.halves:HeadPruneServer",
                               client="fedpeft.algorithms.headprune.halves:HeadPruneClient")
