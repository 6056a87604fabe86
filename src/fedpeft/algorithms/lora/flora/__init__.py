"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024): stacking aggregation, merged into the backbone every round.

:mod:`.options` holds its options, :mod:`.halves` its server and client halves (written against the public
API, as a user's plugin is)."""

import fedpeft
from fedpeft.algorithms.lora.flora.options import FLoraOptions


def register() -> None:
    """Register flora (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("flora", options=FLoraOptions, server="fedpeft.algorithms.lora.flora.halves:FLoraServer",
                               client="fedpeft.algorithms.lora.flora.halves:FLoraClient")
