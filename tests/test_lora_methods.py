"""Federated LoRA methods (ffa_lora, fedsa_lora, hetlora, flexlora): the factor maths against hand-computed
matrices, the servers on hand-made updates, and runs on a tiny model that inspect what travels."""

import numpy as np
import pytest
from helpers import crash_at_round, tiny_config, without_timings

from fedpeft import checkpoint
from fedpeft.algorithms import make_server
from fedpeft.algorithms.lora.common import assign_ranks
from fedpeft.algorithms.lora.hetero.options import FlexLoraOptions, HetLoraOptions, RankGroup
from fedpeft.config import ConfigError
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.tuners.lora_factors import (
    aggregation_error,
    lora_pairs,
    pad_rank,
    svd_factors,
    truncate_rank,
)
from fedpeft.wire import Payload

A, B = "m.lora_A.default.weight", "m.lora_B.default.weight"


def test_aggregation_error_by_hand():
    # B1 A1 = 1*2 = 2, B2 A2 = 3*4 = 12: the mean update is 7, the product of the means 2 * 3 = 6
    states = [{A: np.array([[2.0]]), B: np.array([[1.0]])}, {A: np.array([[4.0]]), B: np.array([[3.0]])}]
    pairs = lora_pairs([A, B, "classifier.weight"])
    assert [(p.module, p.a, p.b) for p in pairs] == [("m", A, B)]
    assert aggregation_error(states, [1, 1], pairs) == pytest.approx(1 / 7)
    # weights 3:1: exact 0.75*2 + 0.25*12 = 4.5, product of means (0.75*1+0.25*3)(0.75*2+0.25*4) = 1.5*2.5 = 3.75
    assert aggregation_error(states, [3, 1], pairs) == pytest.approx(0.75 / 4.5)
    # one A for everyone (FFA-LoRA): exact
    shared = [{A: np.array([[2.0, 1.0]]), B: np.array([[1.0], [5.0]])}, {A: np.array([[2.0, 1.0]]), B: np.array([[3.0], [-1.0]])}]
    assert aggregation_error(shared, [1, 2], pairs) == pytest.approx(0.0, abs=1e-12)
    # larger random factors: the Gram-matrix formula equals the explicit products
    rng = np.random.default_rng(0)
    big = [{A: rng.normal(size=(3, 7)), B: rng.normal(size=(5, 3))} for _ in range(4)]
    w = np.array([1.0, 2.0, 3.0, 4.0]) / 10
    exact = sum(wi * s[B] @ s[A] for wi, s in zip(w, big))
    naive = sum(wi * s[B] for wi, s in zip(w, big)) @ sum(wi * s[A] for wi, s in zip(w, big))
    assert aggregation_error(big, [1, 2, 3, 4], pairs) == pytest.approx(
        np.linalg.norm(exact - naive) / np.linalg.norm(exact), rel=1e-10)
    with pytest.raises(ValueError, match="without its partner"):
        lora_pairs([A])


def test_padding_truncation_and_svd_truncation():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(8, dtype=np.float32).reshape(4, 2)
    pa, pb = pad_rank(a, 4, is_a=True), pad_rank(b, 4, is_a=False)
    assert pa.shape == (4, 3) and not pa[2:].any() and pb.shape == (4, 4) and not pb[:, 2:].any()
    assert np.array_equal(pb @ pa, b @ a)  # zero components add nothing
    assert np.array_equal(truncate_rank(pa, 2, is_a=True), a) and np.array_equal(truncate_rank(pb, 2, is_a=False), b)
    rng = np.random.default_rng(1)
    w = rng.normal(size=(6, 5))
    s = np.linalg.svd(w, compute_uv=False)
    for r in (1, 2, 4):  # Eckart-Young: the error of the best rank-r factorisation is the tail of the spectrum
        fb, fa = svd_factors(w, r)
        assert fb.shape == (6, r) and fa.shape == (r, 5)
        assert np.linalg.norm(w - fb.astype(np.float64) @ fa) == pytest.approx(np.sqrt(np.sum(s[r:] ** 2)), rel=1e-5)
    low = rng.normal(size=(6, 2)) @ rng.normal(size=(2, 5))  # rank 2: rank 3 factors reproduce it exactly
    fb, fa = svd_factors(low, 3)
    assert np.allclose(fb @ fa, low, atol=1e-5) and np.allclose(fa[2], 0, atol=1e-6)
    # transposition check: the factors' shapes follow LoRA's (B: out x r, A: r x in) for a non-square product
    fb, fa = svd_factors(rng.normal(size=(2, 9)), 2)
    assert fb.shape == (2, 2) and fa.shape == (2, 9)


def test_the_svd_falls_back_to_qr_iteration_where_divide_and_conquer_does_not_converge(monkeypatch):
    """numpy's gesdd can fail to converge on an ill-conditioned finite matrix (seen once in the LoRA benchmark's
    FlexLoRA rows); gesvd then gives the same factorisation. A non-finite matrix is refused."""
    w = np.random.default_rng(4).normal(size=(6, 5))
    expected = svd_factors(w, 3, split="b")

    def no_convergence(*args, **kwargs):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(np.linalg, "svd", no_convergence)
    b, a = svd_factors(w, 3, split="b")
    assert np.allclose(b @ a, expected[0] @ expected[1], atol=1e-6)
    assert np.allclose(a @ a.T, np.eye(3), atol=1e-6)
    with pytest.raises(ValueError, match="NaN or infinite"):
        svd_factors(np.full((2, 2), np.nan), 1)


