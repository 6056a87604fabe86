"""Federated LoRA methods, each a plugin registered through the public algorithm API (``import fedpeft``):
FFA-LoRA (:mod:`.ffa`), FedSA-LoRA (:mod:`.fedsa`), HetLoRA and FlexLoRA (:mod:`.hetero`); the pure factor
maths they share is in :mod:`.factors`. Importing :mod:`fedpeft.algorithms` registers them."""
