"""Client-level differential privacy: clipping, noise, accounting, and how runs use them."""

import math

import numpy as np
import pytest
from helpers import tiny_config

from fedpeft import checkpoint
from fedpeft.algorithms import make_server
from fedpeft.algorithms.aggregate import l2_norm
from fedpeft.algorithms.fedavg.options import FedAvgOptions
from fedpeft.algorithms.privacy.mean import PrivateMean, clip
from fedpeft.algorithms.privacy.options import PrivacyOptions
from fedpeft.config import ConfigError
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.wire import Payload


def test_clip_bounds_the_norm_and_keeps_small_updates():
    big = {"a": np.full((3, 4), 2.0, np.float32), "b": np.full(5, -1.0, np.float32)}
    out = clip(big, 1.5)
    assert math.isclose(l2_norm(out), 1.5, rel_tol=1e-6)
    np.testing.assert_allclose(out["a"] / big["a"], out["b"][0] / big["b"][0], rtol=1e-6)  # one common factor
    small = {"a": np.full(2, 0.1, np.float32)}
    np.testing.assert_array_equal(clip(small, 1.0)["a"], small["a"])


def test_noiseless_mean_divides_by_the_sampled_count_and_noise_has_the_documented_scale():
    deltas = [{"w": np.full(20000, 3.0, np.float32)}, {"w": np.full(20000, 1.0, np.float32)}]
    opts = PrivacyOptions(noise_multiplier=0.0, clipping_norm=1.0)
    pm = PrivateMean(opts, num_clients=10, clients_per_round=4)
    out = pm.mean(deltas)
    per_client = 1.0 / math.sqrt(20000)  # each delta clipped to norm 1
    np.testing.assert_allclose(out["w"], 2 * per_client / 4, rtol=1e-5)  # sum / K, K = 4 sampled
    noisy = PrivateMean(PrivacyOptions(noise_multiplier=2.0, clipping_norm=1.0), num_clients=10,
                        clients_per_round=4)
    first = noisy.mean(deltas)["w"]
    resid = first - out["w"]
    assert abs(resid.std() - 2.0 * 1.0 / 4) < 0.01 and abs(resid.mean()) < 0.01
    again = PrivateMean(PrivacyOptions(noise_multiplier=2.0, clipping_norm=1.0), num_clients=10,
                        clients_per_round=4).mean(deltas)["w"]
    assert not np.array_equal(again, first)  # OS entropy: not reproducible from the (shared) seed


def test_epsilon_grows_with_rounds_and_falls_with_noise():
    def eps_after(rounds, z):
        pm = PrivateMean(PrivacyOptions(noise_multiplier=z, clipping_norm=1.0), num_clients=100,
                         clients_per_round=10)
        for r in range(rounds):
            pm.mean([{"w": np.zeros(3, np.float32)}])
        return pm.spent()["dp_epsilon"]

    # replace-one neighbours: the clipped sum moves by up to 2C, so noise z*C is accounted as z/2.
    # Reference: dp-accounting's RDP accountant for K=10 of N=100 without replacement, multiplier 0.5.
    from dp_accounting import dp_event, rdp

    ref = rdp.RdpAccountant(neighboring_relation=rdp.rdp_privacy_accountant.NeighborRel.REPLACE_ONE)
    ref.compose(dp_event.SampledWithoutReplacementDpEvent(100, 10, dp_event.GaussianDpEvent(0.5)), 10)
    assert math.isclose(eps_after(10, 1.0), ref.get_epsilon(1e-5), rel_tol=1e-6)
    e1, e10 = eps_after(1, 1.0), eps_after(10, 1.0)
    assert 0 < e1 < e10 < math.inf
    assert eps_after(10, 2.0) < e10


def test_server_rejects_unclipped_updates_under_client_clipping():
    init = {"w": np.zeros(4, np.float32)}
    opts = FedAvgOptions(dp=PrivacyOptions(noise_multiplier=1.0, clipping_norm=0.5))
    srv = make_server(opts, init, num_clients=4, clients_per_round=2, seed=0)
    ok = Payload({"w": np.full(4, 0.2, np.float32)}, {"round": 1, "num_examples": 3})  # norm 0.4
    bad = Payload({"w": np.full(4, 1.0, np.float32)}, {"round": 1, "num_examples": 3})  # norm 2
    accepted, rejected = srv.accept(1, {0: ok, 1: bad})
    assert list(accepted) == [0] and "exceeds algorithm.dp.clipping_norm 0.5" in rejected[1]


@pytest.mark.needs_data
def test_private_run_reports_epsilon_every_round(tmp_path):
    cfg = tiny_config("algorithm.dp.noise_multiplier=0.5", "algorithm.dp.clipping_norm=0.5",
                      "federation.rounds=3", "train.local_steps=2")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")[1:]
    eps = [r["dp_epsilon"] for r in rows]
    assert all(isinstance(e, float) for e in eps) and eps == sorted(eps) and eps[0] < eps[-1]
    assert all(r["rejected"] == {} for r in rows)  # clients clip, so every update is within the bound
    assert all(r["agg_update_norm"] > 0 for r in rows)


@pytest.mark.needs_data
def test_max_epsilon_ends_the_run_before_the_budget_is_exceeded(tmp_path):
    cfg = tiny_config("algorithm.dp.noise_multiplier=2.0", "algorithm.dp.max_epsilon=10",
                      "federation.rounds=50", "train.local_steps=1", "eval.every=0", "runtime.checkpoint_every=3")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")[1:]
    assert len(rows) == 4 and rows[-1]["dp_epsilon"] <= 10  # 8.93 after 4 rounds, 10.38 after 5
    assert "would exceed algorithm.dp.max_epsilon=10" in (tmp_path / "run" / "events.log").read_text()
    summary = read_summary(tmp_path / "run")
    assert summary["rounds"] == len(rows) and "would exceed" in summary["stopped_early"]
    assert "eval_accuracy" in rows[-1] and summary["final_round"] == 4  # the last round run is evaluated ...
    assert checkpoint.load(tmp_path / "run")[0] == 4  # ... and checkpointed
    with pytest.raises(FileExistsError, match="stopped early after 4 rounds"):
        EmbeddedRuntime.resume(tmp_path / "run", rounds=60)


def test_budget_without_noise_is_a_config_error():
    with pytest.raises(ConfigError, match="max_epsilon needs noise_multiplier > 0"):
        tiny_config("algorithm.dp.noise_multiplier=0", "algorithm.dp.max_epsilon=3")


def test_headprune_refuses_dp_with_the_reason():
    with pytest.raises(ConfigError, match="not available for headprune"):
        tiny_config("algorithm.name=headprune", "algorithm.dp.noise_multiplier=1.0")
