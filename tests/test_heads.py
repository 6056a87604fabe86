"""Paper 000 head machinery: layout per architecture, Eq. 6 importance, Eq. 7 pruning, the sparse wire
format, Eq. 8 aggregation and Eq. 9 selection, checked against hand-computed values."""

import numpy as np
import pytest
import torch
from helpers import tiny_config

import fedpeft
from fedpeft.algorithms.headprune.halves import HeadPruneServer, loss_difference_selection
from fedpeft.algorithms.headprune.options import HeadPruneOptions
from fedpeft.heads import (
    ALPHA_KEY,
    KEPT_KEY,
    HeadLayout,
    HeadParam,
    HeadUnit,
    build_layout,
    head_importance,
    keep_count,
    kept_by_importance,
    pack,
)
from fedpeft.models import registry
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime, run
from fedpeft.runtime.setup import build_experiment
from fedpeft.tuners import apply_tuner, method_options
from fedpeft.wire import Payload

GEN = ["task.type=generation", "task.dataset=e2e_nlg", "task.train_split=validation_pairs", "task.eval_split=test"]


def layout_for(model: str, method: str, kind: str, **options) -> tuple[HeadLayout, dict]:
    tok = registry.load_tokenizer(model)
    tuned = apply_tuner(registry.load_model(model, kind, num_labels=2, tokenizer=tok), method_options(method, **options), kind)
    return build_layout(tuned.spec(), registry.load_config(model), method), tuned.spec()


def units_of(layout: HeadLayout, fragment: str) -> list[tuple[int, int, tuple[int, ...]]]:
    [name] = [n for n in layout.params if fragment in n]
    return [(u.start, u.stop, u.heads) for u in layout.params[name].units]


def test_bert_lora_rows_of_b_per_head():
    layout, _spec = layout_for("tiny-bert", "lora", "classification")  # 2 layers x 4 heads, head dim 16
    assert (layout.num_modules, layout.heads_per_module) == (2, 4)
    assert units_of(layout, "layer.1.attention.self.key.lora_B") == [(0, 16, (4,)), (16, 32, (5,)), (32, 48, (6,)), (48, 64, (7,))]
    assert not any("lora_A" in n or "classifier" in n for n in layout.params)


def test_gpt2_fused_c_attn_is_split_into_query_key_value():
    layout, _ = layout_for("tiny-gpt2", "lora", "causal")
    units = units_of(layout, "h.1.attn.c_attn.lora_B")
    assert len(units) == 12
    assert [u for u in units if u[2] == (5,)] == [(16, 32, (5,)), (80, 96, (5,)), (144, 160, (5,))]


def test_llama_grouped_key_value_rows_serve_their_query_heads():
    layout, _ = layout_for("tiny-llama", "lora", "causal")  # 4 query heads, 2 key/value heads
    assert units_of(layout, "layers.0.self_attn.q_proj.lora_B") == [(0, 16, (0,)), (16, 32, (1,)), (32, 48, (2,)), (48, 64, (3,))]
    assert units_of(layout, "layers.1.self_attn.k_proj.lora_B") == [(0, 16, (4, 5)), (16, 32, (6, 7))]


def test_smollm2_nine_query_three_key_value_heads():
    config = registry.load_config("smollm2-135m")
    spec = {"base_model.model.model.layers.3.self_attn.v_proj.lora_B.default.weight": ((192, 16), "float32"),
            "base_model.model.model.layers.3.self_attn.q_proj.lora_B.default.weight": ((576, 16), "float32")}
    layout = build_layout(spec, config, "lora")
    assert layout.heads_per_module == 9 and layout.num_modules == config.num_hidden_layers
    v = units_of(layout, "v_proj")
    assert v == [(0, 64, (27, 28, 29)), (64, 128, (30, 31, 32)), (128, 192, (33, 34, 35))]


