"""The row forward of HF peft's prompt learning (prompt tuning, P-tuning) for a fused pass.

peft computes the virtual tokens once, from one row of prompt indices, and repeats them for the batch
(``PeftModel.get_prompt``), so the prompt encoder never sees the batch's rows. In a fused pass ``get_prompt`` is
replaced: the encoder runs once per client slot with that slot's own tensors (``torch.func.functional_call``; an
embedding table, or P-tuning's MLP or LSTM over it), and each row gets its own client's virtual tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from fedpeft.tuners.row_batched import RowBatchUnsupported, Rows


def prompt_rows(model: Any, rows: Rows, batch_size: int, task_ids: Any = None, **kwargs: Any) -> torch.Tensor:
    config = model.active_peft_config
    if config.inference_mode or task_ids is not None or not config.is_prompt_learning:
        raise RowBatchUnsupported("peft prompt learning in inference mode or with task ids is not row-batched")
    if batch_size != rows.num_rows:
        raise RowBatchUnsupported(f"get_prompt for {batch_size} rows in a fused batch of {rows.num_rows}")
    encoder = model.prompt_encoder[model.active_adapter]
    tokens = model.prompt_tokens[model.active_adapter].unsqueeze(0)[:, :config.num_virtual_tokens]
    tokens = tokens.to(next(encoder.parameters()).device)
    own = {}
    for local, _ in encoder.named_parameters():
        path, _, attr = local.rpartition(".")
        owner = encoder.get_submodule(path) if path else encoder
        if (id(owner), attr) in rows.names:
            own[local] = (owner, attr)
    slots = sorted(set(rows.client.tolist()))
    per_slot = []
    for slot in range(len(rows.slot_params)):
        if slot not in slots:
            per_slot.append(None)
            continue
        params = {local: rows.stacked(owner, attr)[slot] for local, (owner, attr) in own.items()}
        per_slot.append(torch.func.functional_call(encoder, params, (tokens,))[0])
    template = next(p for p in per_slot if p is not None)
    stacked = torch.stack([template.new_zeros(template.shape) if p is None else p for p in per_slot])
    return stacked.index_select(0, rows.client)


prompt_rows.patch = "get_prompt"  # type: ignore[attr-defined]
prompt_rows.covers = "prompt_encoder"  # type: ignore[attr-defined]
