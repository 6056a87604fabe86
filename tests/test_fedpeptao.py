"""FedPepTAO (paper 002): the server half on hand-made updates, the client half on a tiny model end to end."""

import numpy as np
import pytest
import torch
from helpers import tiny_config

import fedpeft
from fedpeft import checkpoint
from fedpeft.algorithms import make_server
from fedpeft.algorithms.fedpeptao.adaptive_server import adaptive_step
from fedpeft.algorithms.fedpeptao.halves import block_name
from fedpeft.algorithms.fedpeptao.layer_selection import layer_score
from fedpeft.algorithms.fedpeptao.options import FedPepTAOOptions
from fedpeft.algorithms.fedpeptao.prompt_probes import client_layer_scores, sample_batch
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.tuners.prefix_layers import PrefixLayout
from fedpeft.wire import Payload

NAME = "base_model.prompt_encoder.default.embedding.weight"
LAYOUT = PrefixLayout(NAME, 3, 2)  # 3 layers, 2 columns each


def server(num_clients=10, clients_per_round=2, **options):
    init = {NAME: np.zeros((4, 6), np.float32), "head": np.zeros(2, np.float32)}
    return make_server(FedPepTAOOptions(**options), init, num_clients=num_clients,
                       clients_per_round=clients_per_round, seed=0, layout=LAYOUT)


def update(rnd, arrays, n=10, steps=5, **meta):
    return Payload(arrays, {"round": rnd, "num_examples": n, "train_steps": steps, "client_lr": 0.1, **meta})


def full(value):
    return {NAME: np.full((4, 6), value, np.float32), "head": np.full(2, value, np.float32)}


def test_layers_are_selected_by_score_after_the_selection_round_and_only_they_travel():
    srv = server(layer_selection="score", ratio=0.3, selection_round=1, server_optimizer="fedavg")
    payloads = srv.configure(1, [0, 1])
    assert set(payloads[0].arrays) == {NAME, "head"} and payloads[0].meta["scores"] and not payloads[0].meta["hessian"]
    # Formula 4: layer 2 wins with weights 1:3 (0.25*[1,5,0] + 0.75*[3,1,4] = [2.5, 2, 3])
    ups = {0: update(1, full(1.0), n=10, layer_scores=[1.0, 5.0, 0.0]),
           1: update(1, full(3.0), n=30, layer_scores=[3.0, 1.0, 4.0])}
    ok, rejected = srv.accept(1, ups)
    assert not rejected
    srv.aggregate(1, ok)
    info = srv.round_info()
    assert srv.selected == [2] and info["selected_layers"] == [2] and info["layer_scores"] == [2.5, 2.0, 3.0]
    np.testing.assert_allclose(srv.global_state[NAME], 2.5)  # FedAvg of every layer in the all-layer round
    # clients 0 and 1 hold their prompt: they get layer 2 only; client 5 gets the whole prompt once
    payloads = srv.configure(2, [0, 5])
    assert set(payloads[0].arrays) == {block_name(NAME, 2), "head"} and payloads[0].meta["layers"] == [2]
    assert set(payloads[5].arrays) == {NAME, "head"}
    blk = {block_name(NAME, 2): np.full((4, 2), 4.5, np.float32), "head": np.full(2, 4.5, np.float32)}
    ok, rejected = srv.accept(2, {0: update(2, blk), 5: update(2, full(9.0)), 6: update(2, {**blk, "x": blk["head"]})})
    assert set(rejected) == {5, 6} and "unknown parameter" in rejected[5]
    srv.aggregate(2, ok)
    g = srv.global_state[NAME]
    np.testing.assert_allclose(g[:, 4:6], 4.5)  # the selected layer moved
    np.testing.assert_allclose(g[:, :4], 2.5)  # the others keep their last aggregated value


