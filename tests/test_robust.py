"""Byzantine-robust aggregation (algorithm.robust) and simulated attackers (federation.attackers): the rules
against hand-computed updates, the config refusals, the attacks' arithmetic, and runs that attack and defend."""

import numpy as np
import pytest
from helpers import crash_in_checkpoint, tiny_config, without_timings
from pydantic import ValidationError
from test_resume import assert_same_run

from fedpeft.algorithms import ALGORITHMS, make_server
from fedpeft.algorithms.robust.krum import (
    KrumRule,
    MultiKrumRule,
    krum_scores,
    multi_krum,
    pairwise_sq_distances,
)
from fedpeft.algorithms.robust.median import MedianRule, coordinate_median
from fedpeft.algorithms.robust.norm_bound import NormBoundRule, norm_bounded_mean
from fedpeft.algorithms.robust.registry import robust_aggregate
from fedpeft.algorithms.robust.trimmed_mean import TrimmedMeanRule, trim_count, trimmed_mean
from fedpeft.config import ConfigError
from fedpeft.data.batching import Encoded
from fedpeft.rundir import read_metrics
from fedpeft.runtime.attacks import attacker_ids, flip_labels, poison
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.wire import Payload


def col(*values):
    """One update of a single 1-D tensor "w"."""
    return {"w": np.array(values, dtype=np.float32)}


def test_median_and_trimmed_mean_by_hand():
    ups = [col(1, 10), col(2, -5), col(100, 0), col(3, 1), col(-50, 2)]
    assert coordinate_median(ups)["w"].tolist() == [2, 1]
    # beta 0.2 of 5 drops one value at each end: (1, 2, 3) and (0, 1, 2)
    assert trimmed_mean(ups, 0.2)["w"].tolist() == pytest.approx([2.0, 1.0])
    # beta 0.4 of 5 drops two at each end: the median
    assert trimmed_mean(ups, 0.4)["w"].tolist() == [2, 1]
    # beta 0.1 of 5 drops none: the plain mean
    assert trimmed_mean(ups, 0.1)["w"].tolist() == pytest.approx([56 / 5, 8 / 5])
    # several tensors: each coordinate of each tensor on its own, shapes kept
    two = [{"a": np.full((2, 2), v, np.float32), "b": np.array([v], np.float32)} for v in (1.0, 5.0, 2.0)]
    med = coordinate_median(two)
    assert med["a"].shape == (2, 2) and (med["a"] == 2).all() and med["b"].tolist() == [2]
    with pytest.raises(ValueError, match="other tensors or shapes"):
        coordinate_median([col(1, 2), col(1, 2, 3)])


def test_krum_and_multi_krum_by_hand():
    # points 0, 1, 2, 10, 11 with f = 1: each is scored over its n - f - 2 = 2 nearest others
    ups = [col(v) for v in (0, 1, 2, 10, 11)]
    distances = pairwise_sq_distances(ups)
    assert distances[0].tolist() == [0, 1, 4, 100, 121]
    assert krum_scores(distances, 1).tolist() == [1 + 4, 1 + 1, 1 + 4, 1 + 64, 1 + 81]
    krum = multi_krum(ups, 1, 1)
    assert krum.kept == [1] and krum.aggregate["w"].tolist() == [1]
    # Multi-Krum keeps n - f = 4 lowest scores: 0, 1, 2 and 10; its mean is unweighted
    mk = multi_krum(ups, 1, None)
    assert mk.kept == [0, 1, 2, 3] and mk.aggregate["w"].tolist() == [pytest.approx(13 / 4)]
    # in several dimensions the distances are Euclidean
    # in several dimensions (and tensors) the distances are Euclidean over all of them
    pts = [{"x": np.array([x], np.float32), "y": np.array([y], np.float32)} for x, y in ((0, 0), (3, 4), (0, 1), (6, 8))]
    assert krum_scores(pairwise_sq_distances(pts), 0).tolist() == pytest.approx([1 + 25, 18 + 25, 1 + 18, 25 + 85])
    # a large shared component does not swamp the distances (they are taken between centred updates)
    shifted = [{"w": np.array([1e4 + v * 1e-3], np.float64)} for v in (0, 1, 2)]
    assert pairwise_sq_distances(shifted)[0].tolist() == pytest.approx([0, 1e-6, 4e-6], rel=1e-6)
    with pytest.raises(ValueError, match="at least f \\+ 3"):
        krum_scores(distances[:3, :3], 1)
    with pytest.raises(ValueError, match="between 1 and n - f = 4"):
        multi_krum(ups, 1, 5)


