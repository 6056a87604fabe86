"""FedProx (Li et al. 2020): FedAvg on the server, a proximal term on the client (:mod:`.halves`)."""

from fedpeft.algorithms.fedprox.options import FedProxOptions
from fedpeft.algorithms.registry import register_algorithm

register_algorithm("fedprox", options=FedProxOptions, server="fedpeft.algorithms.fedprox.halves:FedProxServer",
                   client="fedpeft.algorithms.fedprox.halves:fedprox_client")
