"""Local training on one client: a plain PyTorch loop over dynamically padded batches.

The optimizer and learning-rate schedule are created fresh every round over the trainable parameters
only (stateless clients); an algorithm that keeps a client's optimizer moments between rounds passes
them in and gets them back through ``optimizer_state``. FLOPs are measured with
``torch.utils.flop_counter.FlopCounterMode`` (:func:`fedpeft.metrics.flops.flop_counter`: attention counted
as the model's products on torch's kernels) on sampled steps: the first step of each client training until the
run's budget of
``flops_sample_steps`` is used (counting costs about two extra steps' time, so it is not done on every
step). Every step is then charged (measured FLOPs / measured tokens) x its padded tokens; the rate
depends only on the model and method, so a few samples suffice. Analytic OPs (paper 000, Appendix A)
are summed over every sequence at its padded length.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fedpeft.config.schema import TrainConfig
from fedpeft.data.batching import (
    Encoded,
    ImageEncoded,
    collate,
    length_grouped_batches,
    shuffled_batches,
)
from fedpeft.metrics.flops import flop_counter
from fedpeft.wire import clock_text


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/Inf loss; the client's update is not sent."""


@dataclass
class TrainResult:
    loss: float  # mean training loss over the last local epoch (all steps when local_steps is set)
    steps: int
    examples: int  # examples processed, repeats included
    tokens: int  # padded tokens processed
    seconds: float
    flops: float | None  # measured FLOPs per token (run-level samples) x tokens; None when sampling is off
    flops_sampled_steps: int  # steps of this training that were measured (0 or 1)
    ops_analytic: float | None  # paper 000 Appendix A OPs; None when the PEFT method declares no analytic_ops

    def plus(self, other: TrainResult) -> TrainResult:
        """Two trainings of one client in one round as one: counts and times added, the loss of ``other``."""
        flops = None if self.flops is None and other.flops is None else (self.flops or 0.0) + (other.flops or 0.0)
        return TrainResult(loss=other.loss, steps=self.steps + other.steps, examples=self.examples + other.examples,
                           tokens=self.tokens + other.tokens, seconds=self.seconds + other.seconds, flops=flops,
                           flops_sampled_steps=self.flops_sampled_steps + other.flops_sampled_steps,
                           ops_analytic=None if self.ops_analytic is None or other.ops_analytic is None
                           else self.ops_analytic + other.ops_analytic)

    def as_meta(self) -> dict:
        """Metadata for the upload; ``train_seconds`` is clock text (read it with wire.clock_seconds)."""
        meta = {f"train_{k}" if not k.startswith("train") else k: v for k, v in asdict(self).items()}
        meta["train_seconds"] = clock_text(self.seconds)
        if self.flops is not None:
            meta["train_flops"] = clock_text(self.flops)  # an estimate: fixed width, like the clock
        return meta


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def read_optimizer_state(optimizer: torch.optim.Optimizer,
                         params: dict[str, torch.nn.Parameter]) -> dict[str, dict[str, np.ndarray]]:
    """The optimizer's per-parameter state (e.g. Adam's exp_avg, exp_avg_sq, step) as numpy, by name."""
    def plain(value):  # scalars (Adam's step) as floats, tensors as float32 arrays (numpy has no bfloat16)
        if torch.is_tensor(value) and value.ndim:
            return value.detach().to("cpu", torch.float32).numpy().copy()
        return float(value)

    return {name: {k: plain(v) for k, v in optimizer.state[p].items()}
            for name, p in params.items() if p in optimizer.state}


