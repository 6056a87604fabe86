"""FedSP's auxiliary model (paper 003, Sec. 3.1): a causal LM with k of the global model's L blocks.

The server builds it from the global model and sends it to the clients once; the global model itself
never leaves the server. It keeps the embeddings, the final norm and the LM head, and k consecutive
blocks taken from the bottom, the middle or the top of the stack. With cross-layer parameter sharing
(ALBERT-style, the paper's default) the k blocks are applied cyclically in the order
b_0 .. b_(k-1), b_0 .. b_(k-1), ... (as the reference code does), so the model has L block positions
(position p runs block p mod k; where k does not divide L, e.g. k = 4 of SmolLM2's 30 layers, the last
cycle is cut short)
and the prefix prompts of all L layers plug in exactly as on the global model. Without sharing (the
"w/o CS" ablation and FedPrompt-Single) the model has k positions and takes k layers' prompts.

A shared block is one set of parameters at several positions: each extra position is a shallow module
copy that holds the same parameter and buffer tensors but its own ``layer_idx``, because transformers'
attention reads and writes the key/value cache (where the prefix prompts live) at ``self.layer_idx``.
``named_parameters()`` lists each shared tensor once, under its first position (``...layers.0..k-1``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Position = Literal["bottom", "middle", "top"]


def block_stack(model: nn.Module) -> tuple[nn.Module, str]:
    """(parent module, attribute name) of the decoder's list of transformer blocks."""
    base = model.base_model
    for attr in ("layers", "h", "blocks"):
        stack = getattr(base, attr, None)
        if isinstance(stack, nn.ModuleList):
            return base, attr
    decoder = getattr(base, "decoder", None)
    if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder, "layers"
    raise ValueError(f"{type(model).__name__}: no list of decoder blocks found (looked for layers / h / blocks); "
                     "FedSP's auxiliary model needs a decoder-only causal LM such as LLaMA, GPT-2 or OPT")


def chosen_blocks(num_layers: int, k: int, position: Position) -> list[int]:
    """Indices of the k consecutive global blocks the auxiliary model is built from."""
    if not 1 <= k <= num_layers:
        raise ValueError(f"the auxiliary model needs 1 <= k <= {num_layers} blocks, got {k}")
    start = {"bottom": 0, "middle": (num_layers - k) // 2, "top": num_layers - k}[position]
    return list(range(start, start + k))


def _at_position(module: nn.Module, position: int) -> nn.Module:
    """A shallow copy of ``module`` (recursively) holding the same tensors, with layer_idx = position."""
    clone = copy.copy(module)  # shares _parameters / _buffers dicts: the very same tensors
    clone._modules = {name: None if child is None else _at_position(child, position)
                      for name, child in module._modules.items()}
    for attr, value in vars(module).items():  # hooks registered later on one position stay on that position
        if "hooks" in attr and isinstance(value, dict):
            setattr(clone, attr, type(value)())
    if isinstance(getattr(module, "layer_idx", None), int):
        clone.layer_idx = position
    return clone


@dataclass(frozen=True)
class AuxiliaryInfo:
    """What the auxiliary model is, for reports and for rebuilding it on a client."""

    blocks: list[int]  # the global blocks it was built from
    positions: int  # block positions in its forward pass (L with sharing, k without)
    shared: bool
    parameters: int  # unique parameters
    global_parameters: int


def build_auxiliary(global_model: nn.Module, k: int = 1, position: Position = "bottom",
                    share: bool = True) -> tuple[nn.Module, AuxiliaryInfo]:
    """A new causal LM holding fp32 copies of the global model's embeddings, final norm, LM head and k blocks
    (the global model is not modified and no tensor is shared with it)."""
    config = global_model.config
    num_layers = int(config.num_hidden_layers)
    blocks = chosen_blocks(num_layers, k, position)
    small = copy.deepcopy(config)
    small.num_hidden_layers = k
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = [config.layer_types[b] for b in blocks]
    aux = type(global_model)(small)
    state = global_model.state_dict()
    parent, attr = block_stack(global_model)
    prefix = _module_prefix(global_model, parent) + attr + "."
    mapped = {}
    for name, tensor in state.items():
        if name.startswith(prefix):
            idx, rest = name[len(prefix):].split(".", 1)
            if int(idx) in blocks:
                mapped[f"{prefix}{blocks.index(int(idx))}.{rest}"] = tensor
        else:
            mapped[name] = tensor
    missing, unexpected = aux.load_state_dict(mapped, strict=False)
    missing = [m for m in missing if m not in _tied_names(aux)]
    if missing or unexpected:
        raise ValueError(f"auxiliary model does not match the global model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    aux.to(torch.float32)  # trained on the server and the clients: fp32 weights, whatever the global model's dtype
    if share and k < num_layers:
        share_blocks(aux, num_layers)
    info = AuxiliaryInfo(blocks=blocks, positions=int(aux.config.num_hidden_layers), shared=share and k < num_layers,
                         parameters=sum(p.numel() for p in aux.parameters()),
                         global_parameters=sum(p.numel() for p in global_model.parameters()))
    return aux, info


def share_blocks(model: nn.Module, positions: int) -> None:
    """Apply the model's k blocks cyclically at ``positions`` positions (position p runs block p mod k; in place)."""
    parent, attr = block_stack(model)
    stack = getattr(parent, attr)
    k = len(stack)
    setattr(parent, attr, nn.ModuleList([stack[p] if p < k else _at_position(stack[p % k], p) for p in range(positions)]))
    types = getattr(model.config, "layer_types", None)
    model.config.num_hidden_layers = positions
    if isinstance(types, list):
        model.config.layer_types = [types[p % k] for p in range(positions)]


def client_trained_names(model: nn.Module) -> list[str]:
    """The parameters FedSP's clients update with ``client_trains: blocks``: everything but the embeddings
    (the blocks and the norms; the LM head is the output embedding, tied or not)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    out = model.get_output_embeddings()
    if out is not None:
        embeddings |= {id(p) for p in out.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in embeddings]


PRIVATE_CONFIG_KEYS = ("_name_or_path", "name_or_path", "_commit_hash")


def public_config(model: nn.Module) -> dict[str, Any]:
    """The auxiliary model's config as sent to clients, without where the global model came from."""
    return {k: v for k, v in model.config.to_dict().items() if k not in PRIVATE_CONFIG_KEYS}


def auxiliary_from_config(config: dict[str, Any], *, blocks: int, positions: int) -> nn.Module:
    """An auxiliary model's skeleton (random values) from the config the server sent: ``blocks`` blocks
    applied at ``positions`` positions. The client then loads the received parameters into it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if positions < blocks:
        raise ValueError(f"{positions} positions cannot hold {blocks} blocks")
    values = dict(config)
    model_type = values.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **values)
    cfg.num_hidden_layers = blocks
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:blocks]
    model = AutoModelForCausalLM.from_config(cfg)
    if positions > blocks:
        share_blocks(model, positions)
    return model.eval()


def _module_prefix(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return f"{name}." if name else ""
    raise ValueError("module not found in model")


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that are aliases of another parameter (e.g. a tied LM head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied
