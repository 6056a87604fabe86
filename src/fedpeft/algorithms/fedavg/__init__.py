"""The FedAvg family (McMahan et al. 2017; Reddi et al. 2021): ``fedavg``, ``fedavgm``, ``fedadam``, ``fedyogi``.

:mod:`.options` holds their options, :mod:`.halves` the server halves (a server step on the clients'
weighted mean change, taken through ``ServerAlgorithm.combine``, whose place the ``robust`` and ``dp`` wrappers take)
and the client half they share (plain local training; under ``dp`` its wrapper clips the change).
"""

import fedpeft
from fedpeft.algorithms.fedavg.options import (
                   FedAdamOptions,
                   FedAvgMOptions,
                   FedAvgOptions,
                   FedYogiOptions,
)

HALVES = "fedpeft.algorithms.fedavg.halves"


def register() -> None:
    """Register fedavg, fedavgm, fedadam and fedyogi (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedavg", options=FedAvgOptions, server=f"{HALVES}:FedAvgServer", client=f"{HALVES}:fedavg_client")
    fedpeft.register_algorithm("fedavgm", options=FedAvgMOptions, server=f"{HALVES}:FedAvgMServer",
                               client=f"{HALVES}:fedavg_client")
    fedpeft.register_algorithm("fedadam", options=FedAdamOptions, server=f"{HALVES}:FedAdamServer",
                               client=f"{HALVES}:fedavg_client")
    fedpeft.register_algorithm("fedyogi", options=FedYogiOptions, server=f"{HALVES}:FedYogiServer",
                               client=f"{HALVES}:fedavg_client")
