"""The options of ``algorithm.name: fedpeptao``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from fedpeft.config.schema import AlgorithmOptions, RunConfig, peft_methods_with


class FedPepTAOOptions(AlgorithmOptions):
    """Paper 002 (FedPepTAO): deep prompts of which only the selected layers travel, Adam on the clients,
    momentum and control variates on the server.

    Deep prompts (peft.method prefix_tuning, projection: false) of which only the selected layers travel, with Adam on the clients (train.optimizer) and momentum plus control
    variates on the server (Algorithm 2). Rounds 1..selection_round exchange every layer; clients report
    layer scores (Eq. 2-3) in those rounds and, at selection_round, the share of their prompt Hessian's
    spectrum worth keeping (Algorithm 1); the server then fixes the layers for the rest of the run. The
    prompts of the other layers stay on each client (personal) from then on."""
    asynchronous_unavailable: ClassVar[str | None] = (
        "its server momentum and control variates step once per round of clients that trained the same layers")

    name: Literal["fedpeptao"] = "fedpeptao"
    robust_unavailable: ClassVar[str] = ("its server step (Algorithm 2) keeps control variates and momentum from every "
                                         "client's own update, which a rule that drops updates would leave inconsistent")
    supports_personalized_eval: ClassVar[bool] = True
    layer_selection: Literal["score", "random", "ascending", "descending", "all"] = Field(
        "score", description="score: highest Eq. 3 score first (the method); random / ascending (bottom layers "
        "first) / descending (top layers first): the paper's Appendix B.6 baselines; all: every layer travels "
        "every round (P-tuning v2).",
    )
    ratio: Literal["hessian"] | Annotated[float, Field(gt=0, le=1)] = Field(
        "hessian", description="Share of the prompt parameters to exchange: 'hessian' = the clients' Hessian "
        "spectrum rule (Algorithm 1, as the reference code computes it), or a fixed fraction in (0, 1].",
    )
    selection_round: int = Field(5, ge=1, description="t: the round after which the layers are fixed.")
    score_examples: int = Field(8, ge=2, description="Client samples whose hidden states give the layer scores.")
    hessian_examples: int = Field(8, ge=1, description="Client samples in the batch of the Hessian spectrum.")
    hessian_steps: int = Field(50, ge=1, description="Lanczos iterations (Hessian-vector products) per probe.")
    hessian_probes: int = Field(1, ge=1, description="Random probe vectors of the Lanczos quadrature.")
    server_optimizer: Literal["adaptive", "momentum", "fedavg"] = Field(
        "adaptive", description="adaptive: Algorithm 2 (momentum and control variates); momentum: the same "
        "without control variates (the MomS baselines); fedavg: the weighted mean of the clients' prompts.",
    )
    server_lr: float = Field(0.05, gt=0, description="eta_0 of the server momentum step (reference code: 0.05).")
    server_lr_decay: float = Field(0.99, gt=0, le=1, description="eta_r = max(eta_0 * decay^r, server_lr_min).")
    server_lr_min: float = Field(1e-4, ge=0)
    beta: float = Field(0.9, ge=0, lt=1, description="Server momentum.")
    head_server_step: Literal["fedavg", "same"] = Field(
        "fedavg", description="The task head (the paper has none: it scores with a verbalizer) takes the plain "
        "FedAvg step; 'same': it goes through server_optimizer with the prompts.",
    )
    keep_client_moments: bool = Field(
        False, description="Keep each client's optimizer moments between its rounds (the reference code does; "
        "the paper resets them every round).",
    )
    dp: None = Field(None, description="Not available for fedpeptao.")

    def check(self, run: RunConfig) -> None:
        if not type(run.peft).layer_prefixes or getattr(run.peft, "projection", False):
            raise ValueError("algorithm fedpeptao exchanges deep prompts layer by layer: set peft.method: "
                             f"{' or '.join(peft_methods_with('layer_prefixes'))} with peft.projection: false")
