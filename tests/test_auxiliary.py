"""FedSP's auxiliary model: k blocks of the global model, shared across L positions, prefixes per position."""

import copy

import numpy as np
import pytest
import torch

from fedpeft.algorithms.fedsp.auxiliary import (
    auxiliary_from_config,
    block_stack,
    build_auxiliary,
    chosen_blocks,
    public_config,
)
from fedpeft.algorithms.fedsp.distill import distill_hidden_states, last_hidden, masked_mse
from fedpeft.data.batching import Encoded, collate
from fedpeft.models import registry
from fedpeft.tuners.tuned import apply_tuner, method_options


@pytest.fixture(scope="module")
def tok():
    return registry.load_tokenizer("tiny-llama")


def causal(name, tok, layers=4):
    model = registry.load_model(name, "causal", tokenizer=tok, seed=3)
    if layers != model.config.num_hidden_layers:  # a deeper tiny model, so that k and L differ more
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = layers
        torch.manual_seed(3)
        model = type(model)(config)
    return model.eval()


def with_prefix(model, tokens=3):
    tuned = apply_tuner(model, method_options("prefix_tuning", num_virtual_tokens=tokens, projection=False), "causal")
    with torch.no_grad():  # distinct values per layer, so that a prefix read at the wrong layer shows
        for p in tuned.params.values():
            p.copy_(torch.randn_like(p))
    return tuned


