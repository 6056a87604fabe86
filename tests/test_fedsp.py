"""FedSP: the global model stays on the server; clients get an auxiliary model once, then prompts only."""

import json

import numpy as np
import pytest
import torch
from helpers import crash_at_round

import fedpeft
from fedpeft.algorithms.fedsp.halves import AUX, fold_layers, tile_layers
from fedpeft.config import load_config
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.tuners.prefix_layers import PrefixLayout


def fedsp_config(*overrides):
    return load_config(None, [
        "model.name=tiny-llama", "task.type=multiple_choice", "task.dataset=arc_easy",
        "task.train_split=test[:80%]", "task.eval_split=test[80%:]", "task.max_train_examples=66",
        "task.max_length=64", "peft={method: prefix_tuning, num_virtual_tokens: 4}",
        "algorithm={name: fedsp, distill_steps: 4, server_steps: 2, distill_batch_size: 4}",
        "federation.num_clients=3", "federation.clients_per_round=2", "federation.rounds=3",
        "train.local_steps=2", "train.batch_size=4", "eval.max_examples=8", "eval.batch_size=8",
        "runtime.progress=false", *overrides,
    ])


def test_prompts_fold_and_tile_between_l_and_k_layers():
    lay = PrefixLayout("p", 4, 2)
    prefix = np.arange(8, dtype=np.float32)[None, :].repeat(2, axis=0)  # layer l holds columns 2l, 2l+1
    folded = fold_layers(prefix, lay, 2)  # client layer 0 = mean(layers 0, 2), layer 1 = mean(layers 1, 3)
    np.testing.assert_allclose(folded[0], [2, 3, 4, 5])
    np.testing.assert_allclose(tile_layers(folded, lay, 2)[0], [2, 3, 4, 5, 2, 3, 4, 5])


def test_config_refuses_what_fedsp_cannot_do():
    with pytest.raises(ValueError, match="prefix_tuning"):
        fedsp_config("peft={method: lora}")
    with pytest.raises(ValueError, match="embedded runtime only"):
        fedsp_config("runtime.name=flower")
    with pytest.raises(ValueError, match="server_data_fraction"):
        fedsp_config("algorithm.server_data_fraction=0")


@pytest.mark.parametrize("client_trains", ["all", "blocks"])
@pytest.mark.needs_data
def test_no_payload_carries_a_global_block_the_auxiliary_model_was_not_built_from(tmp_path, client_trains):
    sent: list[tuple[int, int, dict]] = []

    class Sent(fedpeft.RunObserver):
        def on_configure(self, rnd, payloads):
            sent.extend((rnd, c, dict(p.arrays)) for c, p in payloads.items())

    rt = EmbeddedRuntime(fedsp_config("algorithm.aux_position=top", f"algorithm.client_trains={client_trains}"),
                         tmp_path / "run", observers=[Sent()])
    glob = rt.exp.server_model.base_model()
    assert glob.config.num_hidden_layers == 2
    private = {n: p.detach().numpy().copy() for n, p in glob.named_parameters() if ".layers.0." in n}  # not sent
    rt.run()
    prompt_names = set(rt.exp.tuned.state())
    first_contact = set()
    for rnd, c, arrays in sent:
        aux = {k for k in arrays if k.startswith(AUX)}
        assert set(arrays) - aux == prompt_names
        if aux:
            assert c not in first_contact  # the auxiliary model travels once per client
            first_contact.add(c)
            assert not any(".layers.1." in k for k in aux) and any(".layers.0." in k for k in aux)
        for value in arrays.values():
            for name, secret in private.items():
                assert not (value.shape == secret.shape and np.allclose(value, secret)), f"{name} was sent"
    assert first_contact == {c for _, c, _ in sent}
    # the auxiliary model is global block 1 (top), distilled: it left the server changed, never block 0
    info = rt.server.aux_info
    assert info["blocks"] == [1] and info["positions"] == 2 and info["distill_steps"] == 4
    # clients keep the part they train (all: the whole auxiliary model, as paper 003; blocks: the block and
    # the final norm), the server keeps prompts only
    for state in rt.client_states.values():
        assert state["aux"] and all(".layers.0." in k or "norm" in k or "embed_tokens" in k or "lm_head" in k
                                    for k in state["aux"])
        assert any("embed_tokens" in k for k in state["aux"]) == (client_trains == "all")
    assert set(rt.server.global_state) == prompt_names
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and "server_train_loss" in rows[-1] and "eval_accuracy_norm" in rows[-1]
    assert rows[1]["distill_steps"] == 4 and rows[1]["aux_positions"] == 2 and "distill_steps" not in rows[2]
    assert "_name_or_path" not in rt.server.aux_info["config"]  # where the private model came from is not sent


