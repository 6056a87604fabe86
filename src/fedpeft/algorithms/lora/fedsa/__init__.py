"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025).

:mod:`.options` holds its options, :mod:`.halves` its server and client halves (written against the public
API, as a user's plugin is)."""

import fedpeft
from fedpeft.algorithms.lora.fedsa.options import FedSaLoraOptions


def register() -> None:
    """Register fedsa_lora (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedsa_lora", options=FedSaLoraOptions, server="fedpeft.algorithms.lora.fedsa.halves:FedSaLoraServer",
                               client="fedpeft.algorithms.lora.fedsa.halves:FedSaLoraClient")
