"""Wrapping a backbone with a PEFT method and exchanging its trainable state by name.

The methods are held in :mod:`fedpeft.tuners.registry` (HF peft's LoRA, IA3, prompt tuning, P-tuning and
prefix tuning and fedpeft's full fine-tuning, BitFit and bottleneck adapters, registered in
:mod:`fedpeft.tuners`; a plugin's own). Whatever
the method, the result is a :class:`TunedModel`
whose trainable parameters (including the task head, e.g. a classifier) are read and written as
``dict[name, numpy array]``: that dict is what federated algorithms exchange.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpeft.config import schema as S
from fedpeft.errors import UserError
from fedpeft.models.layout import TASK_HEADS, ArchSpec, arch_spec
from fedpeft.tuners.registry import SaveFormat, TunerContext, registered_peft_method

FEDPEFT_ADAPTER_FILE = "fedpeft_adapter.safetensors"
FEDPEFT_ADAPTER_CONFIG = "fedpeft_adapter.json"


class StateError(UserError, ValueError):
    """A state dict that does not match the model's trainable parameters."""


class TunedModel:
    """A backbone plus a PEFT method; the trainable parameters are addressable by name."""

    def __init__(self, module: nn.Module, method: str, options: dict[str, Any], save_format: SaveFormat, kind: str):
        self.module = module
        self.method = method
        self.options = options
        self.save_format = save_format  # how save_adapter writes it (see fedpeft.tuners.registry)
        self.kind = kind
        self.params: dict[str, nn.Parameter] = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self.params:
            raise StateError(f"peft method {method!r} left no trainable parameter in this model")

    # -- state exchange ---------------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """A copy of every trainable tensor as float32 numpy."""
        return {n: p.detach().to("cpu", torch.float32).numpy().copy() for n, p in self.params.items()}

    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(p.shape), "float32") for n, p in self.params.items()}

    def load_state(self, arrays: dict[str, np.ndarray], *, partial: bool = False) -> None:
        """Write ``arrays`` into the trainable parameters (names and shapes must match)."""
        unknown = sorted(set(arrays) - set(self.params))
        if unknown:
            raise StateError(f"unknown parameter {unknown[0]!r} ({len(unknown)} unknown in total)")
        if not partial:
            missing = sorted(set(self.params) - set(arrays))
            if missing:
                raise StateError(f"missing parameter {missing[0]!r} ({len(missing)} missing in total)")
        with torch.no_grad():
            for name, value in arrays.items():
                p = self.params[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise StateError(f"{name}: shape {tuple(value.shape)} != expected {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(p.dtype))

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def num_total(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # -- export -----------------------------------------------------------------------------------
    def save_adapter(self, directory: str | Path, base_model: str, extra: dict[str, Any] | None = None) -> None:
        """By the method's save format: HF PEFT format ("peft"), a complete HF model directory ("model") or a
        safetensors file of the trainable state ("state"); always with a JSON description (docs/guide/adapters.md), written
        last, which holds the SHA-256 of every other file and its own (fedpeft.integrity)."""
        from fedpeft.durable import atomic_write
        from fedpeft.integrity import PLACEHOLDER, seal, sha256_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.save_format in ("peft", "model"):
            self.module.save_pretrained(directory)
        else:
            from safetensors.numpy import save_file

            save_file(self.state(), str(directory / FEDPEFT_ADAPTER_FILE))
        files = {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*"))
                 if p.is_file() and p.name != FEDPEFT_ADAPTER_CONFIG}
        meta = {"sha256": PLACEHOLDER, "method": self.method, "options": self.options, "save_format": self.save_format,
                "base_model": base_model, "kind": self.kind,
                "trainable_parameters": self.num_trainable(), **(extra or {}), "files": files}
        atomic_write(directory / FEDPEFT_ADAPTER_CONFIG, seal(json.dumps(meta, indent=2).encode()))


def head_modules(model: nn.Module, spec: ArchSpec | None) -> list[str]:
    """Top-level names of task-head modules present in the model (e.g. 'classifier', 'score')."""
    candidates = spec.heads if spec else TASK_HEADS
    names = {n.split(".")[0] for n, _ in model.named_modules() if n}
    return [h for h in candidates if h in names]


def apply_tuner(model: nn.Module, opts: Any, kind: str, *, tokenizer_path: str | None = None,
                tokenizer: Any = None) -> TunedModel:
    """Wrap ``model`` with the registered PEFT method that ``opts`` (its options, a schema.PeftOptions) names.
    The method's ``apply`` gets the backbone with every parameter frozen; unless it trains a classifier's task
    head itself, the head is unfrozen afterwards. ``tokenizer`` is needed for prefix tuning's ``init_text``."""
    method = registered_peft_method(opts.method)
    spec, spec_error = None, None
    try:
        spec = arch_spec(model.config.model_type)
    except ValueError as exc:
        spec_error = str(exc)
    ctx = TunerContext(kind, spec, spec_error, tuple(head_modules(model, spec)) if kind == "classification" else (),
                       tokenizer, tokenizer_path)
    for p in model.parameters():
        p.requires_grad_(False)
    module = method.apply(model, opts, ctx)
    if kind == "classification" and not method.trains_task_head:
        for h in ctx.head_modules:
            getattr(model, h).requires_grad_(True)  # the backbone's own head, also inside a wrapper
    return TunedModel(module, opts.method, opts.model_dump(mode="json"), method.save_format, kind)


def method_options(method: str, **kwargs: Any):
    """Build the validated option object of a method by name (handy outside a full RunConfig)."""
    return S.options_for("peft", method).model_validate({"method": method, **kwargs})
