"""Building everything a run needs from its config: data, partition, model, PEFT method, trainer.

Shared by every runtime, so that the embedded and a distributed runtime start from the same objects.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedpeft.algorithms import runtime_needs
from fedpeft.algorithms.base import ClientResources
from fedpeft.config import ConfigError, RunConfig
from fedpeft.data.batching import Encoded, ImageEncoded
from fedpeft.data.partition import partition, partition_stats
from fedpeft.data.prepare import TaskData, prepare_task, subset_eval
from fedpeft.models import registry
from fedpeft.models.images import ImageProcessing
from fedpeft.models.layout import ModelShape, uniform_shape
from fedpeft.models.registry import ModelKind
from fedpeft.training.local import LocalTrainer
from fedpeft.training.server import ServerModel
from fedpeft.tuners import TunedModel, apply_tuner, registered_peft_method
from fedpeft.tuners.analytic_ops import AnalyticOps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("fedpeft")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device: cuda, but torch sees no CUDA device on this machine; set "
                          "runtime.device to auto or cpu (or install a CUDA build of torch)")
    return torch.device(name)


@dataclass
class Experiment:
    """Everything one process of a run builds from its config before the rounds start (every runtime builds it
    the same way, :func:`build_experiment`)."""

    cfg: RunConfig
    tokenizer: PreTrainedTokenizerBase | ImageProcessing  # a vision transformer's image preprocessing takes its place
    kind: ModelKind
    encoder_decoder: bool
    data: TaskData
    parts: list[np.ndarray]  # each client's indices into data.train
    partition_stats: dict[str, Any]  # what partition.json records (fedpeft.data.partition.partition_stats)
    tuned: TunedModel
    shape: ModelShape | None  # None: a model of stages of different widths (Swin)
    device: torch.device
    trainer: LocalTrainer
    layout: object | None = None  # what the algorithm's RuntimeNeeds.layout built (e.g. a HeadLayout), or None
    server_part: np.ndarray | None = None  # training examples the server keeps (FedSP), not given to any client
    # eval.personalized: each client's held-out examples (indices into data.train, not in its training part)
    personal_parts: list[np.ndarray] | None = None

    @functools.cached_property
    def server_model(self) -> ServerModel | None:
        """The server's model and data shard, for algorithms that train on the server (RuntimeNeeds.server_model)."""
        if not runtime_needs(self.cfg.algorithm).server_model:
            return None
        data = self.data.train.subset(self.server_part if self.server_part is not None else np.arange(0))
        return ServerModel(self.cfg, self.tuned, data, self.tokenizer.pad_token_id, self.device)

    @functools.cached_property
    def client_resources(self) -> ClientResources:
        """What a client half may need besides its data: see fedpeft.algorithms.base.ClientContext."""
        special = {int(t) for a in ("eos_token_id", "sep_token_id") if (t := getattr(self.tokenizer, a, None)) is not None}
        return ClientResources(layout=self.layout, pad_id=self.tokenizer.pad_token_id, exclude_token_ids=special,
                               device=self.device, batch_size=self.cfg.eval.batch_size, seed=self.cfg.seed,
                               client_lr=self.cfg.train.lr, peft=self.cfg.peft)

    def client_data(self, cid: int) -> Encoded | ImageEncoded:
        return self.data.train.subset(self.parts[cid])

    def personal_data(self, cid: int) -> TaskData | None:
        """The task data with the client's held-out slice as its eval split (eval.personalized), or None when
        personalized evaluation is off or the client holds nothing out (a client of one example)."""
        if self.personal_parts is None or self.data.train_eval is None or not len(self.personal_parts[cid]):
            return None
        return replace(self.data, eval=subset_eval(self.data.train_eval, self.personal_parts[cid]))


def partition_column(cfg: RunConfig) -> np.ndarray | None:
    """The value of federation.partition.column for every training example (None for the other schemes)."""
    from fedpeft.data.partition import COLUMN_SCHEMES
    from fedpeft.data.prepare import train_column

    p = cfg.federation.partition
    if p.scheme not in COLUMN_SCHEMES or p.column is None:
        return None
    return train_column(cfg.task, p.column, cfg.seed)


