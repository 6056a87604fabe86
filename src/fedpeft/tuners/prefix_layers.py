"""Per-layer views of deep prompts (prefix tuning / P-tuning v2), for methods that exchange some layers.

HF peft's prefix tuning without the reparametrisation MLP keeps one trainable embedding of shape
(num_virtual_tokens, num_layers * 2 * D): peft reshapes it to (batch, tokens, 2 * layers, heads,
head_dim) and hands consecutive pairs of the 2 * layers axis to the layers as (key, value) prefixes,
so layer l owns the columns [l * 2 * D, (l + 1) * 2 * D) (D = key/value heads x head dim, so grouped
key/value heads are covered). ``tests/test_prefix_layers.py`` checks this against peft's own
``get_prompt`` on a BERT and a LLaMA model with grouped key/value heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedpeft.config.schema import options_for, peft_methods_with

PREFIX_PARAM_SUFFIX = "prompt_encoder.default.embedding.weight"


@dataclass(frozen=True)
class PrefixLayout:
    name: str  # the trainable parameter holding every layer's prefix
    num_layers: int
    width: int  # columns per layer: 2 * D

    def columns(self, layer: int) -> slice:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is not in [0, {self.num_layers})")
        return slice(layer * self.width, (layer + 1) * self.width)

    def split(self, prefix: np.ndarray, layers: list[int] | None = None) -> dict[int, np.ndarray]:
        """layer -> its (num_virtual_tokens, width) block (copies), for ``layers`` or all."""
        chosen = range(self.num_layers) if layers is None else layers
        return {l: np.array(prefix[:, self.columns(l)]) for l in chosen}

    def merge(self, prefix: np.ndarray, blocks: Mapping[int, np.ndarray]) -> np.ndarray:
        """A copy of ``prefix`` with the given layers' blocks written in."""
        out = np.array(prefix)
        for layer, block in blocks.items():
            out[:, self.columns(layer)] = block
        return out


def prefix_layout(tuned, model_config: object = None) -> PrefixLayout:
    """The per-layer layout of a TunedModel whose method trains a prompt per layer (its options'
    ``layer_prefixes``; prefix tuning) with projection off (a ``fedpeft.RuntimeNeeds.layout`` builder: the
    model's own config is read, ``model_config`` is not needed)."""
    if not options_for("peft", tuned.method).layer_prefixes or tuned.options.get("projection"):
        raise ValueError(f"per-layer prompts need peft.method {' or '.join(peft_methods_with('layer_prefixes'))} "
                         "with projection: false")
    config = tuned.module.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("per-layer prompts are mapped for encoder-only and decoder-only models; "
                         f"{config.model_type} is an encoder-decoder: choose another model or algorithm")
    names = [n for n in tuned.params if n.endswith(PREFIX_PARAM_SUFFIX)]
    if len(names) != 1:
        raise ValueError(f"expected one prefix embedding named *{PREFIX_PARAM_SUFFIX}, found {names}")
    layers = int(tuned.module.peft_config["default"].num_layers)
    cols = int(tuned.params[names[0]].shape[1])
    if cols % layers:
        raise ValueError(f"prefix width {cols} is not a multiple of the {layers} layers")
    return PrefixLayout(names[0], layers, cols // layers)
