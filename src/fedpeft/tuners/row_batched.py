"""Row-batched forwards: one frozen backbone, several clients' trainable tensors, each row of a fused batch
computed with its own client's tensors.

In a fused pass (``runtime.clients_per_pass``, see docs/guide/clients-per-pass.md) row ``i`` of the batch
belongs to client slot ``rows.client[i]``. Every module that owns a trainable parameter gets a *row forward*
for the pass: the same computation as its own ``forward``, with each trainable tensor replaced by that row's
client's copy (the frozen ones stay shared). A row forward is looked up by the module's type (its MRO), so a
peft LoRA layer needs none of its own: its ``lora_A``/``lora_B`` are ``nn.Linear`` modules. The built-in
ones cover ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and transformers' ``Conv1D``; a PEFT method whose
tensors sit in other modules registers its own with ``register_peft_method(row_forwards=...)`` (IA3 does), or
its runs train one client at a time. A row forward may set ``patch`` (the method it replaces, default
"forward") and ``covers`` (a child module whose trainable tensors it handles itself): peft's prompt learning
replaces ``get_prompt`` and covers ``prompt_encoder`` (fedpeft.tuners.prompt_rows).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# A row forward: (module, rows, *the forward's own arguments) -> the forward's output
RowForward = Callable[..., torch.Tensor]


class RowBatchUnsupported(RuntimeError):
    """The model cannot be trained row-batched (a trainable tensor in a module without a row forward, an input
    whose first dimension is not the rows); the clients train one at a time."""


@dataclass
class Rows:
    """Which client slot each row of the current fused batch belongs to, and every slot's own trainable tensors.

    ``slot_params[k][name]`` is slot ``k``'s leaf for the trainable parameter ``name`` (a name of
    ``TunedModel.params``); a row forward reads them through :meth:`param`, stacked once per batch."""

    slot_params: Sequence[Mapping[str, torch.Tensor]]
    names: Mapping[tuple[int, str], str]  # (id(owner module), attribute) -> parameter name
    client: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (N,) slot per row
    _stacked: dict[str, torch.Tensor] = field(default_factory=dict)

    def start_batch(self, client: torch.Tensor) -> None:
        self.client = client
        self._stacked.clear()

    @property
    def num_rows(self) -> int:
        return int(self.client.shape[0])

    def stacked(self, module: nn.Module, attr: str) -> torch.Tensor | None:
        """(slots, *shape): every slot's copy of ``module.<attr>``, or None when that tensor is frozen (shared)."""
        name = self.names.get((id(module), attr))
        if name is None:
            return None
        if name not in self._stacked:
            self._stacked[name] = torch.stack([params[name] for params in self.slot_params])
        return self._stacked[name]

    def param(self, module: nn.Module, attr: str) -> torch.Tensor | None:
        """(N, *shape): each row's own copy of ``module.<attr>``, or None when that tensor is frozen (shared)."""
        stacked = self.stacked(module, attr)
        return None if stacked is None else stacked.index_select(0, self.client)

    def check_rows(self, x: torch.Tensor, module: nn.Module) -> None:
        if x.dim() == 0 or x.shape[0] != self.num_rows:
            raise RowBatchUnsupported(f"{type(module).__name__} got an input of shape {tuple(x.shape)}, whose first "
                                      f"dimension is not the fused batch's {self.num_rows} rows")



def per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (N, *s), one entry per row, viewed to broadcast over ``like`` (N, ..., *s)."""
    return value.reshape(value.shape[0], *([1] * (like.dim() - value.dim())), *value.shape[1:]).to(like.dtype)


def _row_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x (N, ..., in) times each row's (in, out) matrix ``weight_t`` (N, in, out)."""
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    return torch.bmm(flat, weight_t.to(flat.dtype)).reshape(*x.shape[:-1], weight_t.shape[-1])


def linear_rows(module: nn.Linear, rows: Rows, x: torch.Tensor) -> torch.Tensor:
    rows.check_rows(x, module)
    weight, bias = rows.param(module, "weight"), rows.param(module, "bias")
    if weight is None:
        y = F.linear(x, module.weight, module.bias if bias is None else None)
    else:
        y = _row_matmul(x, weight.transpose(1, 2))
        if bias is None and module.bias is not None:
            y = y + module.bias
    return y if bias is None else y + per_row(bias, y)


def conv1d_rows(module: nn.Module, rows: Rows, x: torch.Tensor) -> torch.Tensor:
    """transformers' Conv1D (GPT-2): ``x @ weight + bias`` with weight (in, out)."""
    rows.check_rows(x, module)
    weight, bias = rows.param(module, "weight"), rows.param(module, "bias")
    y = x @ module.weight if weight is None else _row_matmul(x, weight)
    return y + (module.bias if bias is None else per_row(bias, y))


def embedding_rows(module: nn.Embedding, rows: Rows, ids: torch.Tensor) -> torch.Tensor:
    rows.check_rows(ids, module)
    table = rows.stacked(module, "weight")
    if table is None:
        return module.__class__.forward(module, ids)
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise RowBatchUnsupported("a trainable nn.Embedding with max_norm, scale_grad_by_freq or sparse gradients "
                                  "is not row-batched")
    slots = rows.client.reshape(-1, *([1] * (ids.dim() - 1))).expand_as(ids)
    out = table[slots, ids]
    if module.padding_idx is None:
        return out
    return torch.where((ids == module.padding_idx).unsqueeze(-1), out.detach(), out)  # its row gets no gradient