def test_ranks_are_assigned_by_share_seeded_and_overridable():
    groups = [RankGroup(rank=4, share=1 / 3), RankGroup(rank=8, share=1 / 3), RankGroup(rank=16, share=1 / 3)]
    ranks = assign_ranks(10, groups, seed=7)
    assert sorted(ranks) == [4] * 4 + [8] * 3 + [16] * 3  # 3.33 each: the leftover client to the first group
    assert ranks == assign_ranks(10, groups, seed=7) and ranks != assign_ranks(10, groups, seed=8)
    assert assign_ranks(10, groups, seed=7, explicit={0: 2})[0] == 2


def hetero_server(options, initial, ranks_of):
    server = make_server(options, initial, num_clients=len(ranks_of), clients_per_round=len(ranks_of), seed=0)
    server.ranks = list(ranks_of)
    return server


def initial_state(rank=2, out=3, inp=2):
    return {A: np.zeros((rank, inp), np.float32), B: np.zeros((out, rank), np.float32),
            "classifier.weight": np.zeros((2, 2), np.float32)}


def update(rnd, arrays, n):
    return Payload({k: np.asarray(v, np.float32) for k, v in arrays.items()}, {"round": rnd, "num_examples": n})


def test_hetlora_zero_pads_and_averages_by_hand():
    opts = HetLoraOptions(rank_groups=[RankGroup(rank=2, share=1.0)], weighting="examples")
    server = hetero_server(opts, initial_state(), [1, 2])
    payloads = server.configure(1, [0, 1])
    assert payloads[0].arrays[A].shape == (1, 2) and payloads[1].arrays[A].shape == (2, 2)
    assert payloads[0].meta["rank"] == 1
    u0 = update(1, {A: [[1, 2]], B: [[1], [0], [2]], "classifier.weight": np.ones((2, 2))}, 1)
    u1 = update(1, {A: [[3, 4], [5, 6]], B: [[1, 1], [1, 1], [1, 1]], "classifier.weight": np.zeros((2, 2))}, 3)
    ok, rejected = server.accept(1, {0: u0, 1: u1})
    assert set(ok) == {0, 1} and not rejected
    ok, rejected = server.accept(1, {0: u1})  # a rank-1 client sending rank-2 factors
    assert not ok and "an update of rank 2 from client 0, which may send rank 1" in rejected[0]
    metrics = server.aggregate(1, {0: u0, 1: u1})
    g = server.global_state
    assert np.allclose(g[A], [[0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 4], [0.75 * 5, 0.75 * 6]])
    assert np.allclose(g[B], [[1, 0.75], [0.75, 0.75], [1.25, 0.75]])
    assert np.allclose(g["classifier.weight"], 0.25)
    assert metrics["lora_aggregation_error"] > 0
    # norm weighting: client 0's update B A has norm sqrt(1+4+4+16)=5, client 1's has norm ||[1,1]^T [8,10]||
    server = hetero_server(HetLoraOptions(rank_groups=[RankGroup(rank=2, share=1.0)]), initial_state(), [1, 2])
    server.aggregate(1, {0: u0, 1: u1})
    n0, n1 = 5.0, np.linalg.norm(np.ones((3, 1)) @ np.array([[8.0, 10.0]]))
    assert np.allclose(server.global_state[A][1], n1 / (n0 + n1) * np.array([5, 6]), rtol=1e-6)


def test_flexlora_gives_every_client_the_best_factorisation_at_its_rank():
    rng = np.random.default_rng(3)
    opts = FlexLoraOptions(rank_groups=[RankGroup(rank=3, share=1.0)], factorization="balanced")
    init = initial_state(rank=3, out=5, inp=4)
    server = hetero_server(opts, init, [1, 2, 3])
    ups = {}
    for c, r in enumerate([1, 2, 3]):
        ups[c] = update(1, {A: rng.normal(size=(r, 4)), B: rng.normal(size=(5, r)), "classifier.weight": np.ones((2, 2))},
                        c + 1)
    metrics = server.aggregate(1, ups)
    mean = sum(n * ups[c].arrays[B].astype(np.float64) @ ups[c].arrays[A] for c, n in zip(range(3), [1, 2, 3])) / 6
    s = np.linalg.svd(mean, compute_uv=False)
    g = server.global_state
    assert np.linalg.norm(mean - g[B].astype(np.float64) @ g[A]) == pytest.approx(np.sqrt(np.sum(s[3:] ** 2)), abs=1e-5)
    assert metrics["lora_aggregation_error"] == pytest.approx(np.sqrt(np.sum(s[3:] ** 2)) / np.linalg.norm(mean),
                                                              rel=1e-4)
    for c, r in enumerate([1, 2, 3]):  # each client's factors: the best rank-r approximation of the mean product
        p = server.configure(2, [c])[c].arrays
        assert p[A].shape == (r, 4) and p[B].shape == (5, r)
        assert np.linalg.norm(mean - p[B].astype(np.float64) @ p[A]) == pytest.approx(np.sqrt(np.sum(s[r:] ** 2)),
                                                                                       abs=1e-5)


