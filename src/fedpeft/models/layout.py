"""Where things are inside each supported architecture.

One table row per ``model_type``: the attention query/key/value projection names (default LoRA
targets), the attention output projection and the feed-forward output projection (where bottleneck
adapters go), the task-head module names, and how to read depth / heads / width from the config.
Adding an architecture means adding one row here.
"""

from __future__ import annotations

from dataclasses import dataclass

TASK_HEADS = ("classifier", "score", "classification_head")  # transformers' names of sequence-classifier heads


@dataclass(frozen=True)
class ArchSpec:
    qkv: tuple[str, ...]  # module-name suffixes of the query/key/value projections
    attn_out: tuple[str, ...]  # suffixes of attention output projections (self and cross attention)
    ffn_out: str  # suffix of the feed-forward output projection
    heads: tuple[str, ...] = TASK_HEADS
    ffn_out_excludes: tuple[str, ...] = ()


ARCHITECTURES: dict[str, ArchSpec] = {
    # BertSelfOutput.dense and BertOutput.dense both end with "output.dense"
    "bert": ArchSpec(("query", "key", "value"), ("attention.output.dense",), "output.dense",
                     ffn_out_excludes=("attention.output.dense",)),
    "roberta": ArchSpec(("query", "key", "value"), ("attention.output.dense",), "output.dense",
                        ffn_out_excludes=("attention.output.dense",)),
    "distilbert": ArchSpec(("q_lin", "k_lin", "v_lin"), ("attention.out_lin",), "ffn.lin2"),
    "gpt2": ArchSpec(("c_attn",), ("attn.c_proj",), "mlp.c_proj"),
    "llama": ArchSpec(("q_proj", "k_proj", "v_proj"), ("self_attn.o_proj",), "mlp.down_proj"),
    "mistral": ArchSpec(("q_proj", "k_proj", "v_proj"), ("self_attn.o_proj",), "mlp.down_proj"),
    "qwen2": ArchSpec(("q_proj", "k_proj", "v_proj"), ("self_attn.o_proj",), "mlp.down_proj"),
    "t5": ArchSpec(("q", "k", "v"), ("SelfAttention.o", "EncDecAttention.o"), "DenseReluDense.wo"),
    "opt": ArchSpec(("q_proj", "k_proj", "v_proj"), ("self_attn.out_proj",), "fc2"),
    "bart": ArchSpec(("q_proj", "k_proj", "v_proj"), ("self_attn.out_proj", "encoder_attn.out_proj"), "fc2"),
    # vision: transformers 5's ViT, DeiT and BEiT (their attention's q/k/v/o_proj, their MLP's fc1/fc2)
    "vit": ArchSpec(("q_proj", "k_proj", "v_proj"), ("attention.o_proj",), "mlp.fc2"),
    "deit": ArchSpec(("q_proj", "k_proj", "v_proj"), ("attention.o_proj",), "mlp.fc2"),
    "beit": ArchSpec(("q_proj", "k_proj", "v_proj"), ("attention.o_proj",), "mlp.fc2"),
    "swin": ArchSpec(("q_proj", "k_proj", "v_proj"), ("attention.o_proj",), "mlp.fc2"),
    # ConvNeXt has no attention: LoRA's default targets are each block's two pointwise (linear) layers, and only
    # the feed-forward output (pwconv2) takes an adapter (Pfeiffer's site; Houlsby's attention site is missing)
    "convnext": ArchSpec(("pwconv1", "pwconv2"), (), "pwconv2"),
}

# tokens a ViT-family encoder adds to its patches (the class token; DeiT's distillation token too; none for Swin's
# windows and ConvNeXt's stem): one entry per vision model with a row above
EXTRA_IMAGE_TOKENS = {"vit": 1, "deit": 2, "beit": 1, "swin": 0, "convnext": 0}


def is_image_model(config) -> bool:
    """Whether ``config`` is a vision model: it takes images of a size and a number of channels, and has no text
    vocabulary (BEiT's ``vocab_size`` is its visual tokens': a vision model with a row here; Fuyu, UDOP or ViLT,
    which take text too, are not)."""
    if getattr(config, "image_size", None) is None or getattr(config, "num_channels", None) is None:
        return False
    return getattr(config, "vocab_size", None) is None or config.model_type in EXTRA_IMAGE_TOKENS


def image_sequence_length(config) -> int:
    """The tokens a ViT-family encoder sees per image: its patches plus its class (and distillation) tokens,
    e.g. (224 / 16)^2 + 1 = 197 for ViT-B/16."""
    size, patch = config.image_size, config.patch_size
    height, width = (size, size) if isinstance(size, int) else size
    patch_h, patch_w = (patch, patch) if isinstance(patch, int) else patch
    patches = (height // patch_h) * (width // patch_w)
    return patches + EXTRA_IMAGE_TOKENS.get(config.model_type, 1)


@dataclass(frozen=True)
class ModelShape:
    """Depth, heads and width, as used by the analytic OPs formulas (paper 000, Appendix A)."""

    model_type: str
    num_layers: int  # all transformer blocks (encoder + decoder for encoder-decoder models)
    num_attention_modules: int  # self-attention per block + decoder cross-attention (paper 000's L)
    num_heads: int
    num_kv_heads: int
    hidden: int
    intermediate: int
    encoder_decoder: bool


def arch_spec(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"architecture {model_type!r} has no fedpeft layout; supported: {', '.join(sorted(ARCHITECTURES))}. "
            "Pass explicit target modules (e.g. peft.target_modules) or add a row to fedpeft.models.layout"
        ) from None


def model_shape(config) -> ModelShape:
    """Read depth / heads / width from a transformers config, whatever its attribute names."""

    def get(*names, default=None):
        for n in names:
            v = getattr(config, n, None)
            if v is not None:
                return v
        return default

    encdec = bool(getattr(config, "is_encoder_decoder", False))
    layers = get("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    attention_modules = layers
    if encdec:
        dec = get("num_decoder_layers", "decoder_layers", default=layers)
        enc = get("encoder_layers", "num_layers", default=layers)
        layers = int(enc) + int(dec)
        attention_modules = int(enc) + 2 * int(dec)
    heads = get("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    if not isinstance(heads, int):  # Swin: heads per stage, stages of different widths; ConvNeXt: no attention
        what = f"stages of different widths and head counts (heads {heads})" if heads else "no attention heads"
        raise ValueError(  # noqa: TRY004 (a model fedpeft cannot describe by one shape, caught as ValueError)
            f"model type {config.model_type!r} has {what}; analytic OPs and head-level algorithms need one width "
            "and head count in every block")
    hidden = get("hidden_size", "n_embd", "d_model", "dim")
    inter = get("intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", "hidden_dim", default=None)
    if inter is None:
        inter = 4 * int(hidden)
    return ModelShape(
        model_type=config.model_type,
        num_layers=int(layers),
        num_attention_modules=int(attention_modules),
        num_heads=int(heads),
        num_kv_heads=int(get("num_key_value_heads", default=heads)),
        hidden=int(hidden),
        intermediate=int(inter),
        encoder_decoder=encdec,
    )


def uniform_shape(config) -> ModelShape | None:
    """:func:`model_shape`, or None for a model without one width and head count in every block (Swin's stages,
    ConvNeXt), whose analytic OPs fedpeft does not count."""
    try:
        return model_shape(config)
    except ValueError:
        return None