def test_norm_bounding_by_hand():
    ups = [{"w": np.array([3.0, 0.0], np.float32)}, {"w": np.array([0.0, 4.0], np.float32)}]
    res = norm_bounded_mean(ups, [1, 1], None)  # the bound is the median norm 3.5: the second is scaled to it
    assert res.bound == 3.5 and res.clipped == [1] and res.norms == [3.0, 4.0]
    assert res.aggregate["w"].tolist() == pytest.approx([1.5, 1.75])
    res = norm_bounded_mean(ups, [3, 1], 1.0)  # both scaled to norm 1, then weighted 3:1
    assert res.clipped == [0, 1] and res.aggregate["w"].tolist() == pytest.approx([0.75, 0.25])
    res = norm_bounded_mean(ups, [1, 1], 10.0)  # nothing over the bound: FedAvg
    assert res.clipped == [] and res.aggregate["w"].tolist() == pytest.approx([1.5, 2.0])


@pytest.mark.parametrize("rule", [MedianRule(), TrimmedMeanRule(trim_fraction=0.2), KrumRule(num_attackers=1),
                                  MultiKrumRule(num_attackers=1), NormBoundRule()])
def test_every_rule_keeps_a_scaled_update_from_owning_the_aggregate(rule):
    rng = np.random.default_rng(0)
    honest = [{"w": (np.ones(20) + 0.1 * rng.normal(size=20)).astype(np.float32)} for _ in range(5)]
    attack = {"w": (-1000 * honest[0]["w"]).astype(np.float32)}
    weights = [10, 10, 10, 10, 10, 10]
    plain = np.mean([u["w"] for u in [*honest, attack]], axis=0)
    assert np.linalg.norm(plain - 1) > 100  # the weighted mean is owned by the attacker
    agg = robust_aggregate([*honest, attack], weights, rule).aggregate["w"]
    # norm bounding limits the attacker to the median norm (about sqrt(20)): it moves the mean by at most 2 sqrt(20)/6
    assert np.linalg.norm(agg - 1) < (1.8 if rule.rule == "norm_bound" else 0.5)


@pytest.mark.parametrize("beta", [0.01, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.34, 0.4, 0.49])
def test_the_fewest_updates_of_a_trimmed_mean_trim_one_at_each_end(beta):
    need = TrimmedMeanRule(trim_fraction=beta).min_updates()
    assert trim_count(need, beta) == 1 and trim_count(need - 1, beta) == 0
    ups = [col(v) for v in range(need)]
    assert trimmed_mean(ups, beta)["w"].tolist() == pytest.approx([np.mean(range(1, need - 1))])


def test_the_trimmed_count_is_the_floor_of_the_written_fraction_times_n():
    # in floats 0.29 * 100 = 28.999999999999996 and 0.57 * 100 = 56.99999999999999: int() would trim one too few
    assert [trim_count(100, 0.29), trim_count(100, 0.57), trim_count(3, 1 / 3), trim_count(3, 0.333)] == [29, 57, 1, 0]
    assert [trim_count(n, 0.3) for n in (3, 4, 9, 10, 20)] == [0, 1, 2, 3, 6]
    ups = [col(v) for v in range(100)]  # 29 values dropped at each end leave 29..70, whose mean is 49.5
    assert trimmed_mean(ups, 0.29)["w"].tolist() == pytest.approx([49.5])
    assert robust_aggregate(ups, [1] * 100, TrimmedMeanRule(trim_fraction=0.29)).trimmed == 29


def fedavg_options(*sets):
    return tiny_config("federation.num_clients=5", "federation.clients_per_round=5", "federation.min_replies=5",
                       *sets).algorithm


