"""Every PEFT method on tiny random BERT, GPT-2, LLaMA, T5 and BART models built from configs."""

import numpy as np
import pytest
import torch

from fedpeft.models import registry
from fedpeft.models.layout import arch_spec, model_shape
from fedpeft.tuners import PEFT_METHODS, StateError, apply_tuner, method_options
from fedpeft.tuners.bottleneck.apply import adapter_sites

METHODS = sorted(PEFT_METHODS)  # every registered method (the built-in ones, at collection)
CASES = [
    ("tiny-bert", "classification"),
    ("tiny-gpt2", "classification"),
    ("tiny-gpt2", "causal"),
    ("tiny-llama", "classification"),
    ("tiny-llama", "causal"),
    ("tiny-t5", "classification"),
    ("tiny-t5", "seq2seq"),
    ("tiny-bart", "classification"),
    ("tiny-bart", "seq2seq"),
]
def _expected_failure(name, kind, method):
    if method == "bitfit" and name == "tiny-llama":
        return "no bias parameters"
    if method == "bitfit" and name == "tiny-t5" and kind == "seq2seq":
        return "no bias parameters"
    if method in ("prompt_tuning", "p_tuning", "prefix_tuning") and name in ("tiny-t5", "tiny-bart") and kind == "classification":
        return "encoder-decoder classifiers take no prompt"
    return None


def _batch(tok, kind):
    enc = tok(["the quick brown fox", "jumps"], padding=True, return_tensors="pt")
    batch = {k: v for k, v in enc.items() if k != "token_type_ids" or kind == "classification"}
    batch["labels"] = torch.tensor([0, 2]) if kind == "classification" else enc["input_ids"].clone()
    return batch


@pytest.mark.parametrize("name, kind", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_method_trains_and_exchanges_state(name, kind, method):
    tok = registry.load_tokenizer(name)
    model = registry.load_model(name, kind, num_labels=3, tokenizer=tok)
    failure = _expected_failure(name, kind, method)
    if failure:
        with pytest.raises(ValueError, match=failure):
            apply_tuner(model, method_options(method), kind)
        return
    tuned = apply_tuner(model, method_options(method), kind)
    total = tuned.num_total()
    assert 0 < tuned.num_trainable() <= total
    if method != "full":
        assert tuned.num_trainable() < 0.2 * total
    if kind == "classification":  # the task head is trainable and exchanged
        assert any(h in n for n in tuned.params for h in ("classifier", "score", "classification_head"))
    out = tuned.module(**_batch(tok, kind))
    out.loss.backward()
    assert all(p.grad is not None for p in tuned.params.values()), "every trainable tensor must get a gradient"
    # state round trip: perturb, load back, compare
    before = tuned.state()
    changed = {k: v + 1.0 for k, v in before.items()}
    tuned.load_state(changed)
    after = tuned.state()
    assert all(np.allclose(after[k], changed[k]) for k in before)


def test_state_errors_name_the_problem():
    tok = registry.load_tokenizer("tiny-bert")
    tuned = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok),
                        method_options("lora", r=2), "classification")
    state = tuned.state()
    name = next(iter(state))
    with pytest.raises(StateError, match="unknown parameter 'nope'"):
        tuned.load_state({**state, "nope": np.zeros(1, np.float32)})
    with pytest.raises(StateError, match="missing parameter"):
        tuned.load_state({k: v for k, v in state.items() if k != name})
    with pytest.raises(StateError, match="shape"):
        tuned.load_state({**state, name: np.zeros((1, 1), np.float32)})


def test_lora_defaults_to_query_key_value_per_architecture():
    for name, expected in [("tiny-bert", {"query", "key", "value"}), ("tiny-llama", {"q_proj", "k_proj", "v_proj"}),
                           ("tiny-t5", {"q", "k", "v"}), ("tiny-gpt2", {"c_attn"})]:
        kind = "classification" if name == "tiny-bert" else ("seq2seq" if name == "tiny-t5" else "causal")
        tok = registry.load_tokenizer(name)
        tuned = apply_tuner(registry.load_model(name, kind, num_labels=2, tokenizer=tok), method_options("lora", r=2), kind)
        adapted = {n.split(".lora_A")[0].split(".")[-1] for n in tuned.params if ".lora_A" in n}
        assert adapted == expected, name


def test_lora_rank_sets_the_trainable_size():
    tok = registry.load_tokenizer("tiny-bert")
    sizes = {}
    for r in (2, 4):
        model = registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok)
        tuned = apply_tuner(model, method_options("lora", r=r), "classification")
        sizes[r] = sum(v.size for k, v in tuned.state().items() if "lora_" in k)
    # per adapted projection: r*(in + out) = r*128; 3 projections x 2 layers
    assert sizes == {2: 2 * 128 * 6, 4: 4 * 128 * 6}


@pytest.mark.parametrize("name, houlsby, pfeiffer", [
    ("tiny-bert", 4, 2), ("tiny-gpt2", 4, 2), ("tiny-llama", 4, 2),
    ("tiny-t5", 4 + 2 + 4, 4), ("tiny-bart", 4 + 2 + 4, 4),  # enc-dec: self attn x4, cross attn x2, ffn x4
])
def test_bottleneck_adapter_placement(name, houlsby, pfeiffer):
    kind = "classification" if name == "tiny-bert" else ("seq2seq" if name in ("tiny-t5", "tiny-bart") else "causal")
    tok = registry.load_tokenizer(name)
    model = registry.load_model(name, kind, num_labels=2, tokenizer=tok)
    spec = arch_spec(model.config.model_type)
    assert len(adapter_sites(model, spec, "pfeiffer")) == pfeiffer
    assert len(adapter_sites(model, spec, "houlsby")) == houlsby


def test_adapter_starts_near_identity():
    tok = registry.load_tokenizer("tiny-bert")
    torch.manual_seed(0)
    base = registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok).eval()
    batch = tok(["hello there"], return_tensors="pt")
    with torch.no_grad():
        ref = base.bert(**batch).last_hidden_state
    tuned = apply_tuner(base, method_options("houlsby", init_std=0.0), "classification")
    with torch.no_grad():
        out = tuned.module.bert(**batch).last_hidden_state
    assert torch.allclose(ref, out, atol=1e-6)


def test_model_shapes_read_from_configs():
    s = model_shape(registry.load_config("tiny-llama"))
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.hidden) == (2, 4, 2, 64)
    s = model_shape(registry.load_config("tiny-t5"))
    assert (s.num_layers, s.num_attention_modules, s.encoder_decoder) == (4, 6, True)
    s = model_shape(registry.load_config("minilm-l6"))
    assert (s.num_layers, s.num_heads, s.hidden, s.intermediate) == (6, 12, 384, 1536)


def test_unknown_model_and_wrong_architecture_are_clear_errors():
    with pytest.raises(registry.ModelError, match="does not exist"):
        registry.resolve("./no/such/dir")
    with pytest.raises(registry.ModelError, match="is an encoder"):
        registry.model_kind("generation", registry.load_config("minilm-l6"))
