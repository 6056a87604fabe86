"""Federated LoRA methods, each a plugin registered through the public algorithm API (``import fedpeft``):
FFA-LoRA (:mod:`.ffa`), FedSA-LoRA (:mod:`.fedsa`), FLoRA (:mod:`.flora`), FedEx-LoRA (:mod:`.fedex`),
HetLoRA and FlexLoRA (:mod:`.hetero`). :mod:`.factors` holds the pure factor maths they share and
:mod:`.merge` the merging of products into the backbone. Importing :mod:`fedpeft.algorithms` registers them."""
