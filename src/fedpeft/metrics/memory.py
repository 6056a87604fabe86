"""Memory of a backbone and of training it with a PEFT method: what a loaded model holds (measured) and what
a model of any size would need in each precision (estimated from its architecture config on the meta device,
no weights), so that a user can tell before downloading an 8B model whether a client's device can train it.

The estimate of one client's training memory is the sum of

* **backbone**: every parameter and buffer at its precision; under bitsandbytes quantization the linear
  layers that fedpeft quantizes (all but the task and LM heads, ``registry.QUANTIZATION_SKIPPED``) at their
  packed size plus their quantization constants (8-bit: a float32 scale per output row; 4-bit: half a byte
  per weight plus one absmax per block of 64, itself quantized to one byte with double quantization);
* **trainable state**: the PEFT method's trainable tensors, their gradients and Adam's two moments;
* **activations**: the tensors autograd saves for the backward pass, counted exactly by running the forward
  pass and loss on the meta device under ``torch.autograd.graph.saved_tensors_hooks`` (each storage once,
  parameters excluded). With gradient checkpointing, each decoder layer keeps only its input and one layer
  is recomputed at a time: the saved tensors outside the layers, the layers' inputs and one layer's tensors;
* **backward transient**: two tensors of the size of the largest saved one, alive together when the backward
  pass starts (for a language model the float32 logits and the gradient of their log-softmax).

Training several clients in one pass (``runtime.clients_per_pass``) holds the backbone once and everything
else once per client: :attr:`TrainingMemory.per_client_bytes`, and :meth:`TrainingMemory.clients_per_pass`
for how many fit in a device's memory.

It leaves out the allocator's slack, the CUDA context and the framework's own memory. ``benchmarks/precision.py``
checks it against SmolLM2-135M: the peak of tensor memory in a real training step (PyTorch's memory profiler)
and the process's peak RSS (BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

PRECISIONS = ("float32", "bfloat16", "int8", "nf4")
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BLOCKSIZE_4BIT = 64  # bitsandbytes' 4-bit block size (transformers' default)
NESTED_BLOCKSIZE = 256  # double quantization: blocks of absmax values


def _quant_state_tensors(param) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside a quantized weight (not parameters or buffers, so that
    ``get_memory_footprint`` misses them): 4-bit absmax, code and the nested state; 8-bit row scales."""
    out = []
    state = getattr(param, "quant_state", None)
    while state is not None:
        out += [t for t in (getattr(state, "absmax", None), getattr(state, "code", None),
                            getattr(state, "offset", None)) if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    scale = getattr(param, "SCB", None)
    if isinstance(scale, torch.Tensor):
        out.append(scale)
    return out


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters, buffers and quantization constants hold, as stored (a quantized weight at
    its packed size); a storage shared by several tensors (tied embeddings, a shared code book) counts once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        for t in (tensor, *_quant_state_tensors(tensor)):
            if t.device.type == "meta":
                seen[id(t)] = t.numel() * t.element_size()
            else:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return int(sum(seen.values()))


def _quantized(name: str, module: torch.nn.Module) -> bool:
    from fedpeft.models.registry import QUANTIZATION_SKIPPED

    return isinstance(module, torch.nn.Linear) and not set(name.split(".")) & set(QUANTIZATION_SKIPPED)


def backbone_bytes_estimate(model: torch.nn.Module, precision: str, *, double_quant: bool = True) -> int:
    """What ``held_bytes`` gives for ``model`` (built on the meta device in float32) loaded in ``precision``:
    float32 / bfloat16 weights, or int8 / nf4 linear layers through bitsandbytes (the rest float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    quantized = {id(m.weight): m for n, m in model.named_modules() if _quantized(n, m)} \
        if precision in ("int8", "nf4") else {}
    other_bytes = _ELEMENT_BYTES.get(precision, 4)
    total = 0
    for p in model.parameters():  # tied weights are yielded once
        module = quantized.get(id(p))
        if module is None:
            total += p.numel() * (other_bytes if p.is_floating_point() else p.element_size())
        elif precision == "int8":
            total += p.numel() + 4 * module.out_features  # int8 weights + a float32 scale per output row
        else:
            blocks = math.ceil(p.numel() / BLOCKSIZE_4BIT)
            total += math.ceil(p.numel() / 2) + 16 * 4  # packed NF4 pairs + the 16-value code book
            if double_quant:  # uint8 absmax per block, float32 absmax per 256 blocks, its code book and offset
                total += blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 256 * 4 + 4
            else:
                total += 4 * blocks
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return int(total)


def _saved_bytes(model: torch.nn.Module, batch_size: int, tokens: int, kind: str) -> tuple[int, int]:
    """(sum, largest) of the bytes autograd saves for one training forward pass and loss of ``model``."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    device = next(model.parameters()).device
    ids = torch.zeros(batch_size, tokens, dtype=torch.long, device=device)
    inputs: dict[str, Any] = {"input_ids": ids}  # no padding (a mask of ones would need .item() on meta)
    if kind == "classification":
        inputs["labels"] = torch.zeros(batch_size, dtype=torch.long, device=device)
    else:
        inputs["labels"] = ids
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return int(sum(seen.values())), int(max(seen.values(), default=0))


@dataclass
class TrainingMemory:
    """One client's estimated training memory (bytes) for one backbone, PEFT method and precision."""

    model: str
    precision: str
    gradient_checkpointing: bool
    batch_size: int
    tokens: int
    parameters: int  # the backbone's
    method_parameters: int  # the tensors the PEFT method adds (their bytes are in the trainable state)
    trainable: int
    backbone_bytes: int
    trainable_state_bytes: int
    activation_bytes: int
    transient_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.backbone_bytes + self.trainable_state_bytes + self.activation_bytes + self.transient_bytes

    @property
    def per_client_bytes(self) -> int:
        """What each client adds to a pass that trains several together (``runtime.clients_per_pass``): its own
        trainable state, its batch's activations and its part of the backward transient (which grows with the
        pass's rows). The backbone is held once."""
        return self.trainable_state_bytes + self.activation_bytes + self.transient_bytes

    def clients_per_pass(self, device_bytes: int) -> int:
        """The most clients whose one pass fits in ``device_bytes`` (0: not even one)."""
        return max(0, (device_bytes - self.backbone_bytes) // self.per_client_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "per_client_bytes": self.per_client_bytes}


def _with_layers(config, layers: int):
    """``config`` with ``layers`` layers in each stack (an encoder-decoder: that many in both)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    for name in ("num_layers", "n_layer", "num_decoder_layers", "encoder_layers", "decoder_layers"):
        if hasattr(config, name):
            setattr(config, name, layers)
    return config


def _stacks(config) -> int:
    """2 for an encoder-decoder (a "layer" of the estimate is one encoder and one decoder layer), else 1."""
    return 2 if getattr(config, "is_encoder_decoder", False) else 1


def _layer_count(config) -> int:
    if _stacks(config) == 2:
        depths = {getattr(config, n) for n in ("encoder_layers", "decoder_layers", "num_layers", "num_decoder_layers")
                  if isinstance(getattr(config, n, None), int)}
        if len(depths) != 1:
            raise ValueError(f"{type(config).__name__}: the estimate assumes an encoder and a decoder of one depth, "
                             f"got {sorted(depths)}")
        return depths.pop()
    for name in ("num_hidden_layers", "num_layers", "n_layer"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"{type(config).__name__} names no layer count")


def estimate_training(name: str, config, method_opts, kind: str, precision: str, *, batch_size: int, tokens: int,
                      gradient_checkpointing: bool = False, double_quant: bool = True, optimizer_states: int = 2, num_labels: int = 2) -> TrainingMemory:
    """One client's training memory for the PEFT method ``method_opts`` (registered options) on ``config`` in
    ``precision`` (see the module's docstring). Activations are in bfloat16 for ``bfloat16`` and in float32
    otherwise: under a quantized backbone fedpeft's k-bit preparation keeps embeddings, norms and the head in
    float32 and the quantized layers return their input's dtype, so only the inputs those layers save are in
    the compute dtype; with a bfloat16 compute dtype this is an upper bound. The method's tensors, their gradients and optimizer
    moments in float32 in every precision (as fedpeft trains them: ``model.dtype``)."""
    from fedpeft.models.architectures import build_on_meta
    from fedpeft.tuners import apply_tuner

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    act_dtype = "bfloat16" if precision == "bfloat16" else "float32"

    def tuned(layers: int | None):
        model = build_on_meta(config if layers is None else _with_layers(config, layers), kind, num_labels)
        return apply_tuner(model, method_opts, kind)

    full = tuned(None)
    plain = build_on_meta(config, kind, num_labels)
    added = sum(p.numel() for p in full.module.parameters()) - sum(p.numel() for p in plain.parameters())
    trainable = full.num_trainable()
    backbone = backbone_bytes_estimate(plain, precision, double_quant=double_quant)
    # the method's own tensors (added to the backbone), and gradients and optimizer moments of all that trains
    state_bytes = 4 * (added + trainable * (1 + optimizer_states))  # float32 in every precision (model.dtype)

    def saved(layers: int) -> tuple[int, int]:
        model = tuned(layers).module.to(getattr(torch, act_dtype))
        model.train()
        return _saved_bytes(model, batch_size, tokens, kind)

    one, largest = saved(1)
    two, _ = saved(2)
    per_layer = two - one
    outside = one - per_layer
    layers = _layer_count(config)
    if gradient_checkpointing:
        hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or config.n_embd
        layer_input = _stacks(config) * batch_size * tokens * hidden * _ELEMENT_BYTES[act_dtype]
        activations = outside + layers * layer_input + per_layer
    else:
        activations = outside + layers * per_layer
    return TrainingMemory(model=name, precision=precision, gradient_checkpointing=gradient_checkpointing,
                          batch_size=batch_size, tokens=tokens, parameters=sum(p.numel() for p in plain.parameters()),
                          method_parameters=added, trainable=trainable, backbone_bytes=backbone, trainable_state_bytes=state_bytes, activation_bytes=activations,
                          transient_bytes=2 * largest)
