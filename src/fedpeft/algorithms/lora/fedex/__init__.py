"""FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient Fine-Tuning of
Foundation Models", 2024/2025): FedAvg of A and B, plus the residual the averages miss, merged into the
frozen weights so that the global model is exactly the mean of the clients' models.

:mod:`.options` holds its options, :mod:`.halves` its server and client halves (written against the public
API, as a user's plugin is)."""

import fedpeft
from fedpeft.algorithms.lora.fedex.options import FedExLoraOptions


def register() -> None:
    """Register fedex_lora (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("fedex_lora", options=FedExLoraOptions, server="fedpeft.algorithms.lora.fedex.halves:FedExLoraServer",
                               client="fedpeft.algorithms.lora.fedex.halves:FedExLoraClient")