def test_flexlora_reference_factors_follow_the_reference_formulas():
    """FlexLoRA's code (alibaba/FederatedScope, branch FlexLoRA): a rank-r_i client trains at alpha / r_i, the
    server forms dW = sum_i p_i (alpha / r_i) B_i A_i and gives a rank-r client A = V_r^T and
    B = U_r S_r / (alpha / r); here recomputed in float64 from those formulas alone."""
    rng = np.random.default_rng(11)
    alpha, big, ranks, examples = 32.0, 4, [1, 2, 4], [3, 1, 2]
    server = hetero_server(FlexLoraOptions(rank_groups=[RankGroup(rank=4, share=1.0)]),
                           initial_state(rank=big, out=6, inp=5), ranks)
    ups = {c: update(1, {A: rng.normal(size=(r, 5)), B: rng.normal(size=(6, r)), "classifier.weight": np.ones((2, 2))},
                     n) for c, (r, n) in enumerate(zip(ranks, examples))}
    server.aggregate(1, ups)
    p = np.asarray(examples, np.float64) / sum(examples)
    dw = sum(p[c] * (alpha / r) * ups[c].arrays[B].astype(np.float64) @ ups[c].arrays[A].astype(np.float64)
             for c, r in enumerate(ranks))
    u, s, vt = np.linalg.svd(dw)
    for c, r in enumerate(ranks + [big]):  # each client, then the global model (at peft.r, scale alpha / peft.r)
        got = server.configure(2, [c])[c].arrays if c < len(ranks) else server.global_state
        a, b = got[A].astype(np.float64), got[B].astype(np.float64)
        assert a.shape == (r, 5) and b.shape == (6, r)
        signs = np.sign(np.sum(a * vt[:r], axis=1))  # singular vectors are unique up to sign
        assert np.allclose(a, signs[:, None] * vt[:r], atol=1e-6)  # A = V_r^T: orthonormal rows
        assert np.allclose(b, u[:, :r] * s[:r] * signs / (alpha / r), rtol=1e-5, atol=1e-6)  # B = U_r S_r / scale
    balanced = hetero_server(FlexLoraOptions(rank_groups=[RankGroup(rank=4, share=1.0)], factorization="balanced"),
                             initial_state(rank=big, out=6, inp=5), ranks)
    balanced.aggregate(1, ups)  # the other choice: one scale for all ranks, sqrt(S) in both factors
    mean = sum(p[c] * ups[c].arrays[B].astype(np.float64) @ ups[c].arrays[A] for c in range(3))
    g = balanced.global_state
    mu, ms, mvt = np.linalg.svd(mean)
    assert np.allclose(g[B].astype(np.float64) @ g[A], (mu[:, :big] * ms[:big]) @ mvt[:big], atol=1e-5)
    assert np.allclose(np.linalg.norm(g[A], axis=1), np.linalg.norm(g[B], axis=0), rtol=1e-5)


@pytest.mark.needs_data
def test_a_flexlora_client_trains_at_alpha_over_its_rank(tmp_path, monkeypatch, caplog):
    from fedpeft.algorithms.lora.hetero import halves

    cfg = tiny_config("algorithm.name=flexlora", "peft.r=4", "peft.alpha=8", "runtime.clients_per_pass=2",
                      "algorithm.rank_groups=[{rank: 1, share: 0.5}, {rank: 4, share: 0.5}]")
    rt = EmbeddedRuntime(cfg, tmp_path / "flex")
    assert rt.transport.cohort is None and "flexlora declares trains_batched = False" in caplog.text  # one scale per layer
    seen = []

    def train(self, ctx, pairs, rank):
        layer = ctx.tuned.module.get_submodule(pairs[0].module)
        seen.append((rank, float(layer.scaling["default"])))
        return ctx.train(), rank

    monkeypatch.setattr(halves.HeteroRankClient, "train", train)
    for c in (rt.server.ranks.index(1), rt.server.ranks.index(4)):
        _, _, _, failure = rt.transport.run_client(1, c, rt.server.configure(1, [c])[c])
        assert failure is None
    assert seen == [(1, 8.0), (4, 2.0)]  # alpha / r_i, not alpha / peft.r = 2 for both
    layer = rt.exp.tuned.module.get_submodule(lora_pairs(rt.exp.tuned.params)[0].module)
    assert layer.scaling["default"] == 2.0  # restored for whoever uses the model next
    rt.close()


def test_hetlora_accepts_a_pruned_rank_and_serves_it_from_then_on():
    server = hetero_server(HetLoraOptions(rank_groups=[RankGroup(rank=4, share=1.0)], decay=0.5),
                           initial_state(rank=4), [4, 4])
    server.configure(1, [0, 1])
    pruned = update(1, {A: np.ones((2, 2)), B: np.ones((3, 2)), "classifier.weight": np.ones((2, 2))}, 1)
    kept = update(1, {A: np.ones((4, 2)), B: np.ones((3, 4)), "classifier.weight": np.ones((2, 2))}, 1)
    odd = update(1, {A: np.ones((3, 2)), B: np.ones((3, 3)), "classifier.weight": np.ones((2, 2))}, 1)
    ok, rejected = server.accept(1, {0: pruned, 1: kept})
    assert set(ok) == {0, 1} and not rejected
    ok, rejected = server.accept(1, {1: odd})
    assert not ok and "an update of rank 3 from client 1, which may send rank 4 or 2" in rejected[1]
    server.aggregate(1, {0: pruned, 1: kept})
    assert server.ranks == [2, 4] and server.round_info() == {"client_rank": {"0": 4, "1": 4}, "pruned_rank": {"0": 2}}
    assert server.configure(2, [0])[0].arrays[A].shape == (2, 2) and server.state_dict()["ranks"] == [2, 4]
    ok, rejected = server.accept(2, {0: kept})  # no way back up
    assert not ok and "may send rank 2 or 1" in rejected[0]
    off = hetero_server(HetLoraOptions(rank_groups=[RankGroup(rank=4, share=1.0)], self_pruning=False),
                        initial_state(rank=4), [4, 4])
    off.configure(1, [0])
    assert "may send rank 4" in off.accept(1, {0: pruned})[1][0]
    assert HetLoraOptions(decay=0.99).pruned_rank(16) == 15 and HetLoraOptions().pruned_rank(1) is None


