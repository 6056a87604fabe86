"""A fedpeft plugin: LayerNorm tuning as a PEFT method.

Only the gain and bias of the backbone's normalisation layers train and travel (plus a classifier's task
head, which fedpeft unfreezes for every method): a few thousand parameters, a strong baseline for its size
(Qi et al. 2022, "Parameter-efficient tuning on layer normalization for pre-trained language models";
Zhao et al. 2024, "Tuning LayerNorm in attention"). HF peft has no such method. Written against
``import fedpeft`` only.

    fedpeft run examples/custom_peft_method/config.yaml --plugin examples/custom_peft_method/plugin.py
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

import fedpeft


class LayerNormTuningOptions(fedpeft.PeftOptions):
    """peft: {method: layernorm, skip_embedding_norm: false}"""

    method: Literal["layernorm"] = "layernorm"
    skip_embedding_norm: bool = Field(False, description="Keep the embeddings' own LayerNorm frozen.")


def is_norm(module: nn.Module) -> bool:
    """LayerNorm and its relatives (T5's and LLaMA's RMSNorm are classes of their own in transformers)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def apply_layernorm_tuning(model: nn.Module, options: LayerNormTuningOptions, ctx: fedpeft.TunerContext) -> nn.Module:
    """Unfreeze every normalisation layer of the (frozen) backbone; the model is changed in place."""
    found = 0
    for name, module in model.named_modules():
        if is_norm(module) and not (options.skip_embedding_norm and "embeddings" in name.split(".")):
            module.requires_grad_(True)
            found += 1
    if not found:
        raise ValueError(f"layernorm: {type(model).__name__} has no normalisation layers; choose another peft method")
    return model


# save_format "state": the trained gains and biases go to RUN_DIR/adapter/fedpeft_adapter.safetensors;
# no analytic_ops (fedpeft.tuners.analytic_ops): runs report measured FLOPs and the analytic OPs as unknown (null).
fedpeft.register_peft_method("layernorm", options=LayerNormTuningOptions, apply=apply_layernorm_tuning,
                             save_format="state")
