"""Paper 003 (FedSP): the server keeps the large model; clients tune prefix prompts on an auxiliary model
distilled from it (:mod:`.halves`; the auxiliary model is built in :mod:`.auxiliary` and distilled in
:mod:`.distill`)."""

import fedpeft
from fedpeft.algorithms.fedsp.options import FedSPOptions


def register() -> None:
    """Register fedsp (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedsp", options=FedSPOptions, server="fedpeft.algorithms.fedsp.halves:FedSPServer",
                               client="fedpeft.algorithms.fedsp.halves:FedSPClient")