def test_a_first_contact_client_after_the_selection_returns_the_selected_layers():
    srv = server(ratio=0.3, selection_round=1, layer_selection="descending")
    srv.aggregate(1, {0: update(1, full(1.0))})
    assert srv.selected == [2] and set(srv.configure(2, [7])[7].arrays) == {NAME, "head"}
    blk = {block_name(NAME, 2): np.ones((4, 2), np.float32), "head": np.ones(2, np.float32)}
    ok, rejected = srv.accept(2, {7: update(2, blk)})
    assert not rejected
    srv.aggregate(2, ok)
    assert set(srv.configure(3, [7])[7].arrays) == set(blk)
    srv.observe_failures(3, {7: "client lost its state"})  # a failed holder gets the whole prompt again
    assert set(srv.configure(4, [7])[7].arrays) == {NAME, "head"}


def test_hostile_numbers_are_rejected_and_an_overflowing_step_is_not_applied():
    srv = server(ratio=0.5, selection_round=1)
    srv.client_lr = 0.1
    hostile = [update(1, full(0.0), layer_scores=[10**400, 1.0, 2.0]), update(1, full(0.0), steps=10**30),
               Payload(full(0.0), {"round": 1, "num_examples": 3, "train_steps": 2, "client_lr": 10**400}),
               Payload(full(0.0), {"round": 1, "num_examples": 3, "train_steps": 2, "client_lr": 1e-300})]
    ok, rejected = srv.accept(1, dict(enumerate(hostile)))
    assert not ok and len(rejected) == 4
    before = {k: v.copy() for k, v in srv.global_state.items()}
    huge = {NAME: np.full((4, 6), 3e38, np.float32), "head": np.full(2, 3e38, np.float32)}
    srv.aggregate(1, {0: update(1, huge), 1: update(1, huge)})  # c_i = delta / (K alpha) overflows float32
    for k, value in before.items():
        np.testing.assert_array_equal(srv.global_state[k], value)


def test_bad_measurements_are_rejected():
    srv = server(ratio="hessian", selection_round=1)
    bad = [update(1, full(0.0), layer_scores=[1.0, 2.0]), update(1, full(0.0), layer_scores=[1.0, float("nan"), 2.0]),
           update(1, full(0.0), kept_ratio=1.5), update(1, full(0.0), steps=0),
           Payload(full(0.0), {"round": 1, "num_examples": 3, "train_steps": 2})]
    ok, rejected = srv.accept(1, dict(enumerate(bad)))
    assert not ok and len(rejected) == 5
    assert "client_lr" in rejected[4] and "kept_ratio" in rejected[2] and "layer_scores" in rejected[0]


def test_hessian_ratio_is_the_sample_weighted_mean_and_orders_are_the_baselines():
    srv = server(layer_selection="descending", ratio="hessian", selection_round=2)
    assert not srv.configure(1, [0])[0].meta["hessian"] and srv.configure(2, [0])[0].meta["hessian"]
    assert not srv.configure(1, [0])[0].meta["scores"]  # descending needs no scores
    srv.aggregate(1, {0: update(1, full(0.0))})
    assert srv.selected is None
    srv.aggregate(2, {0: update(2, full(0.0), n=1, kept_ratio=0.9), 1: update(2, full(0.0), n=3, kept_ratio=0.3)})
    assert srv.ratio == pytest.approx(0.45) and srv.selected == [1, 2]  # top layers first
    srv = server(layer_selection="all")
    srv.aggregate(1, {0: update(1, full(1.0))})
    assert srv.selected is None and set(srv.configure(9, [3])[3].arrays) == {NAME, "head"}