def build_partition(cfg: RunConfig, data: TaskData,
                    column_values: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The clients' index arrays into the training set and the server's (None when it keeps none).
    ``column_values``: :func:`partition_column`'s answer, when the caller has it already."""
    p = cfg.federation.partition
    rng = np.random.default_rng([cfg.seed, 0xDA7A])
    n = len(data.train)
    share = runtime_needs(cfg.algorithm).server_data_fraction
    server = None
    rest = np.arange(n)
    if share > 0:
        order = np.random.default_rng([cfg.seed, 0x5E7]).permutation(n)
        k = max(1, round(share * n))
        server, rest = np.sort(order[:k]), np.sort(order[k:])
    labels = data.train_labels[rest] if data.train_labels is not None else None
    values = column_values if column_values is not None else partition_column(cfg)
    if values is not None and len(values) != n:
        raise RuntimeError(f"partition column: {len(values)} values for {n} training examples")
    parts = partition(
        p.scheme, cfg.federation.num_clients, rng, n=len(rest), labels=labels,
        alpha=p.alpha, size_alpha=p.size_alpha, min_size=p.min_size,
        categories=values[rest] if values is not None else None, column=p.column,
    )
    return [rest[part] for part in parts], server


def hold_out(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's part split into (training, held out): round(fraction x size) examples, at least one, drawn
    by a generator seeded by (seed, client); a client of one example keeps it for training."""
    train, held = [], []
    for cid, part in enumerate(parts):
        k = min(max(1, round(fraction * len(part))), len(part) - 1) if len(part) > 1 else 0
        order = np.random.default_rng([seed, cid, 0x9E5]).permutation(len(part))
        held.append(np.sort(part[order[:k]]))
        train.append(np.sort(part[order[k:]]))
    return train, held


def build_experiment(cfg: RunConfig) -> Experiment:
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    device = pick_device(cfg.runtime.device)
    if cfg.runtime.precision == "fp16" and device.type != "cuda":
        raise ConfigError("runtime.precision: fp16 needs a CUDA device and this run has none; set "
                          "runtime.precision to bf16 or fp32")
    tokenizer = registry.load_tokenizer(cfg.model.name)
    mconfig = registry.load_config(cfg.model.name)
    kind = registry.model_kind(cfg.task.type, mconfig)
    encdec = bool(getattr(mconfig, "is_encoder_decoder", False))
    personalized = cfg.eval.personalized
    data = prepare_task(cfg.task, tokenizer, encoder_decoder=encdec, seed=cfg.seed,
                        eval_max_examples=cfg.eval.max_examples, train_eval=personalized)
    values = partition_column(cfg)
    parts, server_part = build_partition(cfg, data, values)
    stats = partition_stats(parts, data.train_labels, values, column=cfg.federation.partition.column,
                            label_names=data.label_names)
    if server_part is not None:
        stats["server_examples"] = len(server_part)
    personal_parts = None
    if personalized:
        parts, personal_parts = hold_out(parts, cfg.eval.personal_fraction, cfg.seed)
        for entry, held in zip(stats["clients"], personal_parts):
            entry["personal_examples"] = len(held)  # out of its "size", held out of its training
    quantization = cfg.model.quantization
    model = registry.load_model(cfg.model.name, kind, num_labels=data.num_labels, dtype=cfg.model.dtype,
                                tokenizer=tokenizer, seed=cfg.seed, attn_implementation=cfg.model.attn_implementation,
                                quantization=quantization, device=str(device), dropout=cfg.model.dropout)
    if quantization is not None:  # k-bit training preparation: norms in float32, the backbone frozen
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(  # type: ignore[no-untyped-call]
            model, use_gradient_checkpointing=cfg.train.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    tuned = apply_tuner(model, cfg.peft, kind, tokenizer_path=registry.resolve(cfg.model.name).path,
                        tokenizer=tokenizer)
    if quantization is None:
        tuned.module.to(device)
    else:  # the quantized backbone was placed when it loaded; the method's new tensors may not be
        registry.place_on(tuned.module, device)
    shape = uniform_shape(mconfig)  # None for a model of stages (Swin) or without attention: OPs unknown
    options = cfg.peft.model_dump()
    declared = registered_peft_method(cfg.peft.method).analytic_ops
    ops_per_sequence = None  # a method that declares no analytic OPs (or a model without one shape): unknown
    if declared is not None and shape is not None:
        ops_per_sequence = functools.partial(_ops_per_sequence, declared, shape, options)
    trainer = LocalTrainer(cfg.train, device=device, pad_id=tokenizer.pad_token_id, precision=cfg.runtime.precision,
                           flops_sample_steps=cfg.runtime.flops_sample_steps, ops_per_sequence=ops_per_sequence)
    layout = runtime_needs(cfg.algorithm).build_layout(tuned, mconfig)
    return Experiment(cfg, tokenizer, kind, encdec, data, parts, stats, tuned, shape, device, trainer, layout,
                      server_part, personal_parts)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """transformers' gradient checkpointing of the backbone's blocks, non-reentrant (it needs no input that
    requires grad, so it works with a frozen embedding layer, and it keeps dropout's random state)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.gradient_checkpointing: {type(model).__name__} does not support gradient "
                          "checkpointing in transformers; set it to false")
    hf_model: Any = model  # (a transformers PreTrainedModel: torch's Module typing does not know the method)
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _ops_per_sequence(declared: AnalyticOps, shape: ModelShape, options: dict[str, Any], T: int,
                      head_fraction: float = 1.0) -> float:
    terms = declared(shape.num_attention_modules, shape.hidden, T, options, shape.num_heads)
    return terms.appendix_a_ops(head_fraction)
