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
An adapter is data: loading one never imports code it names. A method registered by a plugin needs that
plugin loaded first: named by the caller (``plugins=``, ``--plugin``), installed (the ``fedpeft.plugins``
entry points), or, with ``trust_plugins=True`` (``--trust-plugins``), the run's plugins the json lists
(``plugins``); otherwise the adapter is refused naming the plugin and both ways. Weights are read from
safetensors files only: a pickle-based file (``.bin``, ``.pt``, ...) can run code when loaded and is refused.

Before anything loads, the directory is verified: ``fedpeft_adapter.json`` holds the SHA-256 of every other
file and its own (``files``, ``sha256``; fedpeft.integrity), every JSON and safetensors file must be among
those, every safetensors file must read and hold finite values only, and a PEFT-format adapter must hold
exactly the tensors its method's model has. A damaged adapter is refused with a one-line :class:`AdapterError`
naming the file. An adapter without its seal (saved before seals, or stripped of them) is refused unless the
caller opts in (``allow_unsealed=True``, ``--allow-unsealed``); the other checks still apply.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedpeft.errors import UserError
from fedpeft.integrity import seal_matches, sha256_file, unsealed_refusal
from fedpeft.models import registry
from fedpeft.tuners import StateError, apply_tuner, method_options, registered_peft_method
from fedpeft.tuners.tuned import FEDPEFT_ADAPTER_CONFIG, FEDPEFT_ADAPTER_FILE

log = logging.getLogger("fedpeft")
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
# per save format: the files an adapter cannot load without (any one of each group)
REQUIRED_FILES = {
    "peft": [(PEFT_CONFIG,), (PEFT_WEIGHTS,)],
    "state": [(FEDPEFT_ADAPTER_FILE,)],
    "model": [("config.json",), ("model.safetensors", "model.safetensors.index.json")],
}
# weights in pickle-based formats: loading one can run code, so an adapter directory holding one is refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SEALED_SUFFIXES = (".json", ".safetensors")  # what a loader reads: each must be among the sealed files
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


def read_adapter_meta(directory: str | Path, *, allow_unsealed: bool = False) -> dict[str, Any]:
    """``fedpeft_adapter.json``, checked against its own SHA-256 (AdapterError if it is damaged, or carries no
    seal or no file digests and ``allow_unsealed`` is off)."""
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
    missing = [key for key in ("sha256", "files") if key not in meta]
    if missing and not allow_unsealed:
        raise AdapterError(unsealed_refusal(path, f"no {' or '.join(repr(k) for k in missing)}"))
    if "sha256" in meta and not seal_matches(data, meta["sha256"]):
        raise damaged(directory, f"{path} does not match its SHA-256 (damaged or edited since the run saved it)")
    if missing:
        log.warning("%s records no %s (allowed by allow_unsealed): its files cannot all be verified", path,
                    " or ".join(missing))
    for key in ("method", "kind"):
        if not isinstance(meta.get(key), str):
            raise damaged(directory, f"{path} lacks {key!r}")
    return meta


def load_method(directory: Path, method: str, listed: Any, plugins: Sequence[str], trusted: bool) -> None:
    """Register ``method`` for loading the adapter in ``directory``: the installed plugins and the caller's
    ``plugins``, and, when ``trusted``, the plugins the adapter lists (``listed``); an AdapterError naming the
    plugins and both ways to load them when the method is still unknown."""
    from fedpeft.plugins import load_plugins, resolve_plugin, untrusted_hint
    from fedpeft.tuners import PEFT_METHODS

    if isinstance(plugins, str):
        raise AdapterError(f"plugins={plugins!r}: give a list of plugins, e.g. plugins=[{plugins!r}]")
    load_plugins([resolve_plugin(x) for x in plugins])
    if method in PEFT_METHODS:
        return
    # as a run's config keeps them: resolved, a relative one from the adapter's directory
    specs = [resolve_plugin(x, directory) for x in listed if isinstance(x, str)] if isinstance(listed, list) else []
    if specs and trusted:
        load_plugins(specs)
        if method in PEFT_METHODS:
            return
    where = directory / FEDPEFT_ADAPTER_CONFIG
    if specs and not trusted:
        raise AdapterError(f"{where}: PEFT method {method!r} is not registered; {untrusted_hint(specs, 'the adapter')}")
    raise AdapterError(f"{where}: PEFT method {method!r} is not registered{' by its plugins' if specs else ''}; load "
                       f"the plugin that registers it (--plugin FILE_OR_MODULE, or plugins=[...] in Python); "
                       f"registered: {', '.join(PEFT_METHODS)}")


def verify_files(directory: Path, meta: dict[str, Any], save_format: str) -> None:
    """Every file fedpeft_adapter.json lists is there with its SHA-256, and the format's files are there."""
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(d, str) for d in files.values()):
        raise damaged(directory, f"{directory / FEDPEFT_ADAPTER_CONFIG}: 'files' is not a mapping of names to digests")
    present = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != FEDPEFT_ADAPTER_CONFIG)
    pickled = [p for p in present if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickled:
        raise AdapterError(f"{pickled[0]}: a pickle-based weights file, which can run code when loaded; fedpeft reads "
                           "adapters from safetensors files only (and saves them so): remove it, or convert it to "
                           "safetensors where you trust it (safetensors.torch.save_file)")
    if "files" in meta:
        unsealed_files = [p for p in present if p.suffix.lower() in SEALED_SUFFIXES
                          and p.relative_to(directory).as_posix() not in files]
        if unsealed_files:
            raise damaged(directory, f"{unsealed_files[0]} is not among the files {FEDPEFT_ADAPTER_CONFIG} records "
                                     "(added or renamed since the run saved the adapter)")
    for name, digest in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise damaged(directory, f"{directory / FEDPEFT_ADAPTER_CONFIG}: 'files' names {name!r}, outside the "
                                     "adapter directory")
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
                 device: str | torch.device = "cpu", plugins: Sequence[str] = (), trust_plugins: bool = False,
                 allow_unsealed: bool = False) -> LoadedAdapter:
    """The model an adapter directory describes, ready for inference. ``base_model`` overrides the backbone
    named in fedpeft_adapter.json (e.g. a local copy of the same weights). ``plugins``: plugins to load first
    (.py files or modules, e.g. the one registering the adapter's method); ``trust_plugins``: also import the
    plugins the adapter lists (they are code; off by default); ``allow_unsealed``: accept an adapter saved
    without checksums (by a fedpeft from before seals)."""
    directory = Path(directory)
    meta = read_adapter_meta(directory, allow_unsealed=allow_unsealed)
    if meta.get("incomplete"):
        raise StateError(f"{str(directory)!r} is not the run's model: {meta['incomplete']}")
    method, kind = meta["method"], meta["kind"]
    load_method(directory, method, meta.get("plugins"), plugins, trust_plugins)
    save_format = meta.get("save_format") or registered_peft_method(method).save_format
    if save_format not in REQUIRED_FILES:
        raise damaged(directory, f"{directory / FEDPEFT_ADAPTER_CONFIG}: unknown save_format {save_format!r} (one of "
                                 f"{', '.join(REQUIRED_FILES)})")
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
