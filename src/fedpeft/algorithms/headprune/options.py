"""The options of ``algorithm.name: headprune``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from fedpeft.config.schema import AlgorithmOptions, RunConfig, peft_methods_with


class HeadPruneOptions(AlgorithmOptions):
    """Paper 000: head pruning, head-weighted aggregation, loss-difference selection (and baselines B1/B2)."""
    asynchronous_unavailable: ClassVar[str | None] = (
        "its Eq. 8 weights each head by the importance the clients of one round measured, and its Eq. 9 selects a "
        "round's clients by their last losses")

    name: Literal["headprune"] = "headprune"
    robust_unavailable: ClassVar[str] = ("its Eq. 8 weights every attention head's slice by the clients' importance "
                                         "scores, head by head, not one update per client")
    server_lr: float = Field(1.0, gt=0)
    pruning: Literal["importance", "random", "none"] = Field(
        "importance", description="importance = Eq. 6+7; random = baseline B2; none = dense (baseline B1)."
    )
    aggregation: Literal["importance", "fedavg"] = Field(
        "importance", description="Head slices by Eq. 8 (importance) or Eq. 5 over their senders (fedavg)."
    )
    selection: Literal["loss", "random"] = Field("loss", description="Eq. 9 loss difference, or uniform at random.")
    sparsity: float = Field(0.9, ge=0, lt=1, description="Fraction of heads pruned on every client.")
    per_layer: bool = Field(False, description="Keep the top (1 - sparsity) within every attention module.")
    importance_examples: int | None = Field(
        256, ge=1, description="Local examples sampled for the importance pass (None = all)."
    )
    eps: float = Field(1e-8, gt=0, description="Eq. 8 stabiliser.")
    dp: None = Field(None, description="Not available: Eq. 8 weights every head by the clients' importance "
                     "scores, which the server must see in the clear per client; use fedavg-family algorithms "
                     "for differential privacy or secure aggregation.")

    def check(self, run: RunConfig) -> None:
        # here, so that the error comes before any data or model is loaded
        if not type(run.peft).maps_to_heads:
            heads = ", ".join(peft_methods_with("maps_to_heads"))
            raise ValueError(f"algorithm headprune prunes attention heads, which {run.peft.method!r} has none of: "
                             f"set peft.method to one of {heads}")
        if getattr(run.peft, "projection", False):
            raise ValueError("algorithm headprune maps prefixes to heads layer by layer; a prefix projection MLP "
                             "mixes them: set peft.projection: false")

    @model_validator(mode="before")
    @classmethod
    def _no_dp(cls, data):
        if isinstance(data, dict) and data.get("dp") is not None:
            raise ValueError("differential privacy is not available for headprune: its Eq. 8 aggregation weights "
                             "each head by per-client importance scores the server must see in the clear; use "
                             "algorithm.name fedavg (or fedavgm, fedadam, fedyogi, fedprox) with algorithm.dp")
        return data