@pytest.mark.needs_data
def test_hetlora_self_pruning_drops_trailing_components_the_regulariser_shrank(tmp_path):
    """A rank-4 client with decay 0.5: its trailing components 2..4 are made large at the start and penalised;
    they shrink, so it prunes to rank 2. Trailing components that start at zero cannot shrink: no pruning."""
    import torch

    from fedpeft.algorithms.lora.hetero.halves import tail_norm

    def client_run(tail, regularization, name, *extra):
        cfg = tiny_config("algorithm.name=hetlora", "peft.r=4", "algorithm.rank_groups=[{rank: 4, share: 1.0}]",
                          "algorithm.decay=0.5", f"algorithm.regularization={regularization}", "peft.dropout=0.0",
                          *extra)
        rt = EmbeddedRuntime(cfg, tmp_path / name)
        pairs = lora_pairs(rt.exp.tuned.params)
        state = dict(rt.server.global_state)
        for p in pairs:
            state[p.a] = state[p.a].copy()
            state[p.b] = np.full_like(state[p.b], 0.01)
            state[p.a][2:], state[p.b][:, 2:] = tail, tail
        rt.server.global_state = state
        start = float(tail_norm({k: torch.from_numpy(v) for k, v in state.items()}, pairs, 2, 4))
        update, _, _, failure = rt.transport.run_client(1, 0, rt.server.configure(1, [0])[0])
        assert failure is None
        end = float(tail_norm(rt.exp.tuned.params, pairs, 2, 4).detach())
        trained = {p.a: rt.exp.tuned.params[p.a].detach().numpy().copy() for p in pairs}
        rt.close()
        return update, pairs, start, end, trained

    update, pairs, start, end, trained = client_run(0.5, 1.0, "shrunk")
    assert end < start and update.meta["rank"] == 2
    for p in pairs:  # the first two components as trained; the pruned ones are not sent
        assert update.arrays[p.a].shape == (2, trained[p.a].shape[1])
        assert np.array_equal(update.arrays[p.a], trained[p.a][:2])
    _, _, _, end0, _ = client_run(0.5, 0.0, "unpenalised")
    assert end0 > end  # the regulariser is what shrank them
    update, _, start, end, _ = client_run(0.0, 1.0, "zero")
    assert start == 0.0 and update.meta["rank"] == 4
    # a threshold instead of the start: below it prunes (even with nothing shrunk), above it does not
    assert client_run(0.0, 1.0, "under", f"algorithm.threshold={end + 1}")[0].meta["rank"] == 2
    assert client_run(0.5, 1.0, "over", "algorithm.threshold=1e-9")[0].meta["rank"] == 4


PRUNING_EVERY_ROUND = ["algorithm.name=hetlora", "peft.r=4", "algorithm.rank_groups=[{rank: 4, share: 1.0}]",
                       "algorithm.decay=0.5", "algorithm.threshold=1e9", "federation.rounds=3",
                       "federation.clients_per_round=4"]


@pytest.mark.needs_data
def test_hetlora_clients_that_prune_are_served_at_their_new_rank_also_after_a_resume(tmp_path):
    """threshold 1e9: every client prunes whenever it trains (decay 0.5: 4 -> 2 -> 1); the server serves each at
    its new rank, the bytes follow, and a resumed server has the pruned ranks (tests/test_clients_per_pass.py:
    the same run with the clients trained together)."""
    rt = EmbeddedRuntime(tiny_config(*PRUNING_EVERY_ROUND), tmp_path / "alone")
    rt.run()
    assert rt.server.ranks == [1, 1, 1, 1]
    rows = [r for r in read_metrics(tmp_path / "alone") if r["round"] > 0]
    assert [r["client_rank"] for r in rows] == [{str(c): r for c in range(4)} for r in (4, 2, 1)]
    assert [r.get("pruned_rank") for r in rows] == [{str(c): r for c in range(4)} for r in (2, 1)] + [None]
    up, down = [r["bytes_up"]["0"] for r in rows], [r["bytes_down"]["0"] for r in rows]
    assert up[0] > up[1] == up[2] and down[0] > down[1] > down[2]  # sent at ranks 2, 1, 1; served at 4, 2, 1
    server = make_server(rt.cfg.algorithm, rt.server.global_state, num_clients=4, clients_per_round=4,
                         seed=rt.cfg.seed)
    assert server.ranks == [4, 4, 4, 4]
    server.load_state_dict(checkpoint.load(tmp_path / "alone")[1]["server"])
    assert server.ranks == [1, 1, 1, 1]  # from the checkpoint, not the assignment
    state = server.state_dict()
    del state["ranks"]
    with pytest.raises(ValueError, match="written before its clients' ranks were saved"):
        server.load_state_dict(state)
    with pytest.raises(ValueError, match="do not fit 4 clients of rank 1..4"):
        server.load_state_dict({**state, "ranks": [1, 8, 1, 1]})


