"""Clients with different LoRA ranks: HetLoRA (zero-padding) and FlexLoRA (SVD redistribution).

:mod:`.options` holds their options (and the rank assignment's groups), :mod:`.halves` the server and client
halves (written against the public API, as a user's plugin is)."""

import fedpeft
from fedpeft.algorithms.lora.hetero.options import FlexLoraOptions, HetLoraOptions

HALVES = "fedpeft.algorithms.lora.hetero.halves"


def register() -> None:
    """Register hetlora and flexlora (fedpeft.builtins.register calls this)."""
    fedpeft.register_algorithm("hetlora", options=HetLoraOptions, server=f"{HALVES}:HetLoraServer",
                               client=f"{HALVES}:HetLoraClient")
    fedpeft.register_algorithm("flexlora", options=FlexLoraOptions, server=f"{HALVES}:FlexLoraServer",
                               client=f"{HALVES}:flexlora_client")
