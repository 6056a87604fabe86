"""Prefix tuning initialised from a real text (Li & Liang 2021, Sec. 7.2: "activations of real words").

peft starts prefix tuning's key/value prefixes from N(0, 1) values, which on a pretrained decoder act
as arbitrary extra tokens: 40 of them take SmolLM2-135M from 0.425 (no prompts) to 0.260 on 200 ARC-Easy
questions, chance level (``python benchmarks/paper003.py init``). With ``peft.init_text`` each layer's
prefix is instead the keys and values the frozen model computes for that text, so before training the
prefixed model is the model with the text prepended (tested to the logit). The layout is the one of
:mod:`fedpeft.tuners.prefix_layers`: layer l owns columns [2lD, 2(l+1)D), keys first, then values,
each (tokens, key/value heads x head dim).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def text_token_ids(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    """The ids the prefix is computed from: the tokenizer's leading BOS if it adds one, then the text's own tokens,
    repeated up to or cut to ``num_tokens`` in all (as peft's prompt-tuning text init); no trailing specials."""
    from fedpeft.data.features import leading_special_ids

    lead = leading_special_ids(tokenizer)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("peft.init_text is empty after tokenization; give a few words")
    room = max(num_tokens - len(lead), 0)
    return (lead + (ids * (room // len(ids) + 1))[:room])[:num_tokens]


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    entry = (layers[layer].keys, layers[layer].values) if layers is not None else tuple(cache[layer])
    if len(entry) != 2 or any(t is None for t in entry):
        raise ValueError("peft.init_text for prefix_tuning needs a decoder-only model with one key and one value "
                         "tensor per layer in its cache; leave init_text unset for this model")
    return entry[0], entry[1]


def prefix_from_text(model: nn.Module, tokenizer: Any, text: str, num_tokens: int, num_layers: int) -> torch.Tensor:
    """The (num_tokens, num_layers * 2 * D) prefix embedding holding the frozen model's keys and values for the
    text, in peft's layout. ``model`` is the backbone (a causal LM that returns a key/value cache)."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"peft.init_text for prefix_tuning needs a decoder-only model; {type(model).__name__} is an "
                         "encoder-decoder. Leave init_text unset for this model")
    ids = torch.tensor([text_token_ids(tokenizer, text, num_tokens)], device=next(model.parameters()).device)
    training = model.training
    model.eval()  # no dropout: the prefix is the frozen model's deterministic keys/values
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    finally:
        model.train(training)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise ValueError(f"peft.init_text for prefix_tuning needs a decoder that returns its key/value cache; "
                         f"{type(model).__name__} returns none. Leave init_text unset for this model")
    blocks = []
    for layer in range(num_layers):
        for t in _layer_kv(cache, layer):  # (1, kv_heads, tokens, head_dim) -> (tokens, kv_heads * head_dim)
            blocks.append(t[0].transpose(0, 1).reshape(num_tokens, -1))
    return torch.cat(blocks, dim=1).float()


def init_prefix_from_text(tuned_module: Any, tokenizer: Any, text: str) -> None:
    """Overwrite a peft prefix-tuning model's prefix embedding (no projection) with the text's keys/values."""
    config = tuned_module.peft_config["default"]
    if config.prefix_projection:
        raise ValueError("peft.init_text for prefix_tuning sets the prefixes themselves; use projection: false")
    weight = tuned_module.prompt_encoder["default"].embedding.weight
    value = prefix_from_text(tuned_module.get_base_model(), tokenizer, text, int(config.num_virtual_tokens),
                             int(config.num_layers))
    if tuple(value.shape) != tuple(weight.shape):
        raise ValueError(f"the text's keys/values have shape {tuple(value.shape)}, the prefix {tuple(weight.shape)}")
    with torch.no_grad():
        weight.copy_(value.to(weight.dtype))
