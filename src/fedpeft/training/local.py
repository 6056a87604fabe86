"""Local training on one client: a plain PyTorch loop over dynamically padded batches.

The optimizer and learning-rate schedule are created fresh every round (stateless clients), over
the trainable parameters only. FLOPs are measured with ``torch.utils.flop_counter.FlopCounterMode``
on the first ``flops_sample_steps`` steps and scaled to the whole round by the number of (padded)
tokens processed; analytic OPs (paper 000, Appendix A) are summed over every sequence.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedpeft.config.schema import TrainConfig
from fedpeft.data.batching import Encoded, collate, length_grouped_batches, shuffled_batches


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/Inf loss; the client's update is not sent."""


@dataclass
class TrainResult:
    loss: float  # mean training loss over the last local epoch (all steps when local_steps is set)
    steps: int
    examples: int  # examples processed, repeats included
    tokens: int  # padded tokens processed
    seconds: float
    flops: float | None  # measured (sampled steps scaled by tokens); None when sampling is off
    flops_sampled_steps: int
    ops_analytic: float

    def as_meta(self) -> dict:
        return {f"train_{k}" if not k.startswith("train") else k: v for k, v in asdict(self).items()}


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    warmup = int(round(cfg.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if cfg.scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def plan_batches(data: Encoded, cfg: TrainConfig, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """Batches per epoch; with local_steps, enough epochs to cover exactly that many steps."""

    def epoch() -> list[np.ndarray]:
        if cfg.length_grouping:
            return length_grouped_batches(data.lengths(), cfg.batch_size, rng)
        return shuffled_batches(len(data), cfg.batch_size, rng)

    if cfg.local_steps is None:
        return [epoch() for _ in range(cfg.local_epochs)]
    epochs, left = [], cfg.local_steps
    while left > 0:
        e = epoch()[:left]
        epochs.append(e)
        left -= len(e)
    return epochs


class LocalTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        device: torch.device,
        pad_id: int,
        precision: str = "fp32",
        flops_sample_steps: int = 1,
        ops_per_sequence: Callable[[int], float] | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.pad_id = pad_id
        self.precision = precision
        self.flops_sample_steps = flops_sample_steps
        self.ops_per_sequence = ops_per_sequence
        self._ops_cache: dict[int, float] = {}

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _ops(self, batch_size: int, length: int) -> float:
        if self.ops_per_sequence is None:
            return 0.0
        if length not in self._ops_cache:
            self._ops_cache[length] = self.ops_per_sequence(length)
        return batch_size * self._ops_cache[length]

    def train(
        self,
        tuned,
        data: Encoded,
        rng: np.random.Generator,
        *,
        extra_loss: Callable[[], torch.Tensor] | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> TrainResult:
        """Train ``tuned.module`` on ``data``; ``before_step`` may edit gradients (e.g. masking)."""
        model = tuned.module
        params = list(tuned.params.values())
        cfg = self.cfg
        epochs = plan_batches(data, cfg, rng)
        total = sum(len(e) for e in epochs)
        optimizer = make_optimizer(params, cfg)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
        scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        model.train()
        start = time.perf_counter()
        steps = examples = tokens = 0
        sampled_flops = 0.0
        sampled_tokens = sampled_steps = 0
        ops = 0.0
        last_epoch_losses: list[float] = []
        for e_idx, batches in enumerate(epochs):
            epoch_losses = []
            for idx in batches:
                batch = {k: v.to(self.device) for k, v in collate(data, idx, self.pad_id).items()}
                n_tok = int(batch["input_ids"].numel())
                measure = sampled_steps < self.flops_sample_steps
                counter = FlopCounterMode(display=False) if measure else contextlib.nullcontext()
                with counter:
                    with self._autocast():
                        loss = model(**batch).loss
                        if extra_loss is not None:
                            loss = loss + extra_loss()
                    if not torch.isfinite(loss):
                        raise NonFiniteLoss(f"non-finite training loss ({loss.item()}) at local step {steps + 1}")
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                if measure:
                    sampled_flops += counter.get_total_flops()
                    sampled_tokens += n_tok
                    sampled_steps += 1
                if before_step is not None:
                    before_step()
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if cfg.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                epoch_losses.append(float(loss.detach()))
                steps += 1
                examples += len(idx)
                tokens += n_tok
                ops += self._ops(len(idx), int(batch["input_ids"].shape[1]))
            last_epoch_losses = epoch_losses if cfg.local_steps is None else last_epoch_losses + epoch_losses
        seconds = time.perf_counter() - start
        flops = sampled_flops / sampled_tokens * tokens if sampled_tokens else None
        return TrainResult(
            loss=float(np.mean(last_epoch_losses)) if last_epoch_losses else float("nan"),
            steps=steps, examples=examples, tokens=tokens, seconds=seconds, flops=flops,
            flops_sampled_steps=sampled_steps, ops_analytic=ops,
        )