def load_optimizer_state(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                         state: dict[str, dict[str, np.ndarray]]) -> None:
    """Write back what :func:`read_optimizer_state` returned (parameters of the same names and shapes)."""
    for name, entries in state.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"optimizer state for unknown parameter {name!r}")
        loaded = {}
        for k, v in entries.items():
            t = torch.from_numpy(np.array(v, dtype=np.float32))
            if t.ndim == 0:  # a scalar such as Adam's step counter, on the CPU unless the optimizer is capturable
                loaded[k] = t
                continue
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {name}.{k}: shape {tuple(t.shape)} != parameter {tuple(p.shape)}")
            loaded[k] = t.to(p.device, p.dtype)
        optimizer.state[p] = loaded


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    warmup = round(cfg.warmup_ratio * total_steps)

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
    """(Micro-)batches of batch_size per epoch; with local_steps, enough epochs to cover exactly that many
    optimizer steps of gradient_accumulation_steps micro-batches each."""

    def epoch() -> list[np.ndarray]:
        if cfg.length_grouping:
            return length_grouped_batches(data.lengths(), cfg.batch_size, rng)
        return shuffled_batches(len(data), cfg.batch_size, rng)

    if cfg.local_steps is None:
        return [epoch() for _ in range(cfg.local_epochs)]
    epochs, left = [], cfg.local_steps * cfg.gradient_accumulation_steps
    while left > 0:
        e = epoch()[:left]
        epochs.append(e)
        left -= len(e)
    return epochs


def step_groups(epochs: list[list[np.ndarray]], cfg: TrainConfig) -> list[list[list[np.ndarray]]]:
    """The micro-batches of each optimizer step, per epoch: gradient_accumulation_steps at a time (an epoch's
    last step may take fewer); with local_steps, across epoch boundaries, so that every step takes them all."""
    k = cfg.gradient_accumulation_steps
    if cfg.local_steps is not None:
        epochs = [[b for e in epochs for b in e]]
    return [[e[i:i + k] for i in range(0, len(e), k)] for e in epochs]


def loss_terms(batch: dict[str, torch.Tensor], shifted: bool) -> int:
    """How many terms the model's mean loss over ``batch`` averages: examples for one label per example,
    target tokens for language modelling (``shifted``: after the causal shift, which drops the first label)."""
    labels = batch["labels"]
    if labels.dim() == 1:
        return int(labels.shape[0])
    if shifted:
        labels = labels[:, 1:]
    return int((labels != -100).sum())