def test_vit_rows_per_head_follow_its_attention_modules():
    """A vision transformer (paper 004's backbone; paper 000 names ViTs as a target of head pruning): the rows of
    LoRA's B and IA3's key/value vectors split by head as the attention module's projections do."""
    from transformers import ViTConfig

    from fedpeft.models.architectures import build_on_meta

    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=16, patch_size=4, num_labels=3)
    for method, fragment in (("lora", "layers.1.attention.k_proj.lora_B"), ("ia3", "layers.1.attention.v_proj.ia3_l")):
        tuned = apply_tuner(build_on_meta(config, "classification", 3), method_options(method), "classification")
        layout = build_layout(tuned.spec(), config, method)
        attention = tuned.module.get_submodule("base_model.model.vit.layers.1.attention")
        width = attention.k_proj.out_features // config.num_attention_heads  # each head's rows of the projection
        assert (layout.num_modules, layout.heads_per_module) == (2, 4) and width == 8
        assert units_of(layout, fragment) == [(h * width, (h + 1) * width, (4 + h,)) for h in range(4)]
        assert not any("classifier" in n for n in layout.params)


@pytest.mark.parametrize("model", ["tiny-t5", "tiny-bart"])
def test_encoder_decoder_self_and_cross_attention_modules(model):
    layout, _ = layout_for(model, "lora", "seq2seq")
    assert layout.module_names == ["encoder.self.0", "encoder.self.1", "decoder.self.0", "decoder.self.1",
                                   "decoder.cross.0", "decoder.cross.1"]
    cross = "decoder.block.1.layer.1.EncDecAttention.q." if model == "tiny-t5" else "decoder.layers.1.encoder_attn.q_proj."
    [name] = [n for n in layout.params if cross in n]
    assert [u.heads for u in layout.params[name].units] == [(20,), (21,), (22,), (23,)]


def test_ia3_key_value_scaling_is_per_head_feed_forward_is_not():
    layout, spec = layout_for("tiny-llama", "ia3", "causal")
    assert all(("k_proj" in n or "v_proj" in n) for n in layout.params)
    assert any("down_proj" in n for n in spec) and not any("down_proj" in n for n in layout.params)


def test_prefix_tuning_key_value_dims_per_layer_and_head():
    layout, _ = layout_for("tiny-llama", "prefix_tuning", "causal")  # (20, 2 layers x [k, v] x 2 kv heads x 16)
    units = units_of(layout, "prompt_encoder")
    assert units[:4] == [(0, 16, (0, 1)), (16, 32, (2, 3)), (32, 48, (0, 1)), (48, 64, (2, 3))]
    assert units[4] == (64, 80, (4, 5))


def test_prompt_tuning_embedding_split_over_every_head_of_the_model():
    layout, _ = layout_for("tiny-bert", "prompt_tuning", "classification")  # 2 modules x 4 heads, 64 dims
    assert units_of(layout, "prompt_encoder") == [(8 * g, 8 * g + 8, (g,)) for g in range(8)]


@pytest.mark.parametrize("model,method,kind", [("tiny-bert", "prompt_tuning", "classification"),
                                               ("tiny-t5", "prompt_tuning", "seq2seq"),
                                               ("tiny-llama", "p_tuning", "causal")])