def test_blocks_come_from_the_bottom_middle_or_top():
    assert chosen_blocks(48, 1, "bottom") == [0]
    assert chosen_blocks(48, 1, "middle") == [23]  # the paper's 24th of 48
    assert chosen_blocks(48, 1, "top") == [47]
    assert chosen_blocks(30, 2, "middle") == [14, 15]
    with pytest.raises(ValueError, match="1 <= k <= 30"):
        chosen_blocks(30, 31, "bottom")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_shared_blocks_with_per_position_prefixes_equal_a_model_of_repeated_copies(name, tok):
    glob = causal(name, tok)
    aux, info = build_auxiliary(glob, k=2, position="middle", share=True)
    assert info.blocks == [1, 2] and info.positions == 4 and info.shared
    # reference: the global architecture with blocks 1,2,1,2 as independent copies
    ref = copy.deepcopy(glob)
    parent, attr = block_stack(ref)
    src = getattr(block_stack(glob)[0], attr)
    with torch.no_grad():
        for pos in range(4):
            getattr(parent, attr)[pos].load_state_dict(src[info.blocks[pos % 2]].state_dict())
    a, r = with_prefix(aux.eval()), with_prefix(ref)
    a.load_state({k: v for k, v in r.state().items()})  # the same 4-layer prefix in both
    batch = tok(["a short text", "another one here"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out_a = a.module(**batch).logits
        out_r = r.module(**batch).logits
    torch.testing.assert_close(out_a, out_r, rtol=1e-5, atol=1e-5)
    # a prefix read at the wrong position would not match: changing layer 3's prefix changes the output
    name3 = next(iter(a.params))
    with torch.no_grad():
        a.params[name3][:, -a.params[name3].shape[1] // 4:] += 1.0
        assert not torch.allclose(a.module(**batch).logits, out_r, atol=1e-3)


def test_unique_parameters_and_no_tensor_shared_with_the_global_model(tok):
    glob = causal("tiny-llama", tok)
    aux, info = build_auxiliary(glob, k=1, position="top", share=True)
    block = sum(p.numel() for p in block_stack(glob)[0].layers[0].parameters())
    assert info.global_parameters - info.parameters == 3 * block
    assert next(n for n, _ in aux.named_parameters() if ".layers." in n).startswith("model.layers.0.")
    assert not any(n.startswith("model.layers.1.") for n, _ in aux.named_parameters())
    glob_ptrs = {p.data_ptr() for p in glob.parameters()}
    assert not any(p.data_ptr() in glob_ptrs for p in aux.parameters())
    torch.testing.assert_close(aux.model.layers[3].self_attn.q_proj.weight, glob.model.layers[3].self_attn.q_proj.weight)
    assert aux.model.layers[2].self_attn.q_proj.weight is aux.model.layers[0].self_attn.q_proj.weight
    assert [layer.self_attn.layer_idx for layer in aux.model.layers] == [0, 1, 2, 3]
    with torch.no_grad():  # hooks registered per position stay on that position (L + 1 hidden states, not more)
        out = aux(input_ids=torch.tensor([[5, 6, 7]]), output_hidden_states=True)
    assert len(out.hidden_states) == 5


def test_without_sharing_the_model_has_k_positions(tok):
    glob = causal("tiny-gpt2", tok)
    aux, info = build_auxiliary(glob, k=1, position="bottom", share=False)
    assert info.positions == 1 and not info.shared and aux.config.num_hidden_layers == 1
    torch.testing.assert_close(aux.transformer.h[0].attn.c_attn.weight, glob.transformer.h[0].attn.c_attn.weight)


def test_k_that_does_not_divide_l_cuts_the_last_cycle_short(tok):
    glob = causal("tiny-llama", tok, layers=5)
    aux, info = build_auxiliary(glob, k=2, position="bottom", share=True)
    assert info.positions == 5 and info.shared
    layers = aux.model.layers
    assert [layer.self_attn.layer_idx for layer in layers] == [0, 1, 2, 3, 4]
    assert all(layers[p].self_attn.q_proj.weight is layers[p % 2].self_attn.q_proj.weight for p in range(5))
    # equal to the global architecture holding blocks 0,1,0,1,0 as copies, with the same 5-layer prefix
    ref = copy.deepcopy(glob)
    with torch.no_grad():
        for pos in range(5):
            ref.model.layers[pos].load_state_dict(glob.model.layers[pos % 2].state_dict())
    a, r = with_prefix(aux.eval()), with_prefix(ref)
    a.load_state(r.state())
    # a client's skeleton from the config the server sends, with the received values, computes the same
    skeleton = auxiliary_from_config(public_config(aux), blocks=2, positions=5)
    skeleton.load_state_dict(aux.state_dict())
    s = with_prefix(skeleton)
    s.load_state(r.state())
    batch = tok(["a short text", "another one here"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out_r = r.module(**batch).logits
        torch.testing.assert_close(a.module(**batch).logits, out_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.module(**batch).logits, out_r, rtol=1e-5, atol=1e-5)


def test_masked_mse_leaves_padding_out():
    s = torch.tensor([[[1.0, 1.0], [5.0, 5.0]]])
    t = torch.zeros(1, 2, 2)
    assert masked_mse(s, t, torch.tensor([[1, 0]])).item() == pytest.approx(1.0)
    assert masked_mse(s, t, torch.tensor([[1, 1]])).item() == pytest.approx(13.0)


def test_distillation_brings_the_auxiliary_model_closer_to_the_global_one(tok):
    glob = causal("tiny-llama", tok)
    aux, _ = build_auxiliary(glob, k=1, share=True)
    rng = np.random.default_rng(0)
    ids = [rng.integers(5, 1000, size=int(n)) for n in rng.integers(6, 20, size=48)]
    data = Encoded(input_ids=ids, labels=[x.copy() for x in ids])
    held_out = {k: v for k, v in collate(data, np.arange(40, 48), tok.pad_token_id).items()}

    def gap():
        with torch.no_grad():
            return masked_mse(last_hidden(aux, held_out), last_hidden(glob, held_out), held_out["attention_mask"]).item()

    before = gap()
    teacher_before = {n: p.clone() for n, p in glob.named_parameters()}
    res = distill_hidden_states(aux, glob, data.subset(np.arange(40)), steps=40, lr=3e-3, batch_size=8,
                                pad_id=tok.pad_token_id, seed=0, device=torch.device("cpu"))
    assert res.steps == 40 and res.last_loss < res.first_loss
    assert gap() < 0.8 * before
    assert all(torch.equal(p, teacher_before[n]) for n, p in glob.named_parameters())  # the teacher is untouched