def layer_norm_rows(module: nn.LayerNorm, rows: Rows, x: torch.Tensor) -> torch.Tensor:
    rows.check_rows(x, module)
    weight, bias = rows.param(module, "weight"), rows.param(module, "bias")
    y = F.layer_norm(x, module.normalized_shape, module.weight if weight is None else None,
                     module.bias if bias is None else None, module.eps)
    if weight is not None:
        y = y * per_row(weight, y)
    if bias is not None:
        y = y + per_row(bias, y)
    return y


def scaled_norm_rows(module: nn.Module, rows: Rows, x: torch.Tensor) -> torch.Tensor:
    """A norm whose forward ends in ``weight * normalised(x)`` (LLaMA's and T5's RMS norms): its own forward with
    a weight of ones, times each row's weight."""
    rows.check_rows(x, module)
    weight = rows.param(module, "weight")
    if weight is None:
        return module.__class__.forward(module, x)
    own = module._parameters["weight"]
    module._parameters["weight"] = torch.ones_like(own, requires_grad=False)
    try:
        y = module.__class__.forward(module, x)
    finally:
        module._parameters["weight"] = own
    return per_row(weight, y) * y


SCALED_NORMS = ("transformers.models.llama.modeling_llama:LlamaRMSNorm",
                "transformers.models.t5.modeling_t5:T5LayerNorm")


def built_in_row_forwards() -> dict[type, RowForward]:
    forwards: dict[type, RowForward] = {nn.Linear: linear_rows, nn.Embedding: embedding_rows,
                                        nn.LayerNorm: layer_norm_rows}
    with contextlib.suppress(ImportError):
        from transformers.pytorch_utils import Conv1D

        forwards[Conv1D] = conv1d_rows
    for ref in SCALED_NORMS:
        module_name, _, cls = ref.partition(":")
        with contextlib.suppress(ImportError, AttributeError):
            forwards[getattr(importlib.import_module(module_name), cls)] = scaled_norm_rows
    return forwards


def find_row_forward(module: nn.Module, forwards: Mapping[type, RowForward]) -> RowForward | None:
    """The row forward registered for the module's type or a base class, provided the module computes what that
    class computes (a subclass that overrides the patched method, e.g. a scaled embedding, has none)."""
    for cls in type(module).__mro__:
        if cls in forwards:
            method = getattr(forwards[cls], "patch", "forward")
            return forwards[cls] if getattr(type(module), method) is getattr(cls, method) else None
    return None


def owners(model: nn.Module, names: Sequence[str]) -> dict[str, list[tuple[nn.Module, str]]]:
    """Where each trainable parameter sits: (module, attribute) of its name first, then of every other module
    holding the same tensor (tied weights: a decoder's output layer sharing its input embedding)."""
    wanted = {}
    for name in names:
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path) if path else model
        wanted[id(module._parameters[attr])] = name
    out: dict[str, list[tuple[nn.Module, str]]] = {name: [] for name in names}
    for name in names:
        path, _, attr = name.rpartition(".")
        out[name].append((model.get_submodule(path) if path else model, attr))
    for module in model.modules():
        for attr, p in module._parameters.items():
            name = wanted.get(id(p)) if p is not None else None
            if name is not None and (module, attr) != out[name][0]:
                out[name].append((module, attr))
    return out


def owner_names(model: nn.Module, names: Sequence[str]) -> dict[tuple[int, str], str]:
    """(id(module), attribute) -> parameter name, for every place a trainable parameter sits (see :func:`owners`)."""
    return {(id(module), attr): name for name, places in owners(model, names).items() for module, attr in places}


def row_batched_modules(model: nn.Module, names: Sequence[str],
                        forwards: Mapping[type, RowForward]) -> dict[nn.Module, RowForward]:
    """The modules whose forward is replaced in a fused pass, each with its row forward: first the modules whose
    row forward ``covers`` a child (its ``covers`` attribute: the child whose trainable tensors it handles
    itself, as peft's prompt learning does), then every other trainable parameter's owner, or the owner's parent
    when the owner is a plain container (peft keeps IA3's vectors in a ParameterDict). RowBatchUnsupported names
    the first parameter that none covers."""
    out: dict[nn.Module, RowForward] = {}
    covered: list[str] = []
    for path, module in model.named_modules():
        forward = find_row_forward(module, forwards)
        child = getattr(forward, "covers", None)
        if forward is not None and child is not None:
            prefix = f"{path}.{child}." if path else f"{child}."
            mine = [n for n in names if n.startswith(prefix)]
            if mine:
                out[module] = forward
                covered.extend(mine)
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    for name, places in owners(model, [n for n in names if n not in covered]).items():
        for owner, _attr in places:
            forward = find_row_forward(owner, forwards)
            target = owner
            if forward is None and id(owner) in parents:
                target = parents[id(owner)]
                forward = find_row_forward(target, forwards)
            if forward is None:
                raise RowBatchUnsupported(f"trainable parameter {name} sits in a {type(owner).__name__}, which has no "
                                          "row forward (register one with register_peft_method(row_forwards=...))")
            out[target] = forward
    return out


@contextlib.contextmanager
def row_batched(modules: Mapping[nn.Module, RowForward], rows: Rows) -> Iterator[None]:
    """Within the block, each module in ``modules`` computes row-batched (its instance ``forward`` replaced)."""
    patched = []
    try:
        for module, forward in modules.items():
            method = getattr(forward, "patch", "forward")
            setattr(module, method, types.MethodType(lambda self, *a, _f=forward, **kw: _f(self, rows, *a, **kw),
                                                     module))
            patched.append((module, method))
        yield
    finally:
        for module, method in patched:
            delattr(module, method)
