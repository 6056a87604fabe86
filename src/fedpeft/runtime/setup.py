"""Building everything a run needs from its config: data, partition, model, PEFT method, trainer.

Shared by every runtime, so that the embedded and a distributed runtime start from the same objects.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpeft.algorithms import needs_head_layout, needs_prefix_layout
from fedpeft.config import RunConfig
from fedpeft.data.partition import partition, partition_stats
from fedpeft.data.prepare import TaskData, prepare_task
from fedpeft.heads import build_layout
from fedpeft.metrics.ops import sequence_ops
from fedpeft.models import registry
from fedpeft.models.layout import ModelShape, model_shape
from fedpeft.training.local import LocalTrainer
from fedpeft.tuners import TunedModel, apply_tuner
from fedpeft.tuners.prefix_layers import prefix_layout

log = logging.getLogger("fedpeft")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("runtime.device is cuda but no CUDA device is available; use auto or cpu")
    return torch.device(name)


@dataclass
class Experiment:
    cfg: RunConfig
    tokenizer: Any
    kind: str  # classification | causal | seq2seq
    encoder_decoder: bool
    data: TaskData
    parts: list[np.ndarray]
    partition_stats: dict[str, Any]
    tuned: TunedModel
    shape: ModelShape
    device: torch.device
    trainer: LocalTrainer
    head_layout: Any = None  # fedpeft.heads.HeadLayout, for algorithms that work per attention head
    prefix_layout: Any = None  # fedpeft.tuners.prefix_layers.PrefixLayout, for algorithms that work per layer

    @property
    def algorithm_layout(self) -> Any:
        """The layout the algorithm asked for (see ServerAlgorithm.needs_*_layout), or None."""
        return self.head_layout if self.head_layout is not None else self.prefix_layout

    @functools.cached_property
    def client_resources(self) -> dict[str, Any]:
        """What a client half may need besides its data: see fedpeft.algorithms.base.ClientContext."""
        special = {getattr(self.tokenizer, a, None) for a in ("eos_token_id", "sep_token_id")} - {None}
        return {"layout": self.algorithm_layout, "pad_id": self.tokenizer.pad_token_id, "exclude_token_ids": special,
                "device": self.device, "batch_size": self.cfg.eval.batch_size, "seed": self.cfg.seed,
                "client_lr": self.cfg.train.lr}

    def client_data(self, cid: int):
        return self.data.train.subset(self.parts[cid])


def build_partition(cfg: RunConfig, data: TaskData) -> list[np.ndarray]:
    p = cfg.federation.partition
    rng = np.random.default_rng([cfg.seed, 0xDA7A])
    return partition(
        p.scheme, cfg.federation.num_clients, rng, n=len(data.train), labels=data.train_labels,
        alpha=p.alpha, size_alpha=p.size_alpha, min_size=p.min_size,
    )


def build_experiment(cfg: RunConfig) -> Experiment:
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    device = pick_device(cfg.runtime.device)
    if cfg.runtime.precision == "fp16" and device.type != "cuda":
        raise RuntimeError("runtime.precision fp16 needs a CUDA device; use bf16 or fp32")
    tokenizer = registry.load_tokenizer(cfg.model.name)
    mconfig = registry.load_config(cfg.model.name)
    kind = registry.model_kind(cfg.task.type, mconfig)
    encdec = bool(getattr(mconfig, "is_encoder_decoder", False))
    data = prepare_task(cfg.task, tokenizer, encoder_decoder=encdec, seed=cfg.seed, eval_max_examples=cfg.eval.max_examples)
    parts = build_partition(cfg, data)
    stats = partition_stats(parts, data.train_labels)
    model = registry.load_model(cfg.model.name, kind, num_labels=data.num_labels, dtype=cfg.model.dtype,
                                tokenizer=tokenizer, seed=cfg.seed)
    tuned = apply_tuner(model, cfg.peft, kind, tokenizer_path=registry.resolve(cfg.model.name).path)
    tuned.module.to(device)
    shape = model_shape(mconfig)
    options = cfg.peft.model_dump()

    def ops_per_sequence(T: int, head_fraction: float = 1.0) -> float:
        return sequence_ops(cfg.peft.method, shape.num_attention_modules, shape.hidden, T, options, head_fraction)

    trainer = LocalTrainer(cfg.train, device=device, pad_id=tokenizer.pad_token_id, precision=cfg.runtime.precision,
                           flops_sample_steps=cfg.runtime.flops_sample_steps, ops_per_sequence=ops_per_sequence)
    layout = None
    if needs_head_layout(cfg.algorithm):
        layout = build_layout(tuned.spec(), mconfig, cfg.peft.method)
    prefix = prefix_layout(tuned) if needs_prefix_layout(cfg.algorithm) else None
    return Experiment(cfg, tokenizer, kind, encdec, data, parts, stats, tuned, shape, device, trainer, layout, prefix)
