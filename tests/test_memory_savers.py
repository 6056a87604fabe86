"""Memory savers: gradient accumulation equals the large batch, gradient checkpointing gives the same training,
and runs report their memory (backbone bytes, peak RSS) and effective batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_config

from fedpeft.config import ConfigError, load_config
from fedpeft.config.schema import TrainConfig
from fedpeft.data.batching import Encoded
from fedpeft.models import registry
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run
from fedpeft.runtime.setup import enable_gradient_checkpointing
from fedpeft.training.local import LocalTrainer
from fedpeft.tuners import apply_tuner, method_options


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _data(kind: str, n: int = 16) -> Encoded:
    rng = np.random.default_rng(7)
    ids = [rng.integers(5, 90, size=int(rng.integers(6, 20))).astype(np.int64) for _ in range(n)]
    if kind == "classification":
        return Encoded(ids, [int(x) for x in rng.integers(0, 2, size=n)])
    labels = []
    for i, s in enumerate(ids):  # every other row: a masked prompt half (so the first label is a target or not)
        lab = s.copy()
        if i % 2:
            lab[: len(s) // 2] = -100
        labels.append(lab)
    return Encoded(ids, labels)


def _train(name: str, kind: str, method: str, n: int = 16, **train) -> tuple[dict[str, np.ndarray], object]:
    tok = registry.load_tokenizer(name)
    model = registry.load_model(name, kind, num_labels=2, tokenizer=tok, seed=1)
    if train.pop("checkpointing", False):
        enable_gradient_checkpointing(model)
        assert model.is_gradient_checkpointing
    tuned = apply_tuner(model, method_options(method), kind)
    _no_dropout(tuned.module)  # the backbone's and LoRA's: the micro-batches draw other masks than the large batch
    # SGD: Adam divides by the gradient's own size, which turns float noise in near-zero entries into steps
    cfg = TrainConfig(length_grouping=False, max_grad_norm=None, optimizer="sgd", lr=0.5, **train)
    trainer = LocalTrainer(cfg, device=torch.device("cpu"), pad_id=tok.pad_token_id, flops_sample_steps=0)
    torch.manual_seed(0)
    result = trainer.train(tuned, _data(kind, n), np.random.default_rng(3))
    return tuned.state(), result


@pytest.mark.parametrize("name, kind, method", [("tiny-bert", "classification", "lora"),
                                                 ("tiny-llama", "causal", "lora"),
                                                 ("tiny-llama", "causal", "prompt_tuning"),
                                                 ("tiny-gpt2", "causal", "houlsby")])
def test_accumulated_micro_batches_take_the_large_batch_step(name, kind, method):
    """Two optimizer steps of 8 examples, once as batches of 8 and once as 4 x 2 accumulated: the same
    parameters. Stepping after every micro-batch (4 steps) lands elsewhere, which this test would catch."""
    large, r_large = _train(name, kind, method, batch_size=8)
    accumulated, r_acc = _train(name, kind, method, batch_size=4, gradient_accumulation_steps=2)
    per_micro, r_micro = _train(name, kind, method, batch_size=4)
    assert (r_large.steps, r_acc.steps, r_micro.steps) == (2, 2, 4)
    assert r_acc.examples == r_large.examples == 16 and r_acc.tokens >= 0
    assert r_acc.loss == pytest.approx(r_large.loss, rel=1e-5)
    for k in large:
        np.testing.assert_allclose(accumulated[k], large[k], rtol=1e-4, atol=1e-6)
    assert max(float(np.abs(per_micro[k] - large[k]).max()) for k in large) > 1e-4


@pytest.mark.parametrize("name, kind", [("tiny-bert", "classification"), ("tiny-llama", "causal")])
def test_an_uneven_last_group_is_weighted_like_the_large_batch(name, kind):
    """14 examples: a step of 12 then one of 2, as batches of 12 and as 4 x 3 accumulated (the last group a
    single micro-batch of 2): the loss of each step is the mean over its own examples (or target tokens)."""
    large, r_large = _train(name, kind, "lora", n=14, batch_size=12)
    accumulated, r_acc = _train(name, kind, "lora", n=14, batch_size=4, gradient_accumulation_steps=3)
    assert r_large.steps == r_acc.steps == 2 and r_acc.examples == 14
    for k in large:
        np.testing.assert_allclose(accumulated[k], large[k], rtol=1e-4, atol=1e-6)


def test_local_steps_count_optimizer_steps_under_accumulation():
    _, result = _train("tiny-bert", "classification", "lora", batch_size=4, gradient_accumulation_steps=3,
                       local_steps=2)
    assert result.steps == 2 and result.examples == 24  # 2 steps x 3 micro-batches x 4, across an epoch's end


def test_gradient_checkpointing_gives_the_same_training():
    plain, r_plain = _train("tiny-llama", "causal", "lora", batch_size=4)
    checkpointed, r_ckpt = _train("tiny-llama", "causal", "lora", batch_size=4, checkpointing=True)
    assert r_ckpt.loss == pytest.approx(r_plain.loss, rel=1e-6)
    for k in plain:
        np.testing.assert_allclose(checkpointed[k], plain[k], rtol=1e-5, atol=1e-7)


@pytest.mark.needs_data
def test_a_run_reports_its_memory_and_effective_batch(tmp_path):
    cfg = tiny_config("train.batch_size=4", "train.gradient_accumulation_steps=2", "train.gradient_checkpointing=true",
                      "model.attn_implementation=eager")
    summary = run(cfg, tmp_path / "run")
    assert summary["effective_batch_size"] == 8 and summary["peak_rss_mb"] > 0
    assert summary["backbone_bytes"] > summary["trainable_bytes"] > 0 and summary["peak_accelerator_mb"] is None
    rows = read_metrics(tmp_path / "run")
    assert all(r["peak_rss_mb"] > 0 and r["backbone_bytes"] == summary["backbone_bytes"] for r in rows)
    assert "effective batch 8 per optimizer step; gradient checkpointing on" in (tmp_path / "run" / "events.log").read_text()
    half = run(tiny_config("model.dtype=bfloat16"), tmp_path / "bf16")
    assert half["backbone_bytes"] < 0.55 * summary["backbone_bytes"]  # bf16 weights, trained end to end
    assert np.isfinite(read_metrics(tmp_path / "bf16")[-1]["train_loss"])


def test_prefix_tuning_refuses_checkpointing():
    with pytest.raises(ConfigError, match="train.gradient_checkpointing drops the prefixes"):
        load_config(None, ["peft.method=prefix_tuning", "train.gradient_checkpointing=true"])


def test_options_are_checked():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        load_config(None, ["train.gradient_accumulation_steps=0"])
    with pytest.raises(ConfigError, match="attn_implementation"):
        load_config(None, ["model.attn_implementation=fast"])
