"""Architecture configs of the papers' backbones, bundled without weights, and models built from a config
on PyTorch's meta device (shapes only, no memory for values) for accounting: trainable parameters,
upload size and analytic OPs of any PEFT method on any backbone, offline (``fedpeft model NAME``).

The bundled configs (``architectures.json``) are the network-shaping fields of each model's published
``config.json``; a name is found by its Hub id (``google-t5/t5-small``) or a short alias (``t5-small``).
Any other name goes through :func:`fedpeft.models.registry.load_config` (bundled aliases with weights,
local directories, Hub ids).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES_FILE = Path(__file__).with_name("architectures.json")


@lru_cache(maxsize=1)
def bundled_architectures() -> dict[str, dict[str, Any]]:
    """Hub id -> {"aliases": [...], "papers": [...], "config": {...}}."""
    entries = json.loads(ARCHITECTURES_FILE.read_text())
    return {k: v for k, v in entries.items() if not k.startswith("_")}


def bundled_id(name: str) -> str | None:
    """The Hub id of a bundled architecture named by its id or an alias (case-insensitive), else None."""
    wanted = name.lower()
    for hub_id, entry in bundled_architectures().items():
        if wanted == hub_id.lower() or wanted in (a.lower() for a in entry["aliases"]):
            return hub_id
    return None


def architecture_config(name: str):
    """A transformers config for ``name``: a bundled architecture, else whatever the registry resolves."""
    hub_id = None if Path(name).expanduser().is_dir() else bundled_id(name)  # a local directory wins
    if hub_id is None:
        from fedpeft.models import registry

        try:
            return registry.load_config(name)
        except registry.ModelError as exc:
            names = ", ".join(a for e in bundled_architectures().values() for a in e["aliases"][:1])
            raise registry.ModelError(f"{exc}; bundled architecture configs (no weights): {names}") from None
    from transformers import AutoConfig

    fields = dict(bundled_architectures()[hub_id]["config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_on_meta(config, kind: str, num_labels: int | None = None) -> torch.nn.Module:
    """The backbone of ``kind`` (classification / causal / seq2seq) from ``config``, on the meta device (an image
    classifier for a vision transformer's config)."""
    import copy

    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    from fedpeft.models.layout import is_image_model

    transformers.logging.set_verbosity_error()
    auto = {"classification": AutoModelForSequenceClassification, "causal": AutoModelForCausalLM,
            "seq2seq": AutoModelForSeq2SeqLM}[kind]
    if kind == "classification" and is_image_model(config):
        from transformers import AutoModelForImageClassification

        auto = AutoModelForImageClassification
    config = copy.deepcopy(config)
    if kind == "classification":
        config.num_labels = num_labels or 2
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.float32)
