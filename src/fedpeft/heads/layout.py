"""Which slices of the trainable parameters belong to which attention head.

Heads are numbered globally: attention modules in a fixed order (encoder-only and decoder-only models:
the self-attention of layer 0, 1, ...; encoder-decoder models: encoder self-attention of every layer,
then decoder self-attention of every layer, then decoder cross-attention of every layer), ``H`` query
heads each, so head ``g = module * H + h``.

A :class:`HeadUnit` is a contiguous slice of one parameter along one axis, tied to the set of query
heads it serves:

* LoRA (paper 000: P = {B}): the rows of ``lora_B`` of the query / key / value projections. GPT-2's
  fused ``c_attn`` is split into its query, key and value thirds first. With grouped key/value heads
  (LLaMA-style, e.g. SmolLM2: 9 query / 3 key-value heads) a key/value head's rows serve every query
  head of its group. ``lora_A`` is not head-associated.
* IA3: the output-scaling entries of the attention projections peft adapts (key and value, and query
  where targeted); the input-scaling entries (feed-forward, attention output) stay non-head.
* prefix tuning / P-tuning v2 (without projection): the key and value prefix dims of every layer, which
  prefix the decoder self-attention in encoder-decoder models (its map is in its package:
  ``fedpeft.tuners.prefix_tuning.heads``; the maps here are those several methods share).
* prompt tuning and P-tuning (input-level virtual tokens): the embedding dims split into as many
  contiguous chunks as the model has heads (all modules, ``num_modules * H``; chunk sizes differ by at
  most one, and some are empty when the model has more heads than dims), chunk ``g`` tied to global head ``g``. An input prompt feeds every head of every layer, so no
  physical split exists; this one makes the uploaded share of the prompt equal the kept share of heads
  (paper 000, Table 3: 743 KB -> 74 KB at 90% sparsity). Tying all dims to the first module's heads
  instead would upload anything from 0 to 100% of the prompt at a given sparsity.

Everything else that trains (the task head, ``lora_A``, projection MLPs, prompt encoders) is non-head
and follows FedAvg (paper 000, Eq. 5).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedpeft.errors import UserError
from fedpeft.models.layout import arch_spec, model_shape
from fedpeft.plugins import load_built_ins
from fedpeft.registry import PEFT_METHODS

_LAYER_INDEX = re.compile(r"\.(?:layer|layers|block|h)\.(\d+)\.")
_CROSS_MARKERS = ("EncDecAttention", "encoder_attn", "crossattention")


@dataclass(frozen=True)
class HeadUnit:
    start: int  # slice along the parameter's head axis
    stop: int
    heads: tuple[int, ...]  # global query-head ids served by this slice

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class HeadParam:
    name: str
    shape: tuple[int, ...]
    axis: int
    units: list[HeadUnit] = field(default_factory=list)

    def kept_units(self, kept: set[int] | frozenset[int]) -> list[HeadUnit]:
        """A slice travels if any head it serves is kept."""
        return [u for u in self.units if any(h in kept for h in u.heads)]

    def packed_shape(self, kept: set[int] | frozenset[int]) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.axis] = sum(u.size for u in self.kept_units(kept))
        return tuple(shape)


@dataclass
class HeadLayout:
    num_modules: int
    heads_per_module: int
    module_names: list[str]  # e.g. "encoder.self.0", "decoder.cross.1"
    params: dict[str, HeadParam]  # head-associated parameters only

    @property
    def num_heads(self) -> int:
        return self.num_modules * self.heads_per_module

    def module_of(self, head: int) -> int:
        return head // self.heads_per_module

    def describe(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads, "heads_per_module": self.heads_per_module, "modules": self.module_names,
            "head_parameters": {n: {"axis": p.axis, "units": len(p.units)} for n, p in self.params.items()},
        }


class LayoutError(UserError, ValueError):
    """The trainable parameters cannot be mapped to attention heads."""


def _modules(config) -> tuple[list[str], bool]:
    shape = model_shape(config)
    if not shape.encoder_decoder:
        return [f"self.{i}" for i in range(shape.num_layers)], False
    enc = int(getattr(config, "encoder_layers", None) or config.num_layers)
    dec = int(getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None) or enc)
    names = [f"encoder.self.{i}" for i in range(enc)] + [f"decoder.self.{i}" for i in range(dec)]
    return names + [f"decoder.cross.{i}" for i in range(dec)], True


def _module_key(name: str, encdec: bool) -> str | None:
    m = _LAYER_INDEX.search(name)
    if m is None:
        return None
    layer = m.group(1)
    if not encdec:
        return f"self.{layer}"
    stack = "decoder" if ".decoder." in name else "encoder"
    kind = "cross" if any(c in name for c in _CROSS_MARKERS) else "self"
    return f"{stack}.{kind}.{layer}"


def _role(name: str, qkv: tuple[str, ...]) -> str | None:
    """'q', 'k', 'v' or 'qkv' (fused) for a parameter of an attention projection, else None."""
    parts = name.split(".")
    for marker in ("lora_B", "ia3_l"):
        if marker in parts:
            module = parts[parts.index(marker) - 1]
            break
    else:
        return None
    if len(qkv) == 1:
        return "qkv" if module == qkv[0] else None
    roles = dict(zip(qkv, ("q", "k", "v")))
    return roles.get(module)


@dataclass(frozen=True)
class HeadGeometry:
    """A backbone's attention heads, as a PEFT method's ``head_params`` needs them to map its tensors."""

    config: Any  # the backbone's transformers config
    num_heads: int  # H: query heads per attention module
    num_kv_heads: int
    head_dim: int
    module_names: list[str]  # the attention modules in global order ("self.0", "encoder.self.0", ...)
    encoder_decoder: bool

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_index(self, key: str) -> int:
        return self.module_names.index(key)

    def module_key(self, name: str) -> str | None:
        """The attention module (e.g. "decoder.cross.1") a parameter name belongs to, by its layer index."""
        return _module_key(name, self.encoder_decoder)

    def rows(self, module: int, role: str, offset: int = 0) -> list[HeadUnit]:
        """The head units of one projection's output rows in attention module ``module``: query rows ("q",
        one unit per query head) or key/value rows (one per key/value head, serving its group of query heads)."""
        H, d = self.num_heads, self.head_dim
        base = module * H
        if role == "q":
            return [HeadUnit(offset + h * d, offset + (h + 1) * d, (base + h,)) for h in range(H)]
        group = H // self.num_kv_heads
        return [HeadUnit(offset + g * d, offset + (g + 1) * d, tuple(base + g * group + j for j in range(group)))
                for g in range(self.num_kv_heads)]


def head_geometry(config) -> HeadGeometry:
    shape = model_shape(config)
    H = shape.num_heads
    head_dim = int(getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or shape.hidden // H)
    names, encdec = _modules(config)
    return HeadGeometry(config, H, shape.num_kv_heads, head_dim, names, encdec)


def qkv_head_params(spec: Mapping[str, tuple[tuple[int, ...], str]], geo: HeadGeometry) -> dict[str, HeadParam]:
    """LoRA and IA3: the output rows of the adapted query / key / value projections (``lora_B``; IA3's
    output scaling vectors of shape (n, 1)); lora_A, the task head and IA3's input scalings stay non-head."""
    qkv = arch_spec(geo.config.model_type).qkv
    params: dict[str, HeadParam] = {}
    for name, (pshape, _) in spec.items():
        role = _role(name, qkv)
        if role is None or ("ia3_l" in name.split(".") and (len(pshape) != 2 or pshape[1] != 1)):
            continue  # lora_A, task head, IA3 input scaling (shape (1, n)): non-head
        key = geo.module_key(name)
        if key not in geo.module_names:
            raise LayoutError(f"{name}: cannot tell which attention module it belongs to")
        mod = geo.module_index(key)
        if role == "qkv":  # GPT-2 c_attn: [query | key | value] rows
            units = geo.rows(mod, "q") + geo.rows(mod, "k", geo.q_dim) + geo.rows(mod, "v", geo.q_dim + geo.kv_dim)
        else:
            units = geo.rows(mod, role)
        expected = sum(u.size for u in units)
        if pshape[0] != expected:
            raise LayoutError(f"{name}: {pshape[0]} rows, expected {expected} for its heads")
        params[name] = HeadParam(name, tuple(pshape), 0, units)
    return params


