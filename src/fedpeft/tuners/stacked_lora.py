"""The LoRA update of several clients in one pass over the frozen layer: row ``i`` of a fused batch belongs to
client ``clients[i]``, whose factors are slice ``clients[i]`` of ``A`` (K, r, in) and ``B`` (K, out, r).

Groundwork for training a round's clients together over the one frozen backbone (issue 37): the frozen
projection ``x @ W^T + b`` runs once over every row; each row adds its own client's ``s * (x @ A_k^T) @ B_k^T``.
Two ways to apply the factors, with the same result up to float32 rounding (they sum the same products in a
different blocking):

* :func:`gathered_lora_delta`: every row gathers its client's factors and one batched matrix product
  (``torch.bmm``) does all rows; memory grows with rows x factor size.
* :func:`grouped_lora_delta`: the rows of each client are taken together and multiplied by that client's
  factors, one matrix product per client present.

``benchmarks/stacked_lora.py`` measures both against one client at a time.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, clients: torch.Tensor) -> None:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(f"A must be (K, r, in) and B (K, out, r) with the same K and r; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if x.shape[-1] != a.shape[2]:
        raise ValueError(f"the input's last dimension {x.shape[-1]} is not A's in-features {a.shape[2]}")
    if clients.dim() != 1 or clients.shape[0] != x.shape[0]:
        raise ValueError(f"give one client index per row: {tuple(clients.shape)} for {x.shape[0]} rows")
    if clients.numel() and (int(clients.min()) < 0 or int(clients.max()) >= a.shape[0]):
        raise ValueError(f"client indices must lie in [0, {a.shape[0]})")


def gathered_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, clients: torch.Tensor,
                        scaling: float) -> torch.Tensor:
    """``s * (x_i @ A_{c_i}^T) @ B_{c_i}^T`` for every row ``i`` of ``x`` (rows, ..., in), by gathering each
    row's factors and one batched product."""
    _check(x, a, b, clients)
    rows = x.reshape(x.shape[0], -1, x.shape[-1])  # (N, T, in)
    down = torch.bmm(rows, a[clients].transpose(1, 2))  # (N, T, r)
    up = torch.bmm(down, b[clients].transpose(1, 2))  # (N, T, out)
    return (up * scaling).reshape(*x.shape[:-1], b.shape[1])


def grouped_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, clients: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """The same as :func:`gathered_lora_delta`, one matrix product per client over that client's rows."""
    _check(x, a, b, clients)
    out = x.new_zeros(*x.shape[:-1], b.shape[1])
    for k in torch.unique(clients).tolist():
        index = (clients == k).nonzero(as_tuple=True)[0]
        rows = x.index_select(0, index)
        out = out.index_copy(0, index, (rows @ a[k].transpose(0, 1)) @ b[k].transpose(0, 1) * scaling)
    return out
