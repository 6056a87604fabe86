"""The options of ``algorithm.name: fedsp``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import (
    AlgorithmOptions,
    RunConfig,
    peft_methods_with,
    refuse_quantized_backbone,
)


class FedSPOptions(AlgorithmOptions):
    """Paper 003 (FedSP): the server keeps the large model; clients tune prefix prompts on a small auxiliary model
    distilled from it.

    The global model stays on the server; clients receive once an auxiliary model built
    from k of its blocks (applied cyclically at its L positions with cross-layer sharing) and distilled from
    it on the server's data shard, then only prefix prompts (peft.method prefix_tuning). Each round a client
    trains its auxiliary model with the prompts frozen, then the prompts with the model frozen, and returns them;
    the server averages them, tunes them on the global model with its shard and sends them out. Causal LMs
    only (task.type generation or multiple_choice with a decoder-only model); embedded runtime only."""
    asynchronous_unavailable: ClassVar[str | None] = (
        "its server distils the large model into the auxiliary one between rounds, for the clients of the next round")

    name: Literal["fedsp"] = "fedsp"
    robust_unavailable: ClassVar[str] = "robust aggregation of its prompts is not implemented (it averages them, then tunes them on the server)"
    supports_personalized_eval: ClassVar[bool] = True
    aux_layers: int = Field(1, ge=1, description="k: blocks of the global model in the auxiliary model.")
    aux_position: Literal["bottom", "middle", "top"] = Field(
        "bottom", description="Where the k consecutive blocks are taken from (paper Table 3).")
    share_layers: bool = Field(
        True, description="Cross-layer sharing: apply the k blocks cyclically at L positions (block p mod k at "
        "position p) so that all L layers' prompts plug in. false: k positions taking k layers' prompts (the "
        "'w/o CS' ablation).")
    distill_steps: int = Field(
        200, ge=0, description="Knowledge distillation steps on the server's shard before round 1 (0: none, "
        "the 'w/o KD' ablation; the paper runs 5000 on a GPU).")
    distill_lr: float = Field(5e-4, gt=0, description="AdamW lr of the distillation (paper: 5e-4).")
    distill_batch_size: int = Field(8, ge=1)
    client_training: Literal["alternating", "joint", "prompts"] = Field(
        "alternating", description="alternating: auxiliary model (prompts frozen), then prompts (model frozen), "
        "each for the train section's epochs or steps; joint: both at once ('w/o AT'); prompts: the auxiliary "
        "model is never updated (FedPrompt-Single).")
    aux_lr: float | None = Field(
        None, gt=0, description="Learning rate of the auxiliary model's training on the clients (None: train.lr, "
        "which is tuned for the prompts).")
    client_trains: Literal["blocks", "all"] = Field(
        "all", description="Auxiliary parameters a client updates: all (paper 003 and its reference code: the "
        "whole auxiliary model, embeddings and LM head included; each client keeps its own copy of them) or "
        "blocks (everything but the embeddings and the LM head, which stay as distilled and are held once).")
    server_data_fraction: float = Field(
        1 / 11, ge=0, lt=1, description="Share of the training split the server keeps for distillation and its "
        "own prompt tuning (the reference: 1 of client_num + 1 equal shards); the clients share the rest.")
    server_steps: int = Field(
        10, ge=0, description="Steps the server tunes the aggregated prompts on the global model and its shard, "
        "each round (0: none).")
    dp: None = Field(None, description="Not available for fedsp.")

    def check(self, run: RunConfig) -> None:
        if not type(run.peft).layer_prefixes:
            raise ValueError("algorithm fedsp exchanges prefix prompts: set peft.method: "
                             f"{' or '.join(peft_methods_with('layer_prefixes'))}")
        if run.task.type == "classification":
            raise ValueError("algorithm fedsp trains causal language models: set task.type to generation or "
                             "multiple_choice")
        if run.runtime.name != "embedded":
            raise ValueError("algorithm fedsp runs in the embedded runtime only (a Flower ClientApp would load the "
                             "global model, which FedSP keeps on the server): set runtime.name: embedded")
        if not self.share_layers and getattr(run.peft, "projection", False):
            raise ValueError("fedsp without cross-layer sharing maps prompts layer by layer: set peft.projection: false")
        refuse_quantized_backbone(run, "algorithm fedsp copies the global model's blocks into the auxiliary model "
                                        "and distils it, which needs full-precision weights")
        if (self.distill_steps or self.server_steps) and self.server_data_fraction == 0:
            raise ValueError("fedsp distils and tunes on the server's data: set algorithm.server_data_fraction > 0, "
                             "or distill_steps and server_steps to 0")