PROMPT_EMBEDDING_SUFFIX = "prompt_encoder.default.embedding.weight"


def prompt_head_params(spec: Mapping[str, tuple[tuple[int, ...], str]], geo: HeadGeometry) -> dict[str, HeadParam]:
    """Input prompts (prompt tuning, P-tuning): the embedding dims in one contiguous chunk per global head."""
    name = next((n for n in spec if n.endswith(PROMPT_EMBEDDING_SUFFIX)), None)
    if name is None:
        return {}
    pshape = tuple(spec[name][0])
    dims, heads = pshape[1], len(geo.module_names) * geo.num_heads  # more heads than dims (T5-large): empty chunks
    return {name: HeadParam(name, pshape, 1, [HeadUnit(g * dims // heads, (g + 1) * dims // heads, (g,))
                                              for g in range(heads)])}


def head_layout(tuned: Any, model_config: Any) -> HeadLayout:
    """The head layout of a TunedModel's trainable tensors (a ``fedpeft.RuntimeNeeds.layout`` builder: headprune's)."""
    return build_layout(tuned.spec(), model_config, tuned.method)


def build_layout(spec: Mapping[str, tuple[tuple[int, ...], str]], config, method: str) -> HeadLayout:
    """Map the trainable parameters ``spec`` (name -> (shape, dtype)) of the registered PEFT ``method`` to heads,
    with the ``head_params`` it registered."""
    load_built_ins()
    mapper = PEFT_METHODS.require(method, "peft method").head_params
    if mapper is None:
        heads = ", ".join(name for name, m in PEFT_METHODS.items() if m.head_params is not None)
        raise LayoutError(f"peft method {method!r} has no head layout; use one of {heads}")
    try:
        geo = head_geometry(config)
    except ValueError as exc:
        raise LayoutError(f"{exc}: use a model with one head count (ViT, DeiT, BEiT) for head-level algorithms") from None
    params = mapper(spec, geo)
    if not params:
        raise LayoutError(f"no trainable parameter of {method!r} maps to an attention head (check target modules)")
    return HeadLayout(len(geo.module_names), geo.num_heads, geo.module_names, params)
