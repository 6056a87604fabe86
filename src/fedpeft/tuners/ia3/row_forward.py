"""IA3's row forward for a fused pass: HF peft keeps each layer's vector in a ParameterDict, which the generic
row forwards cannot see; this is peft's ``ia3.Linear.forward`` with each row scaled by its own client's vector."""

from __future__ import annotations

from typing import Any

import torch

from fedpeft.tuners.row_batched import RowBatchUnsupported, Rows, per_row


def ia3_linear_rows(module: Any, rows: Rows, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if module.disable_adapters or module.merged:
        raise RowBatchUnsupported("an IA3 layer with its adapter disabled or merged is not row-batched")
    rows.check_rows(x, module)
    scaling = None
    for adapter in module.active_adapters:
        if adapter not in module.ia3_l:
            continue
        vector = rows.param(module.ia3_l, adapter)
        vector = module.ia3_l[adapter].flatten().expand(rows.num_rows, -1) if vector is None \
            else vector.reshape(rows.num_rows, -1)
        scaling = vector if scaling is None else scaling * vector
    if scaling is None:
        return module.base_layer(x, *args, **kwargs)
    if module.is_feedforward:
        return module.base_layer((x * per_row(scaling, x)).to(x.dtype), *args, **kwargs)
    result = module.base_layer(x, *args, **kwargs)
    return (result * per_row(scaling, result)).to(result.dtype)