@pytest.mark.parametrize("head_step", ["same", "fedavg"])
def test_the_adaptive_step_runs_on_the_exchanged_arrays_with_state_per_seen_client(head_step):
    srv = server(ratio=1.0, selection_round=1, layer_selection="ascending", server_lr=0.5, server_lr_decay=1.0,
                 head_server_step=head_step)
    r1 = {0: update(1, full(1.0), n=10, steps=4), 1: update(1, full(-1.0), n=30, steps=2)}
    srv.aggregate(1, r1)
    r2 = {1: update(2, full(0.0), n=30, steps=2), 2: update(2, full(2.0), n=10, steps=1)}
    before = {k: v.copy() for k, v in srv.global_state.items()}
    c_before = {c: dict(v) for c, v in srv.c_clients.items()}
    cg, m, prev = dict(srv.c_global), srv.momentum, dict(srv.prev_update)
    srv.aggregate(2, r2)
    # the same step by adaptive_step on the whole arrays, with layer blocks joined back
    keys = (NAME, "head") if head_step == "same" else (NAME,)
    w = {k: before[k] for k in keys}
    join = lambda blocks: {k: np.concatenate([blocks[block_name(NAME, l)] for l in range(3)], axis=1)
                           if k == NAME else blocks[k] for k in keys}
    expect, *_ = adaptive_step(w, [{k: r2[c].arrays[k] - w[k] for k in w} for c in (1, 2)], [30, 10], [2, 1], 0.1,
                               [join(c_before[1]), None], join(cg), m and join(m), join(prev), beta=0.9, eta=0.5,
                               sampled_fraction=0.2)
    if head_step == "fedavg":  # the head takes the sample-weighted mean of the clients' heads
        expect["head"] = (30 * r2[1].arrays["head"] + 10 * r2[2].arrays["head"]) / 40
        assert "head" not in srv.c_global and "head" not in srv.momentum
    for k in (NAME, "head"):
        np.testing.assert_allclose(srv.global_state[k], expect[k], rtol=1e-6, atol=1e-6)
    assert sorted(srv.c_clients) == [0, 1, 2] and srv.holders == [0, 1, 2]


def test_server_state_grows_with_clients_seen_not_with_the_federation():
    def state_bytes(num_clients):
        srv = server(num_clients=num_clients, clients_per_round=10, ratio=0.5, selection_round=1)
        for rnd in (1, 2, 3):
            srv.aggregate(rnd, {c: update(rnd, full(float(c))) if srv.selected is None else
                                update(rnd, {**{block_name(NAME, l): np.ones((4, 2), np.float32) for l in srv.selected},
                                             "head": np.ones(2, np.float32)})
                                for c in srv.select(rnd)})
        arrays, _ = checkpoint.pack_state(srv.state_dict())
        return len(srv.c_clients), sum(a.nbytes for a in arrays.values())

    seen100, bytes100 = state_bytes(100)
    seen1000, bytes1000 = state_bytes(1000)
    assert seen100 <= 30 and seen1000 <= 30
    assert bytes1000 / seen1000 == pytest.approx(bytes100 / seen100, rel=0.25)


def test_server_state_survives_a_checkpoint():
    srv = server(ratio=0.5, selection_round=1)
    srv.aggregate(1, {0: update(1, full(1.0), layer_scores=[1.0, 2.0, 3.0]), 3: update(1, full(2.0))})
    arrays, tree = checkpoint.pack_state(srv.state_dict())
    other = server(ratio=0.5, selection_round=1)
    other.load_state_dict(checkpoint.unpack_state(arrays, tree))
    assert other.selected == srv.selected and sorted(other.c_clients) == [0, 3] and other.holders == [0, 3]
    assert set(other.configure(2, [0])[0].arrays) == set(srv.configure(2, [0])[0].arrays)


@pytest.mark.needs_data
def test_fedpeptao_needs_prefix_tuning_without_projection_on_a_model_with_one_stack():
    with pytest.raises(ValueError, match="prefix_tuning"):
        tiny_config("algorithm.name=fedpeptao")
    with pytest.raises(ValueError, match="projection"):
        tiny_config("algorithm.name=fedpeptao", "peft.method=prefix_tuning", "peft.projection=true")
    from fedpeft.runtime.setup import build_experiment

    with pytest.raises(ValueError, match="encoder-decoder"):
        build_experiment(tiny_config("algorithm.name=fedpeptao", "peft.method=prefix_tuning", "model.name=tiny-t5",
                                     "task.type=generation", "task.dataset=e2e_nlg",
                                     "task.train_split=validation_pairs", "task.eval_split=test"))


