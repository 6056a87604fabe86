"""The memory estimate (fedpeft.metrics.memory): saved activations counted on the meta device are those of the
real model, the parts add up, checkpointing and precision order them as they must, and `fedpeft model --memory`
prints them for shapes without weights."""

from __future__ import annotations

import json

import pytest
import torch

from fedpeft.cli import main
from fedpeft.config import load_config
from fedpeft.metrics import memory
from fedpeft.models import registry
from fedpeft.models.architectures import architecture_config, build_on_meta
from fedpeft.tuners import apply_tuner

LORA = load_config(None, ["peft={method: lora, r: 8}"]).peft


def test_activations_counted_on_the_meta_device_are_the_real_models():
    tok = registry.load_tokenizer("tiny-llama")
    real = apply_tuner(registry.load_model("tiny-llama", "causal", tokenizer=tok), LORA, "causal").module.train()
    meta = apply_tuner(build_on_meta(real.get_base_model().config, "causal"), LORA, "causal").module.train()
    (meta_sum, meta_largest), (real_sum, real_largest) = (memory._saved_bytes(m, 3, 20, "causal") for m in (meta, real))
    assert meta_largest == real_largest == 3 * 20 * real.get_base_model().config.vocab_size * 4  # float32 logits
    # the same tensors but for the attention kernel's own (meta and CPU choose different SDPA kernels): 0.5% here
    assert meta_sum == pytest.approx(real_sum, rel=0.01)


def test_the_estimate_adds_up_and_orders_precisions_and_checkpointing():
    config = architecture_config("llama-3.2-1b")
    est = {(p, c): memory.estimate_training("llama-3.2-1b", config, LORA, "causal", p, batch_size=2, tokens=64,
                                            gradient_checkpointing=c) for p in memory.PRECISIONS for c in (False, True)}
    fp32 = est["float32", False]
    assert fp32.parameters == 1_235_814_400  # Llama 3.2 1B (tied embeddings)
    assert fp32.backbone_bytes == 4 * fp32.parameters + sum(b.numel() * b.element_size()
                                                             for b in build_on_meta(config, "causal").buffers())
    assert fp32.total_bytes == (fp32.backbone_bytes + fp32.trainable_state_bytes + fp32.activation_bytes
                                + fp32.transient_bytes)
    # LoRA r8 on q and v: its tensors, their gradients and two AdamW moments in float32
    assert fp32.trainable_state_bytes == 4 * 4 * fp32.trainable
    backbones = [est[p, False].backbone_bytes for p in memory.PRECISIONS]
    assert backbones == sorted(backbones, reverse=True)
    for p in memory.PRECISIONS:
        assert est[p, True].activation_bytes < est[p, False].activation_bytes / 3
    assert est["bfloat16", False].activation_bytes < fp32.activation_bytes
    # the logits (batch x tokens x vocabulary, float32) dominate the transient
    assert fp32.transient_bytes == 2 * 2 * 64 * 128_256 * 4
    with pytest.raises(ValueError, match="precision 'fp8'"):
        memory.estimate_training("x", config, LORA, "causal", "fp8", batch_size=1, tokens=8)


def test_fedpeft_model_memory_for_an_8b_shape(capsys):
    assert main(["model", "llama-3.1-8b", "--methods", "lora", "--memory", "--batch-size", "1", "--tokens", "256",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["memory"]
    assert [(r["precision"], r["gradient_checkpointing"]) for r in rows] == [
        (p, c) for p in memory.PRECISIONS for c in (False, True)]
    nf4 = next(r for r in rows if r["precision"] == "nf4" and r["gradient_checkpointing"])
    # 6.98 B weights in linear layers at ~0.52 bytes (3.65 GB) + embeddings and LM head (2 x 525 M) kept float32 (4.2 GB)
    assert 7.5e9 < nf4["backbone_bytes"] < 8.1e9 and nf4["parameters"] == 8_030_261_248
    assert main(["model", "llama-3.1-8b", "--methods", "lora", "--memory"]) == 0
    assert "one client's training memory" in capsys.readouterr().out


def test_held_bytes_count_a_shared_storage_once():
    shared = torch.nn.Linear(4, 4, bias=False)
    model = torch.nn.Sequential(shared, shared)
    assert memory.held_bytes(model) == 4 * 16


def test_fedpeft_model_memory_says_how_many_clients_train_together_in_a_device(capsys):
    assert main(["model", "llama-3.2-1b", "--methods", "lora", "--memory", "--batch-size", "2", "--tokens", "128",
                 "--device-memory", "24", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["memory"]
    for r in rows:  # the backbone once, the rest once per client
        assert r["per_client_bytes"] == r["trainable_state_bytes"] + r["activation_bytes"] + r["transient_bytes"]
        fit = r["clients_per_pass_fit"]
        assert r["backbone_bytes"] + fit * r["per_client_bytes"] <= 24 * 2**30
        assert r["backbone_bytes"] + (fit + 1) * r["per_client_bytes"] > 24 * 2**30
    by = {(r["precision"], r["gradient_checkpointing"]): r["clients_per_pass_fit"] for r in rows}
    assert by["float32", True] > by["float32", False] > 0
    assert main(["model", "llama-3.2-1b", "--methods", "lora,full", "--device-memory", "24"]) == 0  # implies --memory
    out = capsys.readouterr().out
    assert "clients per pass in 24 GiB (off / on)" in out
    assert next(line for line in out.splitlines() if line.startswith("full ") and "float32" in line).endswith(
        "alone / alone")
    assert main(["model", "llama-3.2-1b", "--methods", "lora", "--memory", "--device-memory", "0"]) != 0
    assert "--device-memory 0.0: give the device's memory in GiB" in capsys.readouterr().err
