"""FedProx (Li et al. 2020): FedAvg on the server, a proximal term on the client (:mod:`.halves`)."""

import fedpeft
from fedpeft.algorithms.fedprox.options import FedProxOptions


def register() -> None:
    """Register fedprox (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedprox", options=FedProxOptions, server="fedpeft.algorithms.fedprox.halves:FedProxServer",
                               client="fedpeft.algorithms.fedprox.halves:fedprox_client")
