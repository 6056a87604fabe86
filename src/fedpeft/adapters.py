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

Before anything loads, the directory is verified: ``fedpeft_adapter.json`` holds the SHA-256 of every other
file and its own (``files``, ``sha256``; fedpeft.integrity), every safetensors file must read and hold finite
values only, and a PEFT-format adapter must hold exactly the tensors its method's model has. A damaged
adapter is refused with a one-line :class:`AdapterError` naming the file. Adapters saved before the
checksums were recorded are loaded with a warning (the other checks still apply).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedpeft.errors import UserError
from fedpeft.integrity import seal_matches, sha256_file
from fedpeft.models import registry
from fedpeft.tuners import StateError, apply_tuner, method_options, registered_peft_method
from fedpeft.tuners.tuned import FEDPEFT_ADAPTER_CONFIG, FEDPEFT_ADAPTER_FILE

log = logging.getLogger("fedpeft")
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
# per save format: the files an adapter cannot load without (any one of each group)
REQUIRED_FILES = {
    "peft": [(PEFT_CONFIG,), (PEFT_WEIGHTS, "adapter_model.bin")],
    "state": [(FEDPEFT_ADAPTER_FILE,)],
    "model": [("config.json",), ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                 "pytorch_model.bin.index.json")],
}
LOAD_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, OSError)  # what a damaged directory makes HF raise


class AdapterError(UserError, ValueError):
    """An adapter directory that is damaged, incomplete or does not match its checksums."""


@dataclass
class LoadedAdapter:
    model: torch.nn.Module  # the backbone with the adapter applied, in eval mode
    tokenizer: Any
    meta: dict[str, Any]  # fedpeft_adapter.json


def damaged(directory: Path, problem: str) -> AdapterError:
    return AdapterError(f"{problem}; the adapter in {directory} cannot be used: restore the directory from a copy, "
                        "or use the run's other adapter (fedpeft eval --adapter best|last)")


def _first_line(exc: BaseException) -> str:
    """The telling line of a library's error (e.g. torch's "size mismatch for ..." under its heading)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    telling = next((line for line in lines if "mismatch" in line or "Missing" in line), lines[0])
    return f"{type(exc).__name__}: {telling[:200]}"


def read_adapter_meta(directory: str | Path) -> dict[str, Any]:
    """``fedpeft_adapter.json``, checked against its own SHA-256 (AdapterError if it is damaged)."""
    directory = Path(directory)
    path = directory / FEDPEFT_ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a fedpeft adapter directory (no {FEDPEFT_ADAPTER_CONFIG}); "
                                "point at RUN_DIR/adapter or RUN_DIR/best_adapter")
    data = path.read_bytes()
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise damaged(directory, f"{path} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise damaged(directory, f"{path} is not a JSON object")
    if "sha256" in meta:
        if not seal_matches(data, meta["sha256"]):
            raise damaged(directory, f"{path} does not match its SHA-256 (damaged or edited since the run saved it)")
    else:
        log.warning("%s records no checksums (saved by an older fedpeft): its files cannot be verified", path)
    for key in ("method", "kind"):
        if not isinstance(meta.get(key), str):
            raise damaged(directory, f"{path} lacks {key!r}")
    return meta


def verify_files(directory: Path, meta: dict[str, Any], save_format: str) -> None:
    """Every file fedpeft_adapter.json lists is there with its SHA-256, and the format's files are there."""
    files = meta.get("files", {})
    if not isinstance(files, dict):
        raise damaged(directory, f"{directory / FEDPEFT_ADAPTER_CONFIG}: 'files' is not a mapping")
    for name, digest in files.items():
        path = directory / name
        if not path.is_file():
            raise damaged(directory, f"{path} is missing")
        if sha256_file(path) != digest:
            raise damaged(directory, f"{path} does not match the SHA-256 recorded in {FEDPEFT_ADAPTER_CONFIG} (damaged "
                                     "or changed since the run saved it)")
    for choices in REQUIRED_FILES.get(save_format, []):
        if not any((directory / name).is_file() for name in choices):
            raise damaged(directory, f"{directory / choices[0]} is missing")
    if save_format == "peft":
        try:
            json.loads((directory / PEFT_CONFIG).read_bytes())
        except (UnicodeDecodeError, ValueError) as exc:
            raise damaged(directory, f"{directory / PEFT_CONFIG} is not valid JSON ({exc})") from None