def test_rules_compose_with_the_server_optimizers():
    x = {"w": np.zeros(2, np.float32)}
    ups = {c: Payload({"w": np.array(v, np.float32)}, {"round": 1, "num_examples": 1})
           for c, v in enumerate([[1, 1], [2, 2], [3, 3], [4, 4], [100, -100]])}
    med = np.array([3.0, 2.0])
    server = make_server(fedavg_options("algorithm.name=fedavgm", "algorithm.momentum=0.5", "algorithm.server_lr=0.5",
                                        "algorithm.robust={rule: median}"), x, num_clients=5, clients_per_round=5, seed=0)
    server.aggregate(1, ups)
    assert server.global_state["w"].tolist() == pytest.approx((0.5 * med).tolist())  # m = d, x = eta m
    assert server.momentum_buffer["w"].tolist() == pytest.approx(med.tolist())
    info = server.round_info()
    assert info["client_update_norm"]["4"] == pytest.approx(100 * np.sqrt(2))
    assert server.round_info() == {}  # reported once
    adam = make_server(fedavg_options("algorithm.name=fedadam", "algorithm.robust={rule: krum, num_attackers: 1}"), x,
                       num_clients=5, clients_per_round=5, seed=0)
    out = adam.aggregate(1, ups)
    assert "lora_aggregation_error" not in out
    info = adam.round_info()
    assert info["robust_kept"] == [1] and info["robust_excluded"] == [0, 2, 3, 4]  # Krum: the update at (2, 2)
    # FedAdam's first step from m = 0, v = tau^2: m = 0.1 d, v = 0.99 tau^2 + 0.01 d^2
    d, tau, lr = 2.0, 1e-3, 1e-2
    m, v = 0.1 * d, 0.99 * tau**2 + 0.01 * d**2
    assert adam.global_state["w"].tolist() == pytest.approx([lr * m / (np.sqrt(v) + tau)] * 2, rel=1e-5)


def refused(match, *sets, base=("federation.num_clients=5", "federation.clients_per_round=5",
                                 "federation.min_replies=5")):
    with pytest.raises(ConfigError, match=match):
        tiny_config(*base, *sets)


def test_config_refuses_rules_where_they_do_not_apply():
    refused("algorithm.dp and algorithm.robust together", "algorithm.robust={rule: median}", "algorithm.dp={}")
    refused("not available for headprune: its Eq. 8 weights", "algorithm.name=headprune",
            "algorithm.robust={rule: median}")
    refused("not available for hetlora: its clients send factors of different ranks", "algorithm.name=hetlora",
            "algorithm.robust={rule: median}")
    refused("secure_aggregation and algorithm.robust", "runtime.name=flower", "runtime.flower.num_supernodes=5",
            "runtime.flower.secure_aggregation={}", "algorithm.robust={rule: median}")
    refused("needs at least 5 updates per round", "algorithm.robust={rule: krum, num_attackers: 1}",
            base=("federation.num_clients=5", "federation.clients_per_round=4"))
    refused("set federation.min_replies to 5 or more", "algorithm.robust={rule: multi_krum, num_attackers: 1}",
            base=("federation.num_clients=5", "federation.clients_per_round=5"))
    refused("trim_fraction 0.1 trims nothing below 10 updates per round", "algorithm.robust={rule: trimmed_mean, "
            "trim_fraction: 0.1}")
    refused("multi_krum needs at least 6 updates per round", "algorithm.robust={rule: multi_krum, num_attackers: 1, "
            "keep: 5}")
    refused("median needs at least 3 updates per round", "algorithm.robust={rule: median}",
            base=("federation.num_clients=5", "federation.clients_per_round=2"))
    refused("attack sign_flip changes the update .+ flora cannot take: its clients train fresh LoRA factors",
            "algorithm.name=flora", "federation.attackers={fraction: 0.2, attack: sign_flip}")
    refused("trim_fraction", "algorithm.robust={rule: median, trim_fraction: 0.2}")  # options of another rule
    # what is accepted: the FedAvg family and the LoRA methods that average
    for name in ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "ffa_lora"):
        cfg = tiny_config("federation.num_clients=5", "federation.clients_per_round=5", "federation.min_replies=5",
                          f"algorithm.name={name}", "algorithm.robust={rule: multi_krum, num_attackers: 1}")
        assert cfg.algorithm.robust.rule == "multi_krum"