def test_the_methods_refuse_other_peft_methods_and_impossible_ranks():
    with pytest.raises(ConfigError, match="peft.method: lora"):
        tiny_config("algorithm.name=ffa_lora", "peft.method=ia3")
    with pytest.raises(ConfigError, match="must lie in 1..peft.r"):
        tiny_config("algorithm.name=hetlora", "peft.r=4", "algorithm.rank_groups=[{rank: 8, share: 1.0}]")
    with pytest.raises(ConfigError, match="sum to 0.5"):
        tiny_config("algorithm.name=flexlora", "algorithm.rank_groups=[{rank: 2, share: 0.5}]")
    with pytest.raises(ConfigError, match="set eval.personalized: true"):
        tiny_config("algorithm.name=fedsa_lora")
    with pytest.raises(ConfigError, match="set model.dtype: float32"):
        tiny_config("algorithm.name=fedex_lora", "model.dtype=bfloat16")
    with pytest.raises(ConfigError, match="client 9 does not exist"):
        tiny_config("algorithm.name=flexlora", "algorithm.rank_groups=[{rank: 2, share: 1}]",
                    "algorithm.client_ranks={9: 2}")
    with pytest.raises(ConfigError, match="must lie in 1..peft.r"):
        tiny_config("algorithm.name=flora", "peft.r=4", "algorithm.client_ranks={0: 8}")
    with pytest.raises(ConfigError, match="sum to 0.5"):
        tiny_config("algorithm.name=flora", "algorithm.rank_groups=[{rank: 2, share: 0.5}]")
    with pytest.raises(ConfigError, match="rank_groups"):
        tiny_config("algorithm.name=flora", "algorithm.rank_groups=[]")


@pytest.mark.needs_data
def test_a_flora_client_below_peft_r_trains_only_its_first_components(tmp_path):
    from fedpeft.runtime.local_work import train_client

    rt = EmbeddedRuntime(tiny_config("algorithm.name=flora", "peft.r=4", "algorithm.client_ranks={0: 2}"), tmp_path)
    payload = rt.server.configure(1, [0])[0]
    assert payload.meta["rank"] == 2
    update = train_client(rt.exp, rt.client, 1, 0, payload, {})
    params = rt.exp.tuned.params  # the shared model as client 0 left it
    for p in lora_pairs(params):
        a, b = params[p.a].detach().numpy(), params[p.b].detach().numpy()
        assert np.all(a[2:] == 0) and np.all(b[:, 2:] == 0) and np.abs(a[:2]).min() > 0 and np.abs(b[:, :2]).sum() > 0
        assert update.arrays[p.a].shape[0] == update.arrays[p.b].shape[1] == 2
        np.testing.assert_array_equal(update.arrays[p.a], a[:2])


def spy_configure(rt) -> dict[int, dict[int, Payload]]:
    """Record every payload the server builds (round -> client -> payload)."""
    sent: dict[int, dict[int, Payload]] = {}
    real = rt.server.configure

    def spy(rnd, clients):
        sent[rnd] = real(rnd, clients)
        return sent[rnd]

    rt.server.configure = spy
    return sent


class Uploads:
    """Record every decoded update the embedded runtime receives."""

    def __init__(self, rt):
        self.seen: dict[int, dict[int, Payload]] = {}
        real = rt.transport.run_client

        def spy(rnd, cid, payload):
            result = real(rnd, cid, payload)
            self.seen.setdefault(rnd, {})[cid] = result[0]
            return result

        rt.transport.run_client = spy


@pytest.mark.needs_data
def test_ffa_lora_keeps_a_bit_identical_and_sends_b_only_with_zero_error(tmp_path):
    rt = EmbeddedRuntime(tiny_config("algorithm.name=ffa_lora", "federation.rounds=2", "peft.r=4"), tmp_path / "ffa")
    a_names = [p.a for p in lora_pairs(rt.server.global_state)]
    before = {k: rt.server.global_state[k].copy() for k in a_names}
    uploads = Uploads(rt)
    rt.run()
    for k in a_names:  # on the server and in the model (which every client trained)
        assert np.array_equal(rt.server.global_state[k], before[k])
        assert np.array_equal(rt.exp.tuned.params[k].detach().numpy(), before[k])
    for per_client in uploads.seen.values():
        for p in per_client.values():
            assert p is not None and not set(p.arrays) & set(a_names) and any(".lora_B." in k for k in p.arrays)
    rows = [r for r in read_metrics(tmp_path / "ffa") if r["round"] > 0]
    assert all(r["agg_lora_aggregation_error"] < 1e-6 for r in rows)
    fedavg = EmbeddedRuntime(tiny_config("federation.rounds=2", "peft.r=4"), tmp_path / "avg")
    fedavg.run()
    avg_rows = [r for r in read_metrics(tmp_path / "avg") if r["round"] > 0]
    assert all(r["agg_lora_aggregation_error"] > 1e-4 for r in avg_rows)
    # A is half of LoRA's factors here (r x in = 4 x 32, B = 32 x 4): up- and download drop by that many floats
    saved = 4 * sum(before[k].size for k in a_names)
    assert avg_rows[0]["bytes_up_total"] - rows[0]["bytes_up_total"] >= 2 * saved
    assert avg_rows[0]["bytes_down_total"] - rows[0]["bytes_down_total"] >= 2 * saved


