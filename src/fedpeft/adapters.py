"""Loading a run's adapter (RUN_DIR/adapter or RUN_DIR/best_adapter) back onto its backbone, outside a run.

Every adapter directory holds ``fedpeft_adapter.json`` (method, options, save format, base model, task head
kind, labels, seed) next to the weights, in the save format its PEFT method registered
(``fedpeft.register_peft_method``):

* "peft" (LoRA, IA3, prompt tuning, P-tuning, prefix tuning): HF PEFT format (``adapter_config.json`` +
  ``adapter_model.safetensors``, classifier head included): loaded with ``peft.PeftModel.from_pretrained``.
* "model" (full fine-tuning): a complete HF model directory.
* "state" (bottleneck adapters, BitFit, a plugin's method by default): ``fedpeft_adapter.safetensors``, the
  trainable tensors under their parameter names in the tuned model; loading applies the registered method
  to a fresh backbone (which inserts its modules, e.g. the bottleneck adapters) and writes them in. BitFit's
  names are the backbone's own, so plain ``model.load_state_dict(tensors, strict=False)`` restores it too.
A method registered by a plugin is found again through the run's plugins, which the json lists (``plugins``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedpeft.models import registry
from fedpeft.tuners import StateError, apply_tuner, method_options, registered_peft_method
from fedpeft.tuners.tuned import FEDPEFT_ADAPTER_CONFIG, FEDPEFT_ADAPTER_FILE


@dataclass
class LoadedAdapter:
    model: torch.nn.Module  # the backbone with the adapter applied, in eval mode
    tokenizer: Any
    meta: dict[str, Any]  # fedpeft_adapter.json


def read_adapter_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / FEDPEFT_ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a fedpeft adapter directory (no {FEDPEFT_ADAPTER_CONFIG}); "
                                "point at RUN_DIR/adapter or RUN_DIR/best_adapter")
    return json.loads(path.read_text(encoding="utf-8"))


def load_adapter(directory: str | Path, *, base_model: str | None = None, dtype: str = "float32",
                 device: str | torch.device = "cpu") -> LoadedAdapter:
    """The model an adapter directory describes, ready for inference. ``base_model`` overrides the backbone
    named in fedpeft_adapter.json (e.g. a local copy of the same weights)."""
    directory = Path(directory)
    meta = read_adapter_meta(directory)
    if meta.get("incomplete"):
        raise StateError(f"{str(directory)!r} is not the run's model: {meta['incomplete']}")
    method, kind = meta["method"], meta["kind"]
    from fedpeft.plugins import load_installed_plugins, load_plugins
    from fedpeft.tuners import PEFT_METHODS

    load_installed_plugins()
    if method not in PEFT_METHODS and meta.get("plugins"):  # the run's plugins, one of which registers it
        load_plugins(meta["plugins"])
    save_format = meta.get("save_format") or registered_peft_method(method).save_format
    name = base_model or meta["base_model"]
    tokenizer = registry.load_tokenizer(name)
    num_labels = meta.get("num_labels") if kind == "classification" else None
    if save_format == "model":
        model = registry.load_model(str(directory), kind, num_labels=num_labels, dtype=dtype, tokenizer=tokenizer)
    else:
        quantization = None
        if meta.get("quantization"):  # onto the quantized backbone the run trained over
            from fedpeft.config.schema import QuantizationOptions

            quantization = QuantizationOptions.model_validate(meta["quantization"])
        base = registry.load_model(name, kind, num_labels=num_labels, dtype=dtype, tokenizer=tokenizer,
                                   seed=int(meta.get("seed", 0)), attn_implementation=meta.get("attn_implementation"),
                                   quantization=quantization, device=str(device))
        if quantization is not None:  # as the run prepared it: the full-precision parts in float32
            from peft import prepare_model_for_kbit_training

            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        if save_format == "peft":
            from peft import PeftModel

            model = PeftModel.from_pretrained(base, directory)
        else:
            options = {k: v for k, v in meta.get("options", {}).items() if k != "method"}
            tuned = apply_tuner(base, method_options(method, **options), kind)
            from safetensors.numpy import load_file

            weights = directory / FEDPEFT_ADAPTER_FILE
            if not weights.is_file():
                raise StateError(f"{str(directory)!r} has no {FEDPEFT_ADAPTER_FILE} for its {method} weights")
            tuned.load_state(load_file(str(weights)))
            model = tuned.module
    if meta.get("quantization"):  # the quantized backbone was loaded onto the device; the method's tensors follow
        registry.place_on(model, torch.device(device))
    else:
        model.to(device)
    model.eval()
    return LoadedAdapter(model, tokenizer, meta)
