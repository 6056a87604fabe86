"""What the PEFT methods HF peft provides share: LoRA, IA3, prompt tuning, P-tuning and prefix tuning.

Each of those methods' packages (``fedpeft/tuners/<method>/apply.py``) builds its peft config from fedpeft's
options with :func:`config_kwargs` (or :func:`prompt_config_kwargs`) and wraps the backbone with
:func:`wrap` (``peft.get_peft_model``); a classifier's task head goes into peft's ``modules_to_save`` (so it
trains and is saved in the adapter). They register with ``save_format="peft"``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fedpeft.models.layout import is_image_model, model_shape
from fedpeft.tuners.registry import TunerContext


def task_type(kind: str):
    from peft import TaskType

    return {"classification": TaskType.SEQ_CLS, "causal": TaskType.CAUSAL_LM, "seq2seq": TaskType.SEQ_2_SEQ_LM}[kind]


def config_kwargs(model: nn.Module, ctx: TunerContext) -> dict[str, Any]:
    # an image classifier: peft's plain wrapper, which passes the batch on as it is (its sequence-classification
    # wrapper adds text arguments, e.g. attention_mask=None, that Swin's layers take as a second mask)
    kind = None if is_image_model(model.config) else task_type(ctx.kind)
    common: dict[str, Any] = {"task_type": kind}
    if ctx.kind == "classification":
        common["modules_to_save"] = list(ctx.head_modules) or None
    return common


def wrap(model: nn.Module, config) -> nn.Module:
    import peft

    return peft.get_peft_model(model, config)


def prompt_config_kwargs(model: nn.Module, method: str, ctx: TunerContext) -> dict[str, Any]:
    """The shared part of the prompt methods' configs; refuses the classifiers that take no prompts."""
    if getattr(model.config, "vocab_size", None) is None or is_image_model(model.config):  # BEiT: visual tokens
        raise ValueError(f"{method} cannot drive {type(model).__name__}: peft's prompt methods feed virtual tokens or "
                         "key/value prefixes to a text model, and this model takes no tokens. Use a method that "
                         "adapts its layers (lora, ia3, adapters, bitfit, full)")
    if ctx.kind == "classification" and getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{method} cannot drive {type(model).__name__}: transformers' encoder-decoder classifiers take no "
            "prompt embeddings or prefixes. Use task.type generation (seq2seq) or lora / ia3 / adapters"
        )
    return {**config_kwargs(model, ctx), **prompt_dims(model.config)}


def prompt_dims(config) -> dict[str, int]:
    """Width, depth and heads for peft's prompt methods where peft cannot find them in the config dict under
    the names it knows (DistilBERT calls them dim, n_layers, n_heads)."""
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