@pytest.mark.needs_data
@pytest.mark.parametrize("local_head", [True, False])
def test_fedsa_lora_b_and_by_default_the_head_never_leave_a_client(local_head, tmp_path):
    cfg = tiny_config("algorithm.name=fedsa_lora", "federation.rounds=3", "peft.r=4", "train.lr=0.01",
                      "eval.personalized=true", f"algorithm.local_head={str(local_head).lower()}")
    rt = EmbeddedRuntime(cfg, tmp_path / "sa")
    pairs = lora_pairs(rt.server.global_state)
    head = {k for k in rt.server.global_state if k not in {n for p in pairs for n in (p.a, p.b)}}
    assert head and all("classifier" in k and "modules_to_save" in k for k in head)  # the task head
    b_names = {p.b for p in pairs} | (head if local_head else set())
    initial_b = {k: rt.server.global_state[k].copy() for k in b_names}
    initial_head = {k: rt.server.global_state[k].copy() for k in head}
    sent = spy_configure(rt)
    uploads = Uploads(rt)
    rt.run()
    for per_client in uploads.seen.values():
        for p in per_client.values():
            assert not set(p.arrays) & b_names and any(".lora_A." in k for k in p.arrays)
    served = set()
    for rnd in sorted(sent):
        for c, p in sent[rnd].items():  # the initial B goes out only until the client's first update lands
            assert (set(p.arrays) >= b_names) == (c not in served)
        served |= set(uploads.seen[rnd])
    for k in b_names:
        assert np.array_equal(rt.server.global_state[k], initial_b[k])
    if not local_head:  # the head travels and is averaged
        assert all(set(p.arrays) >= head for per_client in uploads.seen.values() for p in per_client.values())
        assert not all(np.array_equal(rt.server.global_state[k], initial_head[k]) for k in head)
    kept = [rt.client_states[c]["lora_B"] for c in sorted(served)]
    assert len(kept) >= 2 and all(set(s) == b_names for s in kept)
    assert all(np.abs(s[k]).sum() > 0 for s in kept for k in b_names if ".lora_B." in k)
    assert not all(np.array_equal(kept[0][k], kept[1][k]) for k in b_names)  # personal, not shared


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["hetlora", "flexlora"])
def test_heterogeneous_ranks_send_and_receive_at_each_clients_rank(name, tmp_path):
    cfg = tiny_config(f"algorithm.name={name}", "peft.r=4", "federation.clients_per_round=4",
                      "algorithm.rank_groups=[{rank: 1, share: 0.5}, {rank: 4, share: 0.5}]",
                      *(["algorithm.self_pruning=false"] if name == "hetlora" else []))  # ranks fixed here
    rt = EmbeddedRuntime(cfg, tmp_path / name)
    uploads = Uploads(rt)
    rt.run()
    ranks = rt.server.ranks
    assert sorted(ranks) == [1, 1, 4, 4]
    rows = [r for r in read_metrics(tmp_path / name) if r["round"] > 0]
    for r in rows:
        assert r["client_rank"] == {str(c): ranks[c] for c in r["clients"]}
        small = [c for c in r["clients"] if ranks[c] == 1]
        large = [c for c in r["clients"] if ranks[c] == 4]
        assert all(r["bytes_up"][str(s)] < r["bytes_up"][str(lg)] for s in small for lg in large)
        assert all(r["bytes_down"][str(s)] < r["bytes_down"][str(lg)] for s in small for lg in large)
        assert r["agg_lora_aggregation_error"] >= 0
    for per_client in uploads.seen.values():
        for c, p in per_client.items():
            a = next(v for k, v in p.arrays.items() if ".lora_A." in k)
            assert a.shape[0] == ranks[c]


