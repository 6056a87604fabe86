"""The bundled SmolLM2-135M: dequantised once from the GGUF and cached as safetensors; grouped key/value
heads; one federated round of LoRA on real E2E NLG pairs."""

import os

import pytest
from helpers import tiny_config

from fedpeft.models import registry
from fedpeft.models.layout import model_shape
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run

pytestmark = pytest.mark.slow


def test_gguf_is_cached_as_safetensors_once():
    path = registry.resolve("smollm2-135m").path
    weights = os.path.join(path, "model.safetensors")
    assert os.path.isfile(weights) and os.path.isfile(os.path.join(path, "config.json"))
    mtime = os.path.getmtime(weights)
    assert registry.resolve("smollm2-135m").path == path and os.path.getmtime(weights) == mtime
    shape = model_shape(registry.load_config("smollm2-135m"))
    assert (shape.model_type, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.hidden) == ("llama", 30, 9, 3, 576)


@pytest.mark.needs_data
def test_one_lora_round_on_e2e(tmp_path):
    cfg = tiny_config("model.name=smollm2-135m", "task.type=generation", "task.dataset=e2e_nlg",
                      "task.train_split=validation_pairs", "task.eval_split=test", "task.max_train_examples=16",
                      "task.max_length=64", "eval.max_examples=4", "task.generation_max_new_tokens=16",
                      "federation.rounds=1", "train.local_steps=1", "peft.r=4")
    run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["eval_loss"] < 6.0, "a pretrained LM has a far lower loss than a random one (ln 49152 = 10.8)"
    assert rows[1]["eval_rougeL"] > 0.05, "the instruct model should produce text overlapping the references"
    up = next(iter(rows[1]["bytes_up"].values()))
    # LoRA r=4 on q,k,v of 30 layers: q 576->576, k,v 576->192 -> r*(576+576) + 2*r*(576+192) per layer
    params = 30 * 4 * ((576 + 576) + 2 * (576 + 192))
    assert params * 4 < up < params * 4 + 64 * 1024