def drops_first_label(model: torch.nn.Module) -> bool:
    """Whether the model's causal shift drops each sequence's first label: decoder-only models, unless HF peft
    prepends virtual input tokens (prompt tuning, P-tuning: their -100 labels go in front, so the first label
    of the data is predicted from the last virtual token)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    peft_config = getattr(model, "active_peft_config", None)
    return not (peft_config is not None and peft_config.is_prompt_learning
                and str(peft_config.peft_type.value) != "PREFIX_TUNING")


class LocalTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        device: torch.device,
        pad_id: int | None,
        precision: str = "fp32",
        flops_sample_steps: int = 1,
        ops_per_sequence: Callable[[int, float], float] | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.pad_id = pad_id
        self.precision = precision
        self.flops_sample_steps = flops_sample_steps
        self.ops_per_sequence = ops_per_sequence
        self._ops_cache: dict[tuple[int, float], float] = {}
        self.flops_measured = 0.0  # run-level FLOP samples: totals over the measured steps
        self.flops_tokens = 0
        self.flops_steps = 0
        # called with (steps done, steps in all) after each optimizer step: the runtime's progress inside a round
        self.on_step: Callable[[int, int], None] | None = None

    def flops_per_token(self) -> float | None:
        return self.flops_measured / self.flops_tokens if self.flops_tokens else None

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _ops(self, batch_size: int, length: int, head_fraction: float) -> float:
        key = (length, head_fraction)
        if key not in self._ops_cache:
            self._ops_cache[key] = self.ops_per_sequence(length, head_fraction)
        return batch_size * self._ops_cache[key]

    def train(
        self,
        tuned,
        data: Encoded | ImageEncoded,
        rng: np.random.Generator,
        *,
        extra_loss: Callable[[], torch.Tensor] | None = None,
        before_step: Callable[[], None] | None = None,
        after_step: Callable[[], None] | None = None,
        head_fraction: float = 1.0,
        optimizer_state: dict[str, dict[str, np.ndarray]] | None = None,
        lr: float | None = None,
    ) -> TrainResult:
        """Train ``tuned.module`` on ``data``; ``before_step`` may edit gradients (e.g. masking) before clipping
        and the optimizer step, ``after_step`` may edit parameters right after it. ``head_fraction`` (kept
        heads / all heads) only changes the analytic OPs count (fedpeft.metrics.ops). ``optimizer_state``
        (parameter name -> the optimizer's per-parameter state, e.g. Adam's moments and step) is loaded
        before the first step when given and replaced by the state after the last step. ``lr`` replaces the
        train section's learning rate for this training."""
        model = tuned.module
        params = list(tuned.params.values())
        cfg = self.cfg if lr is None else self.cfg.model_copy(update={"lr": lr})
        epochs = step_groups(plan_batches(data, cfg, rng), cfg)
        total = sum(len(e) for e in epochs)
        lengths = data.lengths()
        shifted = drops_first_label(model)
        optimizer = make_optimizer(params, cfg)
        if optimizer_state:
            load_optimizer_state(optimizer, tuned.params, optimizer_state)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total))
        scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        model.train()
        start = time.perf_counter()
        steps = examples = tokens = 0
        sampled_steps = 0
        ops = 0.0
        last_epoch_losses: list[float] = []
        for groups in epochs:
            epoch_losses = []
            for group in groups:
                batches = [collate(data, idx, self.pad_id) for idx in group]  # counted on the host
                terms = [loss_terms(batch, shifted) for batch in batches] if len(group) > 1 else [1]
                total_terms = sum(terms) or len(terms)  # (no target at all: the loss is NaN and refused below)
                step_loss = 0.0
                for idx, batch, n_terms in zip(group, batches, terms):
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    # a micro-batch's mean loss, weighted by its share of the step's loss terms: the step's
                    # gradient is the large batch's (one micro-batch: weight 1, the loss untouched)
                    weight = n_terms / total_terms if len(group) > 1 else None
                    width = int(lengths[idx].max())  # the padded batch's length (an image: its tokens)
                    n_tok = len(idx) * width
                    measure = sampled_steps == 0 and self.flops_steps < self.flops_sample_steps
                    counter = flop_counter() if measure else contextlib.nullcontext()
                    with counter:
                        with self._autocast():
                            loss = model(**batch).loss
                            if extra_loss is not None:
                                loss = loss + extra_loss()
                        if not torch.isfinite(loss):
                            raise NonFiniteLoss(f"non-finite training loss ({loss.item()}) at local step {steps + 1}")
                        scaled = loss if weight is None else loss * weight
                        if scaler is not None:
                            scaler.scale(scaled).backward()
                        else:
                            scaled.backward()
                    if measure:
                        self.flops_measured += counter.get_total_flops()
                        self.flops_tokens += n_tok
                        self.flops_steps += 1
                        sampled_steps += 1
                    step_loss = float(loss.detach()) if weight is None else step_loss + float(loss.detach()) * weight
                    examples += len(idx)
                    tokens += n_tok
                    if self.ops_per_sequence is not None:
                        ops += self._ops(len(idx), width, head_fraction)
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
                if after_step is not None:
                    after_step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                epoch_losses.append(step_loss)
                steps += 1
                if self.on_step is not None:
                    self.on_step(steps, total)
            last_epoch_losses = epoch_losses if cfg.local_steps is None else last_epoch_losses + epoch_losses
        seconds = time.perf_counter() - start
        if optimizer_state is not None:
            optimizer_state.clear()
            optimizer_state.update(read_optimizer_state(optimizer, tuned.params))
        rate = self.flops_per_token()
        flops = rate * tokens if rate is not None else None
        return TrainResult(
            loss=float(np.mean(last_epoch_losses)) if last_epoch_losses else float("nan"),
            steps=steps, examples=examples, tokens=tokens, seconds=seconds, flops=flops,
            flops_sampled_steps=sampled_steps, ops_analytic=ops if self.ops_per_sequence is not None else None,
        )