def test_uploaded_share_of_an_input_prompt_follows_the_sparsity(model, method, kind):
    """Paper 000, Table 3: prompt tuning sends 743 KB dense and 74 KB at 90%: the kept share of heads."""
    layout, _spec = layout_for(model, method, kind)
    [param] = layout.params.values()
    dims, n = param.shape[1], layout.num_heads
    rng = np.random.default_rng(0)
    for kept in [set(range(n - layout.heads_per_module, n)), *(set(rng.choice(n, k, replace=False).tolist())
                                                             for k in (1, n // 4, n // 2, n - 1))]:
        share = param.packed_shape(kept)[1] / dims
        assert abs(share - len(kept) / n) <= len(kept) / dims + 1e-9, (kept, share)


def test_eq7_keeps_the_top_fraction_ties_to_lower_id():
    layout = HeadLayout(2, 4, ["self.0", "self.1"], {})
    alpha = np.array([0.5, 0.9, 0.1, 0.7, 0.7, 0.2, 0.3, 0.8])
    assert keep_count(8, 0.5) == 4 and keep_count(8, 0.95) == 1
    np.testing.assert_array_equal(kept_by_importance(alpha, 0.5, layout), [1, 3, 4, 7])
    np.testing.assert_array_equal(kept_by_importance(alpha, 0.5, layout, per_module=True), [1, 3, 4, 7])
    np.testing.assert_array_equal(kept_by_importance(alpha, 0.75, layout, per_module=True), [1, 7])
    np.testing.assert_array_equal(kept_by_importance(alpha, 0.75, layout), [1, 7])


def small_layout() -> HeadLayout:
    """One parameter 'w' (4 rows x 2) whose rows belong to heads 0..3; 'b' is non-head."""
    param = HeadParam("w", (4, 2), 0, [HeadUnit(h, h + 1, (h,)) for h in range(4)])
    return HeadLayout(1, 4, ["self.0"], {"w": param})


def test_pack_sends_only_kept_rows_and_their_ids():
    state = {"w": np.arange(8, dtype=np.float32).reshape(4, 2), "b": np.ones(3, dtype=np.float32)}
    arrays = pack(state, small_layout(), np.array([1, 3], dtype=np.int32))
    np.testing.assert_array_equal(arrays["w"], [[2, 3], [6, 7]])
    np.testing.assert_array_equal(arrays["b"], state["b"])
    np.testing.assert_array_equal(arrays[KEPT_KEY], [1, 3])


def server(**options) -> HeadPruneServer:
    opts = HeadPruneOptions(sparsity=0.5, **options)
    init = {"w": np.zeros((4, 2), dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
    return HeadPruneServer(opts, init, layout=small_layout(), num_clients=10, clients_per_round=2, seed=0)


def upload(rnd, n, kept, w_rows, b, alpha=None, loss=1.0):
    arrays = {"w": np.asarray(w_rows, dtype=np.float32), "b": np.array([b], dtype=np.float32),
              KEPT_KEY: np.array(kept, dtype=np.int32)}
    if alpha is not None:
        arrays[ALPHA_KEY] = np.array(alpha, dtype=np.float32)
    return Payload(arrays, {"round": rnd, "num_examples": n, "train_loss": loss})


def test_eq8_importance_weighted_per_head_and_eq5_for_the_rest():
    s = server(eps=1e-8)
    ups = {  # client 0 keeps heads 0, 1; client 1 keeps heads 1, 2
        0: upload(1, 30, [0, 1], [[1, 1], [2, 2]], 3.0, alpha=[0.6, 0.2, 0, 0]),
        1: upload(1, 10, [1, 2], [[4, 4], [8, 8]], 7.0, alpha=[0, 0.6, 0.4, 0]),
    }
    ok, rejected = s.accept(1, ups)
    assert not rejected
    s.aggregate(1, ok)
    w = s.global_state["w"]
    np.testing.assert_allclose(w[0], [1, 1], rtol=1e-6)  # only client 0 kept head 0
    np.testing.assert_allclose(w[1], [(0.2 * 2 + 0.6 * 4) / 0.8] * 2, rtol=1e-6)
    np.testing.assert_allclose(w[2], [8, 8], rtol=1e-6)
    np.testing.assert_array_equal(w[3], [0, 0])  # nobody kept head 3
    np.testing.assert_allclose(s.global_state["b"], [(30 * 3 + 10 * 7) / 40], rtol=1e-6)


def test_b2_plain_averaging_of_the_senders():
    s = server(pruning="random", aggregation="fedavg")
    ups = {0: upload(1, 30, [0, 1], [[1, 1], [2, 2]], 3.0), 1: upload(1, 10, [1, 2], [[4, 4], [8, 8]], 7.0)}
    ok, rejected = s.accept(1, ups)
    assert not rejected
    s.aggregate(1, ok)
    np.testing.assert_allclose(s.global_state["w"][1], [(30 * 2 + 10 * 4) / 40] * 2, rtol=1e-6)


@pytest.mark.parametrize("mutate,reason", [
    (lambda p: p.arrays.__setitem__(KEPT_KEY, np.array([0, 9], dtype=np.int32)), "in [0, 4)"),
    (lambda p: p.arrays.__setitem__(KEPT_KEY, np.array([1, 0], dtype=np.int32)), "sorted"),
    (lambda p: p.arrays.__setitem__(KEPT_KEY, np.array([0, 1, 2], dtype=np.int32)), "allows 2"),
    (lambda p: p.arrays.pop(KEPT_KEY), "kept head ids"),
    (lambda p: p.arrays.__setitem__("w", np.zeros((3, 2), dtype=np.float32)), "shape"),
    (lambda p: p.arrays.__setitem__(ALPHA_KEY, np.array([-1, 0, 0, 0], dtype=np.float32)), "non-negative"),
    (lambda p: p.arrays.pop(ALPHA_KEY), "missing"),
    (lambda p: p.meta.__setitem__("train_loss", float("nan")), "train_loss"),
])
def test_malformed_sparse_updates_are_rejected(mutate, reason):
    s = server()
    p = upload(1, 5, [0, 1], [[1, 1], [2, 2]], 3.0, alpha=[0.5, 0.5, 0, 0])
    mutate(p)
    ok, rejected = s.accept(1, {4: p})
    assert not ok and reason in rejected[4]


def test_eq9_unseen_first_then_largest_loss_difference():
    chosen, scores = loss_difference_selection({}, None, 5, 2, seed=0, rnd=1)
    again, _ = loss_difference_selection({}, None, 5, 2, seed=0, rnd=1)
    assert chosen == again and all(s == np.inf for s in scores.values())
    seen = {0: 0.9, 1: 0.4, 2: 1.3, 3: 0.7}
    chosen, scores = loss_difference_selection(seen, 0.5, 5, 2, seed=0, rnd=2)
    assert chosen == [2, 4] and scores[2] == pytest.approx(0.8)
    chosen, _ = loss_difference_selection({**seen, 4: 0.1}, 0.5, 5, 2, seed=0, rnd=3)
    assert chosen == [0, 2]


def reference_confidence(att: np.ndarray, mask: np.ndarray, ids: np.ndarray, exclude: set[int]) -> np.ndarray:
    """Direct loops: per head, mean over queries of the max probability over allowed keys."""
    n_heads = att.shape[0]
    out = np.zeros(n_heads)
    valid = [i for i in range(len(ids)) if mask[i]]
    keys = [j for j in valid if ids[j] not in exclude]
    for h in range(n_heads):
        out[h] = np.mean([max(att[h, i, j] for j in keys) for i in valid])
    return out


@pytest.mark.needs_data
def test_importance_matches_direct_computation_and_excludes_separators():
    cfg = tiny_config("algorithm={name: headprune}", "task.max_train_examples=12")
    exp = build_experiment(cfg)
    data = exp.data.train
    res = exp.client_resources
    imp = head_importance(exp.tuned, data, exp.layout, pad_id=res["pad_id"], exclude_token_ids=res["exclude_token_ids"],
                          device=torch.device("cpu"), batch_size=5)
    assert imp.examples == len(data) and imp.alpha.shape == (8,)
    base = exp.tuned.module.get_base_model()
    base.set_attn_implementation("eager")
    exp.tuned.module.eval()
    expected = np.zeros(8)
    with torch.no_grad():
        for i in range(len(data)):
            ids = torch.tensor(data.input_ids[i])[None]
            out = exp.tuned.module(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
            for layer, att in enumerate(out.attentions):
                expected[layer * 4:(layer + 1) * 4] += reference_confidence(
                    att[0].numpy(), np.ones(ids.shape[1], bool), ids[0].numpy(), res["exclude_token_ids"])
    np.testing.assert_allclose(imp.alpha, expected / len(data), rtol=1e-5)
    with_sep = head_importance(exp.tuned, data, exp.layout, pad_id=res["pad_id"], exclude_token_ids=set(),
                               device=torch.device("cpu"))
    assert not np.allclose(with_sep.alpha, imp.alpha)


@pytest.mark.needs_data
def test_pruned_heads_get_no_update_even_with_weight_decay(tmp_path):
    cfg = tiny_config("algorithm={name: headprune, sparsity: 0.5, selection: random}", "train.weight_decay=0.1",
                      "federation.rounds=1", "federation.clients_per_round=1")
    observed = []

    class Importance(fedpeft.RunObserver):
        def on_client_report(self, rnd, client_id, name, value):
            observed.append((rnd, client_id, value))

    rt = EmbeddedRuntime(cfg, tmp_path / "run", observers=[Importance()])
    before = {k: v.copy() for k, v in rt.server.global_state.items()}
    [cid] = rt.server.select(1)
    update, _, _, failure = rt.transport.run_client(1, cid, rt.server.configure(1, [cid])[cid])
    assert failure is None
    kept = {int(h) for h in update.arrays[KEPT_KEY]}
    assert len(kept) == 4
    # the observer sees the full Eq. 6 scores; the upload carries them for kept heads only (Eq. 7)
    [(rnd, c, alpha)] = observed
    assert (rnd, c) == (1, cid)
    sent = update.arrays[ALPHA_KEY]
    assert all(sent[h] == np.float32(alpha[h]) if h in kept else sent[h] == 0 for h in range(len(alpha)))
    tuned_state = rt.exp.tuned.state()
    for name, param in rt.exp.layout.params.items():
        for u in param.units:
            changed = not np.array_equal(tuned_state[name][u.start:u.stop], before[name][u.start:u.stop])
            assert changed == any(h in kept for h in u.heads), (name, u)
    # analytic OPs of the pruned training count the kept fraction of the head rows
    trainer = rt.exp.trainer
    fractions = {f for _, f in trainer._ops_cache}
    assert fractions == {len(kept) / rt.exp.layout.num_heads}
    assert all(v < trainer.ops_per_sequence(T, 1.0) for (T, _), v in trainer._ops_cache.items())


@pytest.mark.parametrize("model,method,extra", [
    ("tiny-bert", "lora", []), ("tiny-gpt2", "lora", GEN), ("tiny-llama", "ia3", GEN),
    ("tiny-t5", "lora", GEN), ("tiny-bart", "lora", GEN), ("tiny-llama", "prefix_tuning", GEN),
])
@pytest.mark.needs_data
def test_method_runs_on_every_architecture_and_sends_less(model, method, extra, tmp_path):
    common = [f"model.name={model}", f"peft={{method: {method}}}", "federation.rounds=2", *extra]
    run(tiny_config(*common, "algorithm={name: headprune, sparsity: 0.75}"), tmp_path / "pruned")
    run(tiny_config(*common, "algorithm={name: headprune, pruning: none, aggregation: fedavg, selection: random}"),
        tmp_path / "dense")
    pruned, dense = read_metrics(tmp_path / "pruned"), read_metrics(tmp_path / "dense")
    assert all(not r.get("rejected") for r in pruned[1:])
    assert pruned[-1]["bytes_up_total"] < dense[-1]["bytes_up_total"]
    assert pruned[1]["agg_sparsity_mean"] == pytest.approx(1 - keep_count(pruned[1]["agg_kept_heads_mean"] * 4, 0.75) / (pruned[1]["agg_kept_heads_mean"] * 4), abs=0.3)
    assert "selection_scores" in pruned[1]


def confidence(att: np.ndarray, queries: list[int], keys: list[int]) -> np.ndarray:
    """Per head: mean over the query positions of the max probability over the key positions."""
    return np.array([np.mean([max(att[h, i, j] for j in keys) for i in queries]) for h in range(att.shape[0])])


@pytest.mark.needs_data
def test_importance_feeds_the_sentence_pair_segments_that_training_feeds():
    cfg = tiny_config("algorithm={name: headprune}", "task.dataset=mnli", "task.train_split=train_subset",
                     "task.eval_split=heldout_subset", "task.max_train_examples=6")
    exp = build_experiment(cfg)
    data, res = exp.data.train, exp.client_resources
    assert data.token_type_ids is not None and any(t.max() == 1 for t in data.token_type_ids)
    imp = head_importance(exp.tuned, data, exp.layout, pad_id=res["pad_id"],
                          exclude_token_ids=res["exclude_token_ids"], device=torch.device("cpu"), batch_size=4)
    exp.tuned.module.get_base_model().set_attn_implementation("eager")
    exp.tuned.module.eval()
    expected = np.zeros(8)
    with torch.no_grad():
        for i in range(len(data)):
            ids = torch.tensor(data.input_ids[i])[None]
            out = exp.tuned.module(input_ids=ids, token_type_ids=torch.tensor(data.token_type_ids[i])[None],
                                   output_attentions=True)
            keys = [j for j, t in enumerate(ids[0].tolist()) if t not in res["exclude_token_ids"]]
            for layer, att in enumerate(out.attentions):
                expected[layer * 4:(layer + 1) * 4] += confidence(att[0].numpy(), list(range(ids.shape[1])), keys)
    np.testing.assert_allclose(imp.alpha, expected / len(data), rtol=1e-5)


@pytest.mark.parametrize("model", ["tiny-t5", "tiny-bart"])
@pytest.mark.parametrize("task", ["seq2seq", "classification"])
@pytest.mark.needs_data
def test_encoder_decoder_importance_masks_the_tokens_the_decoder_reads(model, task):
    """Decoder key j is the token the decoder reads at j (the shifted target), captured from the model."""
    extra = GEN if task == "seq2seq" else []
    exp = build_experiment(tiny_config(f"model.name={model}", "algorithm={name: headprune}",
                                       "task.max_train_examples=5", *extra))
    data, res = exp.data.train, exp.client_resources
    exclude = res["exclude_token_ids"]
    base = exp.tuned.module.get_base_model()
    if model == "tiny-t5":  # make every decoder query attend most to itself, so the last key decides
        with torch.no_grad():
            base.get_decoder().block[0].layer[0].SelfAttention.relative_attention_bias.weight[0] += 8.0
    base.set_attn_implementation("eager")
    exp.tuned.module.eval()
    read: list[torch.Tensor] = []
    hook = base.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: read.append(kwargs["input_ids"]), with_kwargs=True)
    expected = np.zeros(24)
    try:
        with torch.no_grad():
            for i in range(len(data)):
                ids = torch.tensor(data.input_ids[i])[None]
                labels = torch.tensor(np.atleast_1d(data.labels[i]))[None if task == "seq2seq" else ...]
                out = exp.tuned.module(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                                       output_attentions=True)
                dec = read.pop()[0].tolist()
                enc_keys = [j for j, t in enumerate(ids[0].tolist()) if t not in exclude]
                dec_keys = [j for j, t in enumerate(dec) if t not in exclude]
                queries = list(range(len(dec)))
                maps = ([(a, range(ids.shape[1]), enc_keys) for a in out.encoder_attentions]
                        + [(a, queries, dec_keys) for a in out.decoder_attentions]
                        + [(a, queries, enc_keys) for a in out.cross_attentions])
                for m, (att, q, k) in enumerate(maps):
                    expected[m * 4:(m + 1) * 4] += confidence(att[0].numpy(), list(q), k)
    finally:
        hook.remove()
    imp = head_importance(exp.tuned, data, exp.layout, pad_id=res["pad_id"], exclude_token_ids=exclude,
                          device=torch.device("cpu"), batch_size=3)
    if model == "tiny-bart":  # the decoder starts with </s>: it must not count as a key
        assert dec[0] in exclude
    np.testing.assert_allclose(imp.alpha, expected / len(data), rtol=1e-4)


def test_eq9_a_failing_never_seen_client_backs_off_instead_of_starving_the_others():
    init = {"w": np.zeros((4, 2), dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}
    s = HeadPruneServer(HeadPruneOptions(sparsity=0.5), init, layout=small_layout(), num_clients=3,
                        clients_per_round=2, seed=0)

    def round_(rnd, failing):
        chosen = s.select(rnd)
        s.observe_failures(rnd, {c: "rejected" for c in chosen if c == failing})
        s.aggregate(rnd, {c: upload(rnd, 5, [0, 1], [[1, 1], [2, 2]], 3.0, alpha=[0.5, 0.5, 0, 0], loss=0.5 + c)
                          for c in chosen if c != failing})
        return chosen

    bad = round_(1, failing=None)[0]  # every client is never seen (+inf) in round 1
    s.last_loss.pop(bad)  # make `bad` never seen again, and fail from now on
    chosen = round_(2, failing=bad)
    assert bad in chosen and s.failures[bad] == 1 and s.backoff_until[bad] == 3
    assert bad not in round_(3, failing=bad)  # 1st failure: one round off, although it is +inf
    assert s.round_info()["selection_backing_off"] == [bad]
    assert bad in round_(4, failing=bad)  # back: still never seen, so +inf; fails again
    assert s.failures[bad] == 2 and s.backoff_until[bad] == 6
    assert bad not in round_(5, failing=bad) and bad not in round_(6, failing=bad)
    assert bad in round_(7, failing=None)  # a valid update clears the count
    assert bad not in s.failures and bad not in s.backoff_until and bad in s.last_loss


def test_eq9_clients_backing_off_are_chosen_only_when_no_one_else_is_left():
    chosen, scores = loss_difference_selection({0: 0.3}, 0.0, 3, 2, seed=0, rnd=4, backing_off={1, 2})
    assert chosen[:1] == [0] and len(chosen) == 2 and scores[chosen[1]] == -np.inf


def test_a_prompt_narrower_than_the_head_count_splits_into_some_empty_chunks():
    """T5-large: 1,024 prompt dims over 1,152 heads; the empty chunks pack and unpack to nothing."""
    from fedpeft.heads.sparse import unpack_into

    config = registry.load_config("tiny-bert")  # 2 modules x 4 heads = 8 heads
    name = "base_model.prompt_encoder.default.embedding.weight"
    layout = build_layout({name: ((3, 6), "float32")}, config, "prompt_tuning")
    units = layout.params[name].units
    assert len(units) == 8 and sum(u.size for u in units) == 6 and sorted({u.size for u in units}) == [0, 1]
    state = {name: np.arange(18, dtype=np.float32).reshape(3, 6)}
    kept = np.array([u.heads[0] for u in units if u.size == 0][:1] + [units[-1].heads[0]], dtype=np.int32)
    packed = pack(state, layout, kept)
    assert packed[name].shape == (3, 1)
    full = np.zeros((3, 6))
    unpack_into(layout.params[name], packed[name].astype(np.float64), set(kept.tolist()), full)
    np.testing.assert_array_equal(full[:, 5], state[name][:, 5])
    np.testing.assert_array_equal(full[:, :5], 0)


def test_eq9_back_off_survives_a_checkpoint_and_old_checkpoints_load():
    from fedpeft.checkpoint import pack_state, unpack_state

    s = server(selection="loss")
    s.observe_failures(3, {7: "no reply"})
    s.observe_failures(4, {7: "no reply"})
    arrays, tree = pack_state(s.state_dict())
    back = server(selection="loss")
    back.load_state_dict(unpack_state(arrays, tree))
    assert back.failures == {7: 2} and back.backoff_until == {7: 6} and 7 not in back.select(5)
    old = {k: v for k, v in s.state_dict().items() if k not in ("failures", "backoff_until")}
    fresh = server(selection="loss")
    fresh.load_state_dict(old)  # written before the back-off rule: nobody backs off
    assert fresh.failures == {} and fresh.backoff_until == {}
