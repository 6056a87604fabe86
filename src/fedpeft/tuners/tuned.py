"""Wrapping a backbone with a PEFT method and exchanging its trainable state by name.

HF peft provides LoRA, IA3, prompt tuning, P-tuning and prefix tuning; full fine-tuning, BitFit and
the bottleneck adapters are done here. Whatever the method, the result is a :class:`TunedModel`
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
from fedpeft.models.layout import ArchSpec, arch_spec
from fedpeft.tuners.bottleneck import add_bottleneck_adapters

PEFT_METHODS = ("lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning")
FEDPEFT_ADAPTER_FILE = "fedpeft_adapter.safetensors"
FEDPEFT_ADAPTER_CONFIG = "fedpeft_adapter.json"


class StateError(UserError, ValueError):
    """A state dict that does not match the model's trainable parameters."""


class TunedModel:
    """A backbone plus a PEFT method; the trainable parameters are addressable by name."""

    def __init__(self, module: nn.Module, method: str, options: dict[str, Any], peft_backed: bool, kind: str):
        self.module = module
        self.method = method
        self.options = options
        self.peft_backed = peft_backed
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
        """HF PEFT format for peft-backed methods; a full HF model dir for full fine-tuning; else a
        safetensors file of the trainable state plus a JSON description (see README)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.peft_backed or self.method == "full":
            self.module.save_pretrained(directory)
        else:
            from safetensors.numpy import save_file

            save_file(self.state(), str(directory / FEDPEFT_ADAPTER_FILE))
        meta = {"method": self.method, "options": self.options, "base_model": base_model, "kind": self.kind,
                "trainable_parameters": self.num_trainable(), **(extra or {})}
        (directory / FEDPEFT_ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2))


def _task_type(kind: str):
    from peft import TaskType

    return {"classification": TaskType.SEQ_CLS, "causal": TaskType.CAUSAL_LM, "seq2seq": TaskType.SEQ_2_SEQ_LM}[kind]


def head_modules(model: nn.Module, spec: ArchSpec | None) -> list[str]:
    """Top-level names of task-head modules present in the model (e.g. 'classifier', 'score')."""
    candidates = spec.heads if spec else ("classifier", "score", "classification_head")
    names = {n.split(".")[0] for n, _ in model.named_modules() if n}
    return [h for h in candidates if h in names]


def _peft_config(opts: Any, kind: str, spec: ArchSpec | None, model: nn.Module, tokenizer_path: str | None):
    import peft

    common: dict[str, Any] = {"task_type": _task_type(kind)}
    if kind == "classification":
        common["modules_to_save"] = head_modules(model, spec) or None
    m = opts.method
    if m == "lora":
        targets = opts.target_modules or (list(spec.qkv) if spec else None)
        if not targets:
            raise ValueError("peft.target_modules must be given for this architecture")
        return peft.LoraConfig(r=opts.r, lora_alpha=opts.alpha, lora_dropout=opts.dropout,
                               target_modules=targets, **common)
    if m == "ia3":
        kw = {}
        if opts.target_modules:
            kw["target_modules"] = opts.target_modules
            kw["feedforward_modules"] = opts.feedforward_modules or []
        elif (spec is not None and len(spec.qkv) == 3
              and model.config.model_type not in peft.utils.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING):
            # peft has no default for this architecture (e.g. DistilBERT): key, value and the feed-forward
            # output, IA3's original choice (peft's own defaults vary by architecture)
            kw["target_modules"] = [spec.qkv[1], spec.qkv[2], spec.ffn_out]
            kw["feedforward_modules"] = [spec.ffn_out]
        return peft.IA3Config(**kw, **common)
    common.update(_prompt_dims(model.config))
    if m == "prompt_tuning":
        kw = {}
        if opts.init_text:
            kw = {"prompt_tuning_init": peft.PromptTuningInit.TEXT, "prompt_tuning_init_text": opts.init_text,
                      "tokenizer_name_or_path": tokenizer_path}
        return peft.PromptTuningConfig(num_virtual_tokens=opts.num_virtual_tokens, **kw, **common)
    if m == "p_tuning":
        enc = {"mlp": peft.PromptEncoderReparameterizationType.MLP,
               "lstm": peft.PromptEncoderReparameterizationType.LSTM}[opts.encoder_type]
        return peft.PromptEncoderConfig(num_virtual_tokens=opts.num_virtual_tokens, encoder_reparameterization_type=enc,
                                        encoder_hidden_size=opts.encoder_hidden_size, **common)
    if m == "prefix_tuning":
        return peft.PrefixTuningConfig(num_virtual_tokens=opts.num_virtual_tokens, prefix_projection=opts.projection,
                                       encoder_hidden_size=opts.encoder_hidden_size, **common)
    raise ValueError(f"{m!r} is not a peft-backed method")


def _prompt_dims(config) -> dict[str, int]:
    """Width, depth and heads for peft's prompt methods where peft cannot find them in the config dict under
    the names it knows (DistilBERT calls them dim, n_layers, n_heads)."""
    from fedpeft.models.layout import model_shape

    known = config.to_dict()
    shape = model_shape(config)
    out = {}
    if not any(known.get(n) for n in ("hidden_size", "n_embd", "d_model")):
        out["token_dim"] = shape.hidden
    if not any(known.get(n) for n in ("num_hidden_layers", "num_layers", "n_layer")):
        out["num_layers"] = shape.num_layers
    if not any(known.get(n) for n in ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")):
        out["num_attention_heads"] = shape.num_heads
    return out


def _set_trainable_heads(model: nn.Module, spec: ArchSpec | None) -> None:
    for h in head_modules(model, spec):
        for p in getattr(model, h).parameters():
            p.requires_grad_(True)


def apply_tuner(model: nn.Module, opts: Any, kind: str, *, tokenizer_path: str | None = None,
                tokenizer: Any = None) -> TunedModel:
    """Wrap ``model`` with the PEFT method described by ``opts`` (a registered schema.PeftOptions). ``tokenizer``
    is needed for prefix tuning's ``init_text``."""
    spec = None
    try:
        spec = arch_spec(model.config.model_type)
    except ValueError:
        if opts.method in ("houlsby", "pfeiffer") or (opts.method == "lora" and not opts.target_modules):
            raise
    options = opts.model_dump(mode="json")
    if (opts.method in ("prompt_tuning", "p_tuning", "prefix_tuning") and kind == "classification"
            and getattr(model.config, "is_encoder_decoder", False)):
        raise ValueError(
            f"{opts.method} cannot drive {type(model).__name__}: transformers' encoder-decoder classifiers take no "
            "prompt embeddings or prefixes. Use task.type generation (seq2seq) or lora / ia3 / adapters"
        )
    if opts.method in PEFT_METHODS:
        import peft

        wrapped = peft.get_peft_model(model, _peft_config(opts, kind, spec, model, tokenizer_path))
        if opts.method == "prefix_tuning" and opts.init_text:
            from fedpeft.tuners.prefix_init import init_prefix_from_text

            if tokenizer is None:
                raise ValueError("peft.init_text needs the model's tokenizer (pass tokenizer= to apply_tuner)")
            init_prefix_from_text(wrapped, tokenizer, opts.init_text)
        return TunedModel(wrapped, opts.method, options, True, kind)
    for p in model.parameters():
        p.requires_grad_(opts.method == "full")
    if opts.method == "bitfit":
        biases = [p for n, p in model.named_parameters() if n.endswith(".bias") or n == "bias"]
        if not biases:
            raise ValueError(f"bitfit: {model.config.model_type!r} has no bias parameters; choose another peft method")
        for p in biases:
            p.requires_grad_(True)
    elif opts.method in ("houlsby", "pfeiffer"):
        assert spec is not None
        add_bottleneck_adapters(model, spec, opts.method, reduction_factor=opts.reduction_factor,
                                bottleneck_size=opts.bottleneck_size, non_linearity=opts.non_linearity,
                                init_std=opts.init_std)
    elif opts.method != "full":
        raise ValueError(f"unknown peft method {opts.method!r}")
    if kind == "classification":
        _set_trainable_heads(model, spec)
    return TunedModel(model, opts.method, options, False, kind)


def method_options(method: str, **kwargs: Any):
    """Build the validated option object of a method by name (handy outside a full RunConfig)."""
    return S.options_for("peft", method).model_validate({"method": method, **kwargs})
