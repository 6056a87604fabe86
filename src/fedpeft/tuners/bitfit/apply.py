"""BitFit (Ben Zaken et al. 2022): train the backbone's bias terms only (plus a classifier's task head)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.registry import TunerContext


def apply_bitfit(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias") or n == "bias"]
    if not biases:
        raise ValueError(f"bitfit: {model.config.model_type!r} has no bias parameters; choose another peft method")
    for p in biases:
        p.requires_grad_(True)
    return model
