"""Paper 002 (FedPepTAO): deep prompts whose selected layers travel, Adam on the clients, momentum and control
variates on the server.

:mod:`.options` its options, :mod:`.halves` the server and client halves, :mod:`.adaptive_server` the server
step (Algorithm 2), :mod:`.layer_selection` the layer scores and selection (Eq. 2-4), :mod:`.hessian_spectrum`
and :mod:`.prompt_probes` the clients' Hessian spectrum rule (Algorithm 1) and their probes of the prompts.
"""

import fedpeft
from fedpeft.algorithms.fedpeptao.options import FedPepTAOOptions


def register() -> None:
    """Register fedpeptao (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedpeptao", options=FedPepTAOOptions, server="fedpeft.algorithms.fedpeptao.halves:FedPepTAOServer",
                               client="fedpeft.algorithms.fedpeptao.halves:FedPepTAOClient")