@pytest.mark.needs_data
def test_a_run_exchanges_selected_layers_and_clients_keep_the_others(tmp_path):
    cfg = tiny_config("algorithm.name=fedpeptao", "peft.method=prefix_tuning", "peft.num_virtual_tokens=4",
                      "algorithm.selection_round=1", "algorithm.ratio=0.5", "federation.rounds=3",
                      "algorithm.keep_client_moments=true", "train.lr=0.04")
    sent = []

    class Sent(fedpeft.RunObserver):
        def on_configure(self, rnd, payloads):
            sent.append(payloads)

    rt = EmbeddedRuntime(cfg, tmp_path / "run", observers=[Sent()])
    rt.run()
    rows = {r["round"]: r for r in rt.rows}
    layout = rt.exp.layout
    assert layout.num_layers == 2
    selected = rows[1]["selected_layers"]
    assert len(selected) == 1 and len(rows[1]["layer_scores"]) == 2 and rows[3]["exchanged_layers"] == 1
    holders = set(rows[1]["clients"])
    for payloads in sent[1:]:
        for c, p in payloads.items():
            if c in holders:  # holds its prompt: only the selected layer travels
                assert p.meta["layers"] == selected and set(p.arrays) == {block_name(layout.name, selected[0])} | {
                    k for k in p.arrays if "#layer" not in k} and layout.name not in p.arrays
            else:  # first contact: the whole prompt, once
                assert layout.name in p.arrays
            holders.add(c)
    assert rows[3]["bytes_up_total"] < rows[1]["bytes_up_total"]
    other = 1 - selected[0]
    later = {c for r in (2, 3) for c in rows[r]["clients"]}
    assert later
    for c in later:  # the personal layer has moved away from the server's copy, the selected one has not
        st = rt.client_states[c]
        assert set(st) == {"prefix", "optimizer"} and st["optimizer"][layout.name]["step"] > 0
        assert not np.allclose(st["prefix"][:, layout.columns(other)],
                               rt.server.global_state[layout.name][:, layout.columns(other)])
    # client state survives the encoding Flower SuperNodes and checkpoints keep it in, and training goes on from it
    c = next(iter(later))
    restored = checkpoint.decode_tree(checkpoint.encode_tree(rt.client_states[c]))
    steps = restored["optimizer"][layout.name]["step"]
    rt.exp.trainer.train(rt.exp.tuned, rt.exp.client_data(c), np.random.default_rng(0),
                         optimizer_state=restored["optimizer"])
    assert restored["optimizer"][layout.name]["step"] > steps


@pytest.mark.needs_data
def test_layer_scores_are_eq3_on_the_unpadded_hidden_states():
    cfg = tiny_config("algorithm.name=fedpeptao", "peft.method=prefix_tuning", "peft.num_virtual_tokens=4")
    from fedpeft.runtime.setup import build_experiment

    exp = build_experiment(cfg)
    batch = sample_batch(exp.client_data(0), 6, np.random.default_rng(0), exp.tokenizer.pad_token_id, exp.device)
    assert (batch["attention_mask"] == 0).any()  # the check needs padding
    scores = client_layer_scores(exp.tuned, batch, 2)
    with torch.no_grad():
        exp.tuned.module.eval()
        hs = exp.tuned.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].unsqueeze(-1)
    assert scores == pytest.approx([layer_score((hs[l + 1] * mask).numpy()) for l in range(2)])
    assert scores != pytest.approx([layer_score(hs[l + 1].numpy()) for l in range(2)])


@pytest.mark.needs_data
def test_kept_optimizer_moments_continue_across_trainings():
    cfg = tiny_config("peft.method=prefix_tuning", "peft.num_virtual_tokens=4", "train.local_steps=3")
    from fedpeft.runtime.setup import build_experiment

    exp = build_experiment(cfg)
    data = exp.client_data(0)
    moments: dict = {}
    exp.trainer.train(exp.tuned, data, np.random.default_rng(0), optimizer_state=moments)
    first = {n: {k: np.array(v) for k, v in s.items()} for n, s in moments.items()}
    assert set(moments) == set(exp.tuned.params) and all(int(s["step"]) == 3 for s in moments.values())
    exp.trainer.train(exp.tuned, data, np.random.default_rng(1), optimizer_state=moments)
    assert all(int(s["step"]) == 6 for s in moments.values())
    name = next(iter(first))
    assert not np.allclose(first[name]["exp_avg_sq"], moments[name]["exp_avg_sq"])
