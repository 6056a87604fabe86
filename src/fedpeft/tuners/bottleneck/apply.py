"""Bottleneck adapters (Houlsby et al. 2019; Pfeiffer et al. 2021), written here because AdapterHub's
``adapters`` package pins an older transformers and HF peft has no bottleneck adapters.

An adapter maps a sublayer's output ``h`` to ``h + W_up act(W_down h)`` before the residual
connection. It is attached to the sublayer's output projection through a forward hook, so the
backbone's own module names and weights stay untouched and any projection type works (``nn.Linear``,
GPT-2's ``Conv1D``). The adapter module is registered as a child named ``adapter`` of that projection,
so its parameters appear in ``named_parameters()`` as ``<projection>.adapter.{down,up}.{weight,bias}``.

* Houlsby: after every attention block (self and, in encoder-decoders, cross attention) and after every
  feed-forward block.
* Pfeiffer: after every feed-forward block only.

Placement detail: in BERT the adapter sees the projection output before the block's dropout (AdapterHub
applies it after dropout); at evaluation time, when dropout is off, the two are identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedpeft.models.layout import ArchSpec
from fedpeft.tuners.registry import TunerContext

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "swish": nn.SiLU, "tanh": nn.Tanh}
ADAPTER_CHILD = "adapter"


class BottleneckAdapter(nn.Module):
    def __init__(self, hidden: int, bottleneck: int, non_linearity: str = "relu", init_std: float = 1e-2):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck)
        self.up = nn.Linear(bottleneck, hidden)
        self.act = ACTIVATIONS[non_linearity]()
        for layer in (self.down, self.up):
            nn.init.normal_(layer.weight, std=init_std)
            nn.init.zeros_(layer.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.to(self.down.weight.dtype)
        return h + self.up(self.act(self.down(x))).to(h.dtype)


def _out_features(module: nn.Module) -> int:
    if hasattr(module, "out_features"):
        return int(module.out_features)
    if hasattr(module, "nf"):  # transformers' Conv1D (GPT-2)
        return int(module.nf)
    raise TypeError(f"cannot attach an adapter to {type(module).__name__}: unknown output width")


def _hook(module: nn.Module, args, output):
    return getattr(module, ADAPTER_CHILD)(output)


def adapter_sites(model: nn.Module, spec: ArchSpec, kind: str) -> list[str]:
    """Names of the projections that get an adapter: 'houlsby' or 'pfeiffer'."""
    if kind == "houlsby" and not spec.attn_out:
        raise ValueError("houlsby puts an adapter after each attention and each feed-forward block, and this "
                         "architecture has no attention; use pfeiffer (an adapter after each feed-forward block)")
    sites = []
    for name, _ in model.named_modules():
        is_ffn = name.endswith(spec.ffn_out) and not any(name.endswith(x) for x in spec.ffn_out_excludes)
        is_attn = any(name.endswith(a) for a in spec.attn_out)
        if is_ffn or (kind == "houlsby" and is_attn):
            sites.append(name)
    if not sites:
        raise ValueError(f"no adapter sites found for {kind} (looked for {spec.attn_out} / {spec.ffn_out})")
    return sites


def add_bottleneck_adapters(
    model: nn.Module, spec: ArchSpec, kind: str, *, reduction_factor: int = 16, bottleneck_size: int | None = None,
    non_linearity: str = "relu", init_std: float = 1e-2,
) -> list[str]:
    """Insert adapters in place; returns the names of the adapted projections."""
    sites = adapter_sites(model, spec, kind)
    modules = dict(model.named_modules())
    for name in sites:
        target = modules[name]
        hidden = _out_features(target)
        size = bottleneck_size or max(1, hidden // reduction_factor)
        adapter = BottleneckAdapter(hidden, size, non_linearity, init_std)
        target.add_module(ADAPTER_CHILD, adapter.to(next(target.parameters()).device))
        target.register_forward_hook(_hook)
    return sites


def apply_bottleneck(model: nn.Module, opts: Any, ctx: TunerContext) -> nn.Module:
    """The registered ``apply`` of houlsby and pfeiffer (``opts.method`` says which)."""
    add_bottleneck_adapters(model, ctx.require_spec(opts.method), opts.method, reduction_factor=opts.reduction_factor,
                            bottleneck_size=opts.bottleneck_size, non_linearity=opts.non_linearity,
                            init_std=opts.init_std)
    return model
