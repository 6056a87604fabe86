"""Knowledge distillation of last hidden states (FedSP's initialisation of the auxiliary model, paper 003 Eq. 2).

Student and teacher read the same batches; the loss is the mean squared error between the teacher's
last hidden states (after its final norm) and the student's, through a learnable linear map when their
widths differ. Padded positions are left out of the mean (the reference code averages over them too;
with dynamic padding they would weigh each batch differently). No prompts are attached to either model.
Every trainable parameter of the student is updated (the reference trains embeddings, blocks and norm),
with AdamW and a linear schedule with warm-up, as the reference does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedpeft.config.schema import TrainConfig
from fedpeft.data.batching import Encoded, collate
from fedpeft.training.local import lr_lambda, make_optimizer, plan_batches


@dataclass
class DistillResult:
    steps: int
    first_loss: float  # mean over the first 10% of steps
    last_loss: float  # mean over the last 10% of steps
    seconds: float


def last_hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's output after its final norm, (batch, tokens, width)."""
    return model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            use_cache=False).last_hidden_state


def masked_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of (student - teacher)^2 over the unpadded positions and the width, in fp32."""
    m = mask.unsqueeze(-1).float()
    return ((student.float() - teacher.float()) ** 2 * m).sum() / (m.sum() * student.shape[-1])


def distill_hidden_states(student: nn.Module, teacher: nn.Module, data: Encoded, *, steps: int, lr: float,
                          batch_size: int, pad_id: int, seed: int, device: torch.device,
                          weight_decay: float = 0.01, warmup_ratio: float = 0.1) -> DistillResult:
    """Train ``student`` for ``steps`` steps to reproduce ``teacher``'s last hidden states on ``data``."""
    if len(data) == 0:
        raise ValueError("distillation needs at least one example")
    cfg = TrainConfig(local_steps=steps, batch_size=batch_size, lr=lr, optimizer="adamw", weight_decay=weight_decay,
                      scheduler="linear", warmup_ratio=warmup_ratio, max_grad_norm=1.0)
    t_width, s_width = teacher.config.hidden_size, student.config.hidden_size
    dtype = next(student.parameters()).dtype
    projection = nn.Linear(s_width, t_width, bias=False).to(device, dtype) if s_width != t_width else None
    params = [p for p in student.parameters() if p.requires_grad]
    if projection is not None:
        params += list(projection.parameters())
    optimizer = make_optimizer(params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps))
    rng = np.random.default_rng([seed, 0xD157])
    teacher.eval()
    student.train()
    losses: list[float] = []
    start = time.perf_counter()
    for batches in plan_batches(data, cfg, rng):
        for idx in batches:
            batch = {k: v.to(device) for k, v in collate(data, idx, pad_id).items()}
            with torch.no_grad():
                target = last_hidden(teacher, batch)
            hidden = last_hidden(student, batch)
            if projection is not None:
                hidden = projection(hidden)
            loss = masked_mse(hidden, target, batch["attention_mask"])
            if not torch.isfinite(loss):
                raise RuntimeError(f"distillation loss became {loss.item()} at step {len(losses) + 1}; lower the lr")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    student.eval()
    tenth = max(1, len(losses) // 10)
    return DistillResult(steps=len(losses), first_loss=float(np.mean(losses[:tenth])),
                         last_loss=float(np.mean(losses[-tenth:])), seconds=time.perf_counter() - start)
