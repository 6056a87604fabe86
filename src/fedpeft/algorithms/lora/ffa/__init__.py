"""FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024).

:mod:`.options` holds its options, :mod:`.halves` its server and client halves (written against the public
API, as a user's plugin is)."""

import fedpeft
from fedpeft.algorithms.lora.ffa.options import FfaLoraOptions


def register() -> None:
    """Register ffa_lora (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("ffa_lora", options=FfaLoraOptions, server="fedpeft.algorithms.lora.ffa.halves:FfaLoraServer",
                               client="fedpeft.algorithms.lora.ffa.halves:FfaLoraClient")
