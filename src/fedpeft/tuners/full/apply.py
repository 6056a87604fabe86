"""Full fine-tuning: every parameter of the backbone trains and travels (the baseline PEFT is measured against)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.tuners.registry import TunerContext


def apply_full(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(True)
    return model
