"""Quantized backbones (model.quantization, bitsandbytes' CPU backend here): 4-bit and 8-bit rounds, the PEFT
methods and algorithms that train over them or are refused with the reason, and the adapter reloading onto the
quantized base with the run's score."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config

from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.config.schema import QuantizationOptions
from fedpeft.models import registry
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run
from fedpeft.tuners import apply_tuner, method_options

bnb = pytest.importorskip("bitsandbytes")  # in the test extras; a plain install names the extra (tested below)


def _quantized(name: str, kind: str, bits: int):
    from peft import prepare_model_for_kbit_training

    tok = registry.load_tokenizer(name)
    model = registry.load_model(name, kind, num_labels=2, tokenizer=tok, quantization=QuantizationOptions(bits=bits))
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), tok


@pytest.mark.parametrize("bits, layer", [(4, "Linear4bit"), (8, "Linear8bitLt")])
@pytest.mark.parametrize("method", ["lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "houlsby"])
def test_the_methods_train_over_a_quantized_backbone(bits, layer, method):
    model, tok = _quantized("tiny-bert", "classification", bits)
    assert any(type(m).__name__ == layer for m in model.modules())
    assert type(model.classifier).__name__ == "Linear"  # the task head stays in full precision
    tuned = apply_tuner(model, method_options(method), "classification")
    batch = tok(["a fine film", "dull"], padding=True, return_tensors="pt")
    tuned.module.eval()
    with torch.no_grad():  # an evaluation pass first, as a round does (bitsandbytes' CPU repacking, see registry)
        tuned.module(**batch)
    tuned.module.train()
    tuned.module(**batch, labels=torch.tensor([0, 1])).loss.backward()
    assert all(p.grad is not None for p in tuned.params.values())


@pytest.mark.needs_data
@pytest.mark.parametrize("bits, dtype", [(4, "float32"), (8, "float32"), (4, "bfloat16")])
def test_a_quantized_lora_round_and_its_adapter_reloads_with_the_runs_score(bits, dtype, tmp_path, capsys):
    summary = run(tiny_config(f"model.quantization={{bits: {bits}}}", f"model.dtype={dtype}"), tmp_path / "run")
    full = run(tiny_config(), tmp_path / "full")
    assert summary["backbone_bytes"] < full["backbone_bytes"]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["round"] == 2 and rows[-1]["agg_update_norm"] > 0
    meta = json.loads((tmp_path / "run" / "adapter" / "fedpeft_adapter.json").read_text())
    assert meta["quantization"]["bits"] == bits
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--adapter", "last", "--max-examples", "32", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["eval_accuracy"] == pytest.approx(rows[-1]["eval_accuracy"])
    assert scores["eval_loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-4)


@pytest.mark.needs_data
@pytest.mark.parametrize("overrides", [
    ["algorithm={name: headprune, sparsity: 0.5}"],
    ["algorithm={name: fedpeptao, selection_round: 1, hessian_steps: 5}", "federation.rounds=2",
     "peft={method: prefix_tuning, num_virtual_tokens: 4}"],
])
def test_head_pruning_and_fedpeptao_run_over_4_bits(overrides, tmp_path):
    run(tiny_config("model.quantization={bits: 4}", *overrides), tmp_path / "run")
    assert all(r["train_loss"] > 0 for r in read_metrics(tmp_path / "run")[1:])


@pytest.mark.parametrize("overrides, reason", [
    (["peft.method=full"], "peft.method full trains the backbone's weights"),
    (["peft.method=bitfit"], "peft.method bitfit trains the biases"),
    (["model.name=tiny-llama", "task.type=multiple_choice", "algorithm={name: fedsp}", "peft.method=prefix_tuning"],
     "algorithm fedsp copies the global model's blocks"),
    (["model.quantization.quant_type=fp4", "model.quantization.bits=8"], "quant_type is a 4-bit option"),
])
def test_what_cannot_train_over_quantized_weights_is_refused_with_the_reason(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(None, ["model.quantization={bits: 4}", *overrides])


def test_without_bitsandbytes_the_error_names_the_extra(monkeypatch):
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(registry.ModelError, match=r'pip install -e "\.\[quantization\]"'):
        registry.load_model("tiny-bert", "classification", num_labels=2, quantization=QuantizationOptions(bits=4))


def test_place_on_moves_only_what_is_elsewhere():
    from fedpeft.models.registry import place_on

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    model[1].register_buffer("seen", torch.zeros(2))
    model[0].to("meta")  # stands for what already sits on the device
    placed = model[0].weight
    place_on(model, torch.device("meta"))
    assert model[0].weight is placed
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("bits, precision", [(4, "nf4"), (8, "int8")])
def test_held_bytes_count_the_quantization_constants_and_match_the_estimate(bits, precision):
    """What a quantized model holds (packed weights, absmax or row scales, the rest float32) is what the meta-device
    estimate of the same architecture gives, byte for byte; transformers' footprint misses the constants."""
    from fedpeft.metrics.memory import backbone_bytes_estimate, held_bytes
    from fedpeft.models.architectures import build_on_meta

    tok = registry.load_tokenizer("tiny-llama")
    model = registry.load_model("tiny-llama", "causal", tokenizer=tok, quantization=QuantizationOptions(bits=bits))
    held = held_bytes(model)
    assert held > model.get_memory_footprint()
    meta = build_on_meta(model.config, "causal")
    assert backbone_bytes_estimate(meta, precision) == held
    plain = registry.load_model("tiny-llama", "causal", tokenizer=tok)
    assert backbone_bytes_estimate(build_on_meta(plain.config, "causal"), "float32") == held_bytes(plain)


def test_a_run_that_does_not_quantize_never_imports_bitsandbytes_and_a_later_quantized_one_can():
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes logs a kernel warning on a CPU that a
    new user reads as an error: a run without model.quantization hides it; a quantized model in the same process
    still loads and trains. In a fresh interpreter (this one imported bitsandbytes above)."""
    import subprocess
    import sys

    script = """
import sys
import torch
from fedpeft.config.schema import QuantizationOptions
from fedpeft.models import registry
from fedpeft.tuners import apply_tuner, method_options
tok = registry.load_tokenizer("tiny-bert")
batch = tok(["a fine film", "dull"], padding=True, return_tensors="pt")
plain = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok),
                    method_options("lora"), "classification")
plain.module(**batch, labels=torch.tensor([0, 1])).loss.backward()
assert sys.modules.get("bitsandbytes", "absent") is None, "bitsandbytes was imported by a run without quantization"
from fedpeft.models import bnb_gate
bnb_gate.restore()  # as the end of a run does: importable again, hidden again by the next unquantized model
assert "bitsandbytes" not in sys.modules
registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok)
assert sys.modules.get("bitsandbytes", "absent") is None
print("--- now quantized ---", file=sys.stderr, flush=True)
model = registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok,
                            quantization=QuantizationOptions(bits=4))
assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
tuned = apply_tuner(model, method_options("lora"), "classification")
tuned.module.eval()
with torch.no_grad():
    tuned.module(**batch)
print("quantized ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "quantized ok" in out.stdout
    unquantized_part = out.stderr.split("--- now quantized ---")[0]
    assert "bitsandbytes" not in unquantized_part and "kernels" not in unquantized_part
