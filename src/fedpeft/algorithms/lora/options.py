"""Options the federated LoRA methods share: FedAvg-style ones and merging ones, and their config check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fedpeft.config.adversarial import RobustRule
from fedpeft.config.schema import AlgorithmOptions, peft_methods_with

MERGED_ADAPTER = ("a {name} run merges the clients' LoRA products into the backbone every round, and its adapter "
                  "holds the LoRA factors and head without them; load the run's checkpoint history onto the backbone "
                  "instead (see docs/guide/federated-lora.md)")


class LoraFedAvgOptions(AlgorithmOptions):
    """Options of a LoRA method that averages what travels (FedAvg with a server step on the mean change)."""

    supports_personalized_eval: ClassVar[bool] = True
    asynchronous_unavailable: ClassVar[str | None] = None
    server_lr: float = Field(1.0, gt=0, description="Step on the clients' sample-weighted mean change.")
    robust: RobustRule | None = Field(None, description="A Byzantine-robust rule in place of the weighted "
                                              "mean of what travels (any registered rule: fedpeft methods --kind "
                                              "robust).")

    def check(self, run: Any) -> None:
        require_lora(run, self.name)


class RankGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(ge=1, description="LoRA rank of the clients in this group.")
    share: float = Field(gt=0, le=1, description="Share of the federation's clients in this group.")


def check_ranks(run: Any, algorithm: str, groups: Sequence[RankGroup], explicit: Mapping[int, int]) -> None:
    """Refuse rank groups whose shares do not sum to 1, ranks outside 1..peft.r and clients that do not exist."""
    if groups:
        total = sum(g.share for g in groups)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"algorithm.rank_groups: the shares sum to {total:g}; make them sum to 1")
    ranks = [g.rank for g in groups] + list(explicit.values())
    if ranks and (max(ranks) > run.peft.r or min(ranks) < 1):
        raise ValueError(f"algorithm {algorithm}: ranks {sorted(set(ranks))} must lie in 1..peft.r "
                         f"({run.peft.r}); set peft.r to the largest rank of the federation")
    n = run.federation.num_clients
    bad = sorted(c for c in explicit if not 0 <= c < n)
    if bad:
        raise ValueError(f"algorithm.client_ranks: client {bad[0]} does not exist "
                         f"(federation.num_clients is {n}: ids 0..{n - 1})")


def require_lora(run: Any, algorithm: str) -> None:
    """Refuse a run whose PEFT method does not train LoRA factors (its options' ``lora_factors``; the config check
    of every method here)."""
    if not type(run.peft).lora_factors:
        able = " or ".join(peft_methods_with("lora_factors"))
        raise ValueError(f"algorithm {algorithm} aggregates LoRA's A and B factors: set peft.method: {able} "
                         f"(the config has peft.method: {run.peft.method})")


class MergingOptions(AlgorithmOptions):
    """What the merging methods share: LoRA on an unquantized float32 backbone, personalized scores (the merged
    global model), and an adapter that is not the run's model (subclasses set ``adapter_incomplete``)."""
    asynchronous_unavailable: ClassVar[str | None] = (
        "it merges the products of one round's clients into the backbone, which every client of the next round "
        "starts from")

    supports_personalized_eval: ClassVar[bool] = True
    robust_unavailable: ClassVar[str] = ("it combines every client's factors exactly (stacked or as a residual), "
                                         "so nothing is averaged that a robust rule could replace")

    def check(self, run: Any) -> None:
        require_lora(run, self.name)
        if run.model.quantization is not None:
            raise ValueError(f"model.quantization: algorithm {self.name} adds the clients' LoRA products to the "
                             "backbone's weights, which are frozen in 4 or 8 bits; remove model.quantization or use "
                             "another algorithm")
        if run.model.dtype != "float32":
            raise ValueError(f"model.dtype: algorithm {self.name} adds small LoRA products to the backbone's weights, "
                             f"which in {run.model.dtype} would round most of each update away; set model.dtype: "
                             "float32")