def test_config_refuses_attackers_that_cannot_be():
    refused("makes no attacker", "federation.attackers={fraction: 0.05}")
    refused("makes every client an attacker", "federation.attackers={fraction: 0.95}")
    refused("attackers.fraction", "federation.attackers={attack: scale}")  # no fraction: required
    refused("factor is used by attacks sign_flip and scale", "federation.attackers={fraction: 0.2, attack: noise, factor: 3}")
    refused("noise_std is used by attack noise", "federation.attackers={fraction: 0.2, attack: scale, noise_std: 1}")
    refused("label_flip flips class labels", "federation.attackers={fraction: 0.2, attack: label_flip}",
            "model.name=tiny-gpt2", "task.dataset=e2e_nlg", "task.type=generation")


def test_attackers_are_seeded_and_attacks_do_what_they_say():
    cfg = tiny_config("federation.num_clients=20", "federation.attackers={fraction: 0.3, attack: sign_flip}")
    ids = attacker_ids(cfg)
    assert len(ids) == 6 and ids == attacker_ids(cfg)
    assert attacker_ids(tiny_config("federation.num_clients=20", "seed=1",
                                    "federation.attackers={fraction: 0.3}")) != ids
    assert attacker_ids(tiny_config("federation.num_clients=20")) == frozenset()
    received = Payload({"w": np.array([1.0, 1.0], np.float32)}, {"round": 1})
    honest = Payload({"w": np.array([1.5, 0.0], np.float32)}, {"round": 1, "num_examples": 3})
    assert poison(honest, received, cfg, 1, 0).arrays["w"].tolist() == [0.5, 2.0]  # 1 - (0.5, -1)
    scale = tiny_config("federation.num_clients=20", "federation.attackers={fraction: 0.3, attack: scale, factor: 4}")
    sent = poison(honest, received, scale, 1, 0)
    assert sent.arrays["w"].tolist() == [3.0, -3.0] and sent.meta == honest.meta
    noise = tiny_config("federation.num_clients=20", "federation.attackers={fraction: 0.3, attack: noise, noise_std: 2}")
    a, b = (poison(honest, received, noise, 1, 0).arrays["w"] for _ in range(2))
    assert np.array_equal(a, b) and not np.array_equal(a, poison(honest, received, noise, 2, 0).arrays["w"])
    assert a.dtype == np.float32
    # a tensor it did not receive goes out unchanged; an update with nothing received to change is refused
    mixed = poison(Payload({"w": honest.arrays["w"], "v": np.ones(2, np.float32)}, {}), received, cfg, 1, 0)
    assert mixed.arrays["v"].tolist() == [1, 1] and mixed.arrays["w"].tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="nothing to poison"):
        poison(Payload({"v": np.zeros(2, np.float32)}, {}), received, cfg, 1, 0)
    # a tensor the client cut (a HetLoRA client that pruned its rank): the change of the part it kept
    factor = Payload({"a": np.ones((3, 2), np.float32)}, {"round": 1})
    pruned = poison(Payload({"a": np.full((2, 2), 2.0, np.float32)}, {}), factor, cfg, 1, 0)
    assert pruned.arrays["a"].tolist() == [[0.0, 0.0], [0.0, 0.0]]  # 1 - (2 - 1)
    flipped = flip_labels(Encoded(input_ids=[np.array([1]), np.array([2]), np.array([3])], labels=[0, 1, 2]), 3)
    assert flipped.labels == [2, 1, 0] and len(flipped) == 3


