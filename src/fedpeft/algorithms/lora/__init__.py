"""Federated LoRA methods, each a package that registers itself through the public algorithm API
(``import fedpeft``), as a user's plugin does: FFA-LoRA (:mod:`.ffa`), FedSA-LoRA (:mod:`.fedsa`), FLoRA
(:mod:`.flora`), FedEx-LoRA (:mod:`.fedex`), HetLoRA and FlexLoRA (:mod:`.hetero`). What they share:
:mod:`.options` (option bases and the config check), :mod:`.common` (the FedAvg-style server step) and
:mod:`.merge` (merging products into the backbone); the factor maths, which FedAvg's report uses
too, is below both (:mod:`fedpeft.tuners.lora_factors`)."""