@pytest.mark.needs_data
@pytest.mark.parametrize("algorithm", [
    ["algorithm.name=ffa_lora"], ["algorithm.name=fedsa_lora", "eval.personalized=true"],
    ["algorithm.name=hetlora", "algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"],
    ["algorithm.name=flexlora", "algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"],
    ["algorithm.name=flora"], ["algorithm.name=fedex_lora"],
])
def test_resume_of_each_lora_method_ends_like_an_uninterrupted_run(algorithm, tmp_path, monkeypatch):
    cfg = tiny_config(*algorithm, "peft.r=4", "federation.rounds=3", "peft.dropout=0.0")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    cut = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_at_round(cut, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    assert checkpoint.load(tmp_path / "cut")[0] == 2
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    assert without_timings(read_metrics(tmp_path / "full")) == without_timings(read_metrics(tmp_path / "cut"))


def test_a_fresh_process_knows_the_lora_methods_when_it_reads_a_config():
    """The CLI and the Flower apps validate a config before anything imports the algorithms."""
    import subprocess
    import sys

    code = ("from fedpeft.config import load_config; "
            "print(load_config(None, ['algorithm.name=flexlora', 'peft.r=16']).algorithm.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "flexlora"


def test_stacking_is_the_weighted_sum_of_the_products():
    rng = np.random.default_rng(5)
    blocks = [(0.25, rng.normal(size=(6, 2)), rng.normal(size=(2, 5))), (0.75, rng.normal(size=(6, 3)),
                                                                           rng.normal(size=(3, 5)))]
    from fedpeft.tuners.lora_factors import stack

    b, a, err = stack(blocks)
    assert b.shape == (6, 5) and a.shape == (5, 5)  # ranks 2 + 3 stacked
    exact = sum(c * bb @ aa for c, bb, aa in blocks)
    np.testing.assert_allclose(b.astype(np.float64) @ a, exact, rtol=1e-5, atol=1e-6)
    assert np.allclose(b[:, :2], 0.25 * blocks[0][1]) and np.allclose(a[2:], blocks[1][2])  # not transposed
    assert err == pytest.approx(np.linalg.norm(exact - b.astype(np.float64) @ a), rel=1e-3, abs=1e-12)
    assert err < 1e-5 * np.linalg.norm(exact)


def base_weights(tuned):
    from fedpeft.tuners.lora_factors import lora_pairs

    return {p.module: tuned.module.get_submodule(p.module).base_layer.weight.detach().clone().numpy()
            for p in lora_pairs(tuned.params)}


HETERO_FLORA = ["algorithm.rank_groups=[{rank: 1, share: 0.5}, {rank: 3, share: 0.25}, {rank: 4, share: 0.25}]",
                "federation.clients_per_round=4"]


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["flora", "flora-ranks", "fedex_lora"])
@pytest.mark.parametrize("model", ["tiny-bert", "tiny-gpt2", "tiny-t5"])  # Linear, Conv1D (in x out), seq2seq
def test_merging_methods_make_the_global_model_the_exact_mean_of_the_clients(name, model, tmp_path):
    """The merged weights change by exactly scale x sum_i w_i B_i A_i (float64), FLoRA's clients at one rank or
    at heterogeneous ranks (flora-ranks), each sending its own rank's factors."""
    from golden_runs import LM

    task = [] if model == "tiny-bert" else LM
    ranks = HETERO_FLORA if name == "flora-ranks" else []
    name = name.split("-")[0]
    cfg = tiny_config(f"model.name={model}", *task, f"algorithm.name={name}", "peft.r=4", "federation.rounds=1",
                      "peft.dropout=0.0", *ranks)
    rt = EmbeddedRuntime(cfg, tmp_path / name)
    before = base_weights(rt.exp.tuned)
    transposed = {p.module: getattr(rt.exp.tuned.module.get_submodule(p.module), "fan_in_fan_out", False)
                  for p in lora_pairs(rt.exp.tuned.params)}
    uploads = Uploads(rt)
    rt.run()
    after = base_weights(rt.exp.tuned)
    ups = uploads.seen[1]
    ids = sorted(ups)
    if ranks:
        assert sorted(rt.server.ranks) == [1, 1, 3, 4]
        assert all(ups[c].arrays[p.a].shape[0] == ups[c].arrays[p.b].shape[1] == rt.server.ranks[c]
                   for c in ids for p in lora_pairs(ups[c].arrays))
    n = np.array([ups[c].meta["num_examples"] for c in ids], dtype=np.float64)
    w = n / n.sum()
    glob = rt.server.global_state
    for p in lora_pairs(glob):
        layer = rt.exp.tuned.module.get_submodule(p.module)
        s = layer.scaling["default"]
        exact = s * sum(wi * ups[c].arrays[p.b].astype(np.float64) @ ups[c].arrays[p.a] for wi, c in zip(w, ids))
        merged = (after[p.module] - before[p.module]).astype(np.float64)
        effective = (merged.T if transposed[p.module] else merged) + s * glob[p.b].astype(np.float64) @ glob[p.a]
        # (FLoRA's global B is zero: the merged weights alone are the update)
        np.testing.assert_allclose(effective, exact, rtol=1e-3, atol=1e-6)
    assert any(transposed.values()) == (model == "tiny-gpt2")
    row = read_metrics(tmp_path / name)[1]
    if ranks:  # the stack is as wide as the round's ranks together, and each client's bytes follow its rank
        assert row["agg_stacked_rank"] == 9 and row["client_rank"] == {str(c): rt.server.ranks[c] for c in ids}
        by_rank = sorted(ids, key=lambda c: rt.server.ranks[c])
        assert [row["bytes_up"][str(c)] for c in by_rank] == sorted(row["bytes_up"][str(c)] for c in by_rank)
        assert row["bytes_up"][str(by_rank[0])] < row["bytes_up"][str(by_rank[-1])]
    # the merge rounds the update to the float32 weights: relatively more, the smaller the update (T5 FedEx: 1e-3)
    assert row["agg_lora_aggregation_error"] < 1e-6 and 0 < row["agg_lora_merge_error"] < 1e-2
    if name == "fedex_lora":
        assert row["agg_lora_residual"] > 1e-4  # what FedAvg of A and B alone would have missed


@pytest.mark.needs_data
def test_flora_downloads_grow_with_the_rounds_a_client_missed(tmp_path):
    cfg = tiny_config("algorithm.name=flora", "peft.r=4", "federation.rounds=4")
    rt = EmbeddedRuntime(cfg, tmp_path / "flora")
    sent = spy_configure(rt)
    rt.run()
    rows = read_metrics(tmp_path / "flora")
    last_seen: dict[int, int] = {}
    for r in rows[1:]:
        rnd = r["round"]
        for c in r["clients"]:
            rounds = sent[rnd][c].meta["merge_rounds"]
            assert rounds == list(range(last_seen.get(c, 0) + 1, rnd))  # every round since it last reported
            assert not any(".lora_" in k and not k.startswith("merge/") for k in sent[rnd][c].arrays)
            last_seen[c] = rnd - 1
        sizes = {c: len(sent[rnd][c].meta["merge_rounds"]) for c in r["clients"]}
        for a in r["clients"]:
            for b in r["clients"]:
                if sizes[a] > sizes[b]:
                    assert r["bytes_down"][str(a)] > r["bytes_down"][str(b)]
    with pytest.raises(ConfigError, match="frozen in 4 or 8 bits"):
        tiny_config("algorithm.name=flora", "model.quantization={bits: 4}")
    import fedpeft

    with pytest.raises(fedpeft.UserError, match="is not the run's model: a flora run merges"):
        fedpeft.load_adapter(tmp_path / "flora" / "adapter")


@pytest.mark.needs_data
def test_refusals_a_client_half_makes_and_how_the_server_recovers(tmp_path):
    # FFA-LoRA: a client whose frozen A differs from the server's refuses to train
    rt = EmbeddedRuntime(tiny_config("algorithm.name=ffa_lora", "peft.r=4"), tmp_path / "ffa")
    payload = rt.server.configure(1, [0])[0]
    payload.meta["frozen_a_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="frozen LoRA A differs"):
        rt.transport.run_client(1, 0, payload)
    rt.close()
    # FedSA-LoRA: a served client that lost its B fails once, then gets the initial B again
    rt = EmbeddedRuntime(tiny_config("algorithm.name=fedsa_lora", "peft.r=4", "eval.personalized=true"),
                         tmp_path / "sa")
    rt.server.served = [0]
    with pytest.raises(ValueError, match=r"holds no LoRA B \(and task head\) of its own"):
        rt.transport.run_client(1, 0, rt.server.configure(1, [0])[0])
    rt.server.observe_failures(1, {0: "lost"})
    update, _, _, failure = rt.transport.run_client(1, 0, rt.server.configure(1, [0])[0])
    assert failure is None and update is not None
    rt.close()
    # FLoRA: a client whose model lost its merges fails, and from then on gets the whole history
    rt = EmbeddedRuntime(tiny_config("algorithm.name=flora", "peft.r=4", "federation.rounds=2"), tmp_path / "flora")
    rt.run()
    from fedpeft.algorithms.lora.merge import MERGED_ATTR

    c = next(iter(rt.server.synced))
    assert rt.server.configure(3, [c])[c].meta["merge_rounds"] == [r for r in (1, 2) if r > rt.server.synced[c]]
    if rt.server.synced[c] > 0:
        setattr(rt.exp.tuned.module, MERGED_ATTR, 0)  # as a restarted process's fresh model
        with pytest.raises(ValueError, match="lost its merged backbone"):
            rt.transport.run_client(3, c, rt.server.configure(3, [c])[c])
    rt.server.observe_failures(3, {c: "lost"})
    assert rt.server.configure(3, [c])[c].meta["merge_rounds"] == [1, 2]
    rt.close()


@pytest.mark.needs_data
def test_a_low_rank_client_trains_only_its_own_components(tmp_path):
    cfg = tiny_config("algorithm.name=hetlora", "peft.r=4", "algorithm.rank_groups=[{rank: 4, share: 1.0}]",
                      "algorithm.client_ranks={1: 1}", "train.weight_decay=0.1", "peft.dropout=0.3")
    rt = EmbeddedRuntime(cfg, tmp_path / "het")
    rt.server.global_state = {k: v + 0.01 for k, v in rt.server.global_state.items()}  # nothing starts at zero
    update, _, _, failure = rt.transport.run_client(1, 1, rt.server.configure(1, [1])[1])
    assert failure is None
    for p in lora_pairs(rt.exp.tuned.params):
        a = rt.exp.tuned.params[p.a].detach().numpy()
        b = rt.exp.tuned.params[p.b].detach().numpy()
        assert not a[1:].any() and not b[:, 1:].any()  # the padded components stayed exactly zero
        assert a[0].any() and update.arrays[p.a].shape[0] == 1
    rt.close()


def test_lora_on_an_embedding_layer_is_refused_by_the_lora_methods():
    from fedpeft.algorithms.lora.common import pairs_in

    names = [A, B, "emb.lora_embedding_A.default", "emb.lora_embedding_B.default"]
    with pytest.raises(ValueError, match="linear layers only"):
        pairs_in(names, "ffa_lora")
    assert [p.module for p in lora_pairs(names)] == ["m"]  # FedAvg's error metric just leaves it out


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["ffa_lora", "fedsa_lora", "flora", "fedex_lora", "hetlora", "flexlora"])
@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-t5", "tiny-llama"])
def test_each_lora_method_runs_on_each_kind_of_backbone(name, model, tmp_path):
    from golden_runs import LM

    extra = {"fedsa_lora": ["eval.personalized=true"],
             "hetlora": ["algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"],
             "flexlora": ["algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"]}.get(name, [])
    cfg = tiny_config(f"model.name={model}", *LM, f"algorithm.name={name}", "peft.r=4", "federation.rounds=1", *extra)
    EmbeddedRuntime(cfg, tmp_path / name).run()
    row = read_metrics(tmp_path / name)[1]
    assert not row["rejected"] and np.isfinite(row["train_loss"]) and "eval_rougeL" in row