@pytest.mark.needs_data
def test_a_defended_run_marks_and_excludes_the_attacker(tmp_path):
    base = ("federation.num_clients=6", "federation.clients_per_round=5", "federation.min_replies=5",
            "federation.rounds=2", "federation.attackers={fraction: 0.17, attack: scale, factor: 1000}")
    cfg = tiny_config(*base, "algorithm.robust={rule: multi_krum, num_attackers: 1}")
    attacker, = attacker_ids(cfg)
    EmbeddedRuntime(cfg, tmp_path / "krum").run()
    rows = read_metrics(tmp_path / "krum")[1:]
    for row in rows:
        assert row["adversarial_clients"] == ([attacker] if attacker in row["clients"] else [])
        if attacker in row["clients"]:
            assert row["robust_excluded"] == [attacker]
            others = [v for c, v in row["client_update_norm"].items() if int(c) != attacker]
            assert row["client_update_norm"][str(attacker)] > 100 * max(others)
    assert any(attacker in r["clients"] for r in rows)
    assert f"clients [{attacker}]" in (tmp_path / "krum" / "events.log").read_text()
    # the same attack without a defence: the attacker's update dominates the global model's change
    EmbeddedRuntime(tiny_config(*base), tmp_path / "open").run()
    plain = read_metrics(tmp_path / "open")[1:]
    hit = next(i for i, r in enumerate(rows) if attacker in r["clients"])
    assert plain[hit]["agg_update_norm"] > 50 * rows[hit]["agg_update_norm"]


@pytest.mark.needs_data
def test_an_attacker_poisons_the_model_update_and_leaves_other_tensors_alone(tmp_path):
    # headprune's update carries the client's importance scores besides its head slices: they go out unchanged
    cfg = tiny_config("algorithm.name=headprune", "algorithm.sparsity=0.5", "federation.clients_per_round=4",
                      "federation.rounds=1", "eval.at_start=false",
                      "federation.attackers={fraction: 0.25, attack: scale, factor: 100}")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    (row,) = read_metrics(tmp_path / "run")
    assert row["adversarial_clients"] and not row["rejected"]


@pytest.mark.needs_data
def test_label_flipping_changes_only_the_attackers_training(tmp_path):
    base = ("federation.num_clients=4", "federation.clients_per_round=4", "federation.rounds=1", "eval.at_start=false")
    flip = tiny_config(*base, "federation.attackers={fraction: 0.25, attack: label_flip}")
    attacker, = attacker_ids(flip)
    EmbeddedRuntime(flip, tmp_path / "flip").run()
    EmbeddedRuntime(tiny_config(*base), tmp_path / "clean").run()
    (a,), (b,) = read_metrics(tmp_path / "flip"), read_metrics(tmp_path / "clean")
    for c in map(str, range(4)):
        same = a["client_train_loss"][c] == b["client_train_loss"][c]
        assert same == (c != str(attacker)), c


@pytest.mark.needs_data
def test_resume_of_a_robust_run_under_attack(tmp_path, monkeypatch):
    cfg = tiny_config("federation.num_clients=4", "federation.clients_per_round=4", "federation.min_replies=4", "federation.rounds=3",
                      "algorithm.name=fedyogi", "algorithm.robust={rule: trimmed_mean, trim_fraction: 0.25}",
                      "federation.attackers={fraction: 0.25, attack: noise}")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    crashed = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_in_checkpoint(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        crashed.run()
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert without_timings(read_metrics(tmp_path / "cut"))[1]["adversarial_clients"]


ROBUST_ALGORITHMS = sorted(n for n, e in ALGORITHMS.items() if "robust" in e.options.model_fields)


def test_every_registered_algorithm_applies_robust_aggregation_or_says_why():
    # the registry as it is now: plugins registered by earlier tests of the session (e.g. test_flower's) included
    robust_now = sorted(n for n, e in ALGORITHMS.items() if "robust" in e.options.model_fields)
    assert {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "ffa_lora", "fedsa_lora"} <= set(robust_now)
    for name, entry in ALGORITHMS.items():
        if name in robust_now:
            assert entry.options(robust={"rule": "median"}).robust.rule == "median"
        else:
            with pytest.raises(ValidationError, match=f"not available for {name}: .+; algorithms with robust"):
                entry.options(robust={"rule": "median"})


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ROBUST_ALGORITHMS)
def test_every_algorithm_with_the_option_aggregates_robustly(name, tmp_path):
    extra = ["eval.personalized=true"] if name == "fedsa_lora" else []
    cfg = tiny_config(f"algorithm.name={name}", "federation.clients_per_round=3", "federation.rounds=1",
                      "eval.at_start=false", "federation.min_replies=3", "algorithm.robust={rule: krum, num_attackers: 0}",
                      *extra)
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    (row,) = read_metrics(tmp_path / "run")
    assert len(row["robust_kept"]) == 1 and len(row["client_update_norm"]) == 3