def scan_tensors(directory: Path, path: Path) -> list[str]:
    """The tensor names of a safetensors file, after checking that it reads and holds finite values only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            names = list(weights.keys())
            nonfinite = [n for n in names if _nonfinite(weights.get_tensor(n))]
    except (SafetensorError, *LOAD_ERRORS) as exc:
        raise damaged(directory, f"{path} is not a readable safetensors file ({_first_line(exc)})") from None
    if nonfinite:
        raise damaged(directory, f"{path}: tensor {nonfinite[0]!r} holds NaN or infinite values "
                                 f"({len(nonfinite)} tensor(s))")
    return names


def _nonfinite(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


def check_peft_tensors(directory: Path, model: Any, saved: list[str]) -> None:
    """A PEFT-format file holds exactly the tensors of its method's model (PEFT fills a missing one with
    its initial value, and ignores one it does not know, without an error)."""
    from peft import get_peft_model_state_dict

    expected, found = set(get_peft_model_state_dict(model)), set(saved)
    missing, unknown = sorted(expected - found), sorted(found - expected)
    path = directory / PEFT_WEIGHTS
    if missing:
        raise damaged(directory, f"{path} lacks {len(missing)} of the adapter's {len(expected)} tensors (e.g. "
                                 f"{missing[0]!r}): it is incomplete")
    if unknown:
        raise damaged(directory, f"{path} holds {len(unknown)} tensor(s) this adapter's model does not have (e.g. "
                                 f"{unknown[0]!r}): it belongs to another model or method")


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
    verify_files(directory, meta, save_format)
    tensors = {p.name: scan_tensors(directory, p) for p in sorted(directory.glob("*.safetensors"))}
    name = base_model or meta.get("base_model")
    if not isinstance(name, str):
        raise damaged(directory, f"{directory / FEDPEFT_ADAPTER_CONFIG} lacks 'base_model' (or pass base_model=)")
    tokenizer = registry.load_tokenizer(name)
    num_labels = meta.get("num_labels") if kind == "classification" else None
    if save_format == "model":
        try:
            model = registry.load_model(str(directory), kind, num_labels=num_labels, dtype=dtype, tokenizer=tokenizer)
        except LOAD_ERRORS as exc:
            raise damaged(directory, f"{directory} does not load as a model ({_first_line(exc)})") from None
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

            try:
                model = PeftModel.from_pretrained(base, directory)
            except LOAD_ERRORS as exc:
                raise damaged(directory, f"{directory} does not load onto {name} ({_first_line(exc)})") from None
            if PEFT_WEIGHTS in tensors:
                check_peft_tensors(directory, model, tensors[PEFT_WEIGHTS])
        else:
            options = {k: v for k, v in meta.get("options", {}).items() if k != "method"}
            tuned = apply_tuner(base, method_options(method, **options), kind)
            from safetensors.numpy import load_file

            weights = directory / FEDPEFT_ADAPTER_FILE
            try:
                tuned.load_state(load_file(str(weights)))
            except StateError as exc:
                raise damaged(directory, f"{weights} does not fit {method} on {name} ({exc})") from None
            model = tuned.module
    if meta.get("quantization"):  # the quantized backbone was loaded onto the device; the method's tensors follow
        registry.place_on(model, torch.device(device))
    else:
        model.to(device)
    model.eval()
    return LoadedAdapter(model, tokenizer, meta)