@pytest.mark.needs_data
def test_clients_train_the_auxiliary_model_then_the_prompts(tmp_path):
    rt = EmbeddedRuntime(fedsp_config("federation.rounds=1", "algorithm.server_steps=0"), tmp_path / "run")
    received = rt.server.configure(1, [0])[0]
    aux_before = {k[len(AUX):]: v for k, v in received.arrays.items() if k.startswith(AUX)}
    update, _, _, failure = rt.transport.run_clients(1, {0: received})[0]
    assert failure is None
    assert update.meta["train_steps"] == 4 and "align_loss" in update.meta  # both phases of 2 steps are counted
    changed = {k for k, v in rt.client_states[0]["aux"].items() if not np.allclose(v, aux_before[k])}
    # by default the client tunes the whole auxiliary model, embeddings included (paper 003)
    assert changed and {k for k in changed if ".layers." not in k and "norm" not in k} & {"model.embed_tokens.weight",
                                                                                          "lm_head.weight"}
    assert set(update.arrays) == set(rt.exp.tuned.state())
    assert any(not np.allclose(update.arrays[k], rt.server.global_state[k]) for k in update.arrays)
    assert torch.is_grad_enabled()


@pytest.mark.needs_data
def test_without_sharing_clients_take_k_layers_of_prompts_folded_from_the_global_ones(tmp_path):
    cfg = fedsp_config("federation.rounds=1", "algorithm.share_layers=false", "algorithm.distill_steps=0",
                       "algorithm.server_steps=0", "algorithm.client_training=prompts")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    name = next(iter(rt.server.global_state))
    before = rt.server.global_state[name].copy()
    sent = rt.server.configure(1, [0, 1])
    half = before.shape[1] // 2
    assert rt.server.aux_info["positions"] == 1 and sent[0].arrays[name].shape == (before.shape[0], half)
    np.testing.assert_allclose(sent[0].arrays[name], (before[:, :half] + before[:, half:]) / 2, rtol=1e-6)
    rt.run()
    after = rt.server.global_state[name]  # the clients' single layer is written back to both layers
    np.testing.assert_allclose(after[:, :half], after[:, half:], atol=1e-6)  # up to float32 rounding of x + (m - x)
    assert not np.allclose(after, before)
    assert all(not state.get("aux") for state in rt.client_states.values())  # FedPrompt-Single trains no weights


@pytest.mark.needs_data
def test_a_resumed_run_ends_like_an_uninterrupted_one_and_resends_the_auxiliary_model(tmp_path, monkeypatch):
    from fedpeft import checkpoint
    from fedpeft.rundir import read_metrics

    cfg = fedsp_config("federation.rounds=3")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    resumed = EmbeddedRuntime.resume(tmp_path / "cut")
    resumed.run()
    full, cut = checkpoint.load(tmp_path / "full")[1], checkpoint.load(tmp_path / "cut")[1]
    for k, v in full["server"]["global_state"].items():
        np.testing.assert_array_equal(cut["server"]["global_state"][k], v)
    for c, state in full["clients"].items():  # each client's own auxiliary weights carried over the resume
        for k, v in state["aux"].items():
            np.testing.assert_array_equal(cut["clients"][c]["aux"][k], v)
    a, b = read_metrics(tmp_path / "full")[-1], read_metrics(tmp_path / "cut")[-1]
    assert a["eval_accuracy"] == b["eval_accuracy"] and a["train_loss"] == b["train_loss"]
    assert b["bytes_down_total"] > a["bytes_down_total"]  # the auxiliary model went out again, and was counted
