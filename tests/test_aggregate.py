import numpy as np
import pytest

from fedpeft.algorithms import aggregate as A
from fedpeft.algorithms import make_server
from fedpeft.algorithms.fedavg.options import (
    FedAdamOptions,
    FedAvgMOptions,
    FedAvgOptions,
    FedYogiOptions,
)
from fedpeft.wire import Payload


def arr(*v):
    return np.array(v, dtype=np.float32)


def test_weighted_mean_by_hand():
    u1, u2 = {"w": arr(1.0, 2.0)}, {"w": arr(3.0, 6.0)}
    out = A.weighted_mean([u1, u2], [1, 3])  # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5]
    assert out["w"].tolist() == [2.5, 5.0]
    assert out["w"].dtype == np.float32
    with pytest.raises(ValueError):
        A.weighted_mean([u1], [0])


def test_fedavg_step_with_server_lr():
    x, d = {"w": arr(1.0, 1.0)}, {"w": arr(0.5, -1.0)}
    assert A.fedavg_step(x, d, 1.0)["w"].tolist() == [1.5, 0.0]
    assert A.fedavg_step(x, d, 0.5)["w"].tolist() == [1.25, 0.5]


def test_fedavgm_two_steps_by_hand():
    x, d = {"w": arr(0.0)}, {"w": arr(1.0)}
    x1, m1 = A.fedavgm_step(x, d, None, server_lr=0.5, momentum=0.9)  # m=1, x=0.5
    assert m1["w"].tolist() == [1.0] and x1["w"].tolist() == [0.5]
    x2, m2 = A.fedavgm_step(x1, d, m1, server_lr=0.5, momentum=0.9)  # m=1.9, x=0.5+0.95
    assert m2["w"][0] == pytest.approx(1.9) and x2["w"][0] == pytest.approx(1.45)


def test_fedadam_one_step_by_hand():
    x, d = {"w": arr(0.0)}, {"w": arr(2.0)}
    x1, m1, v1 = A.fedadam_step(x, d, None, None, server_lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    m = 0.1 * 2.0
    v = 0.99 * 0.01**2 + 0.01 * 4.0
    assert m1["w"][0] == pytest.approx(m)
    assert v1["w"][0] == pytest.approx(v)
    assert x1["w"][0] == pytest.approx(0.1 * m / (np.sqrt(v) + 0.01), rel=1e-5)


def test_fedyogi_one_step_by_hand():
    x, d = {"w": arr(0.0)}, {"w": arr(2.0)}
    x1, _m1, v1 = A.fedyogi_step(x, d, None, None, server_lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    v0 = 0.01**2
    v = v0 - 0.01 * 4.0 * np.sign(v0 - 4.0)  # = v0 + 0.04
    assert v1["w"][0] == pytest.approx(v)
    assert x1["w"][0] == pytest.approx(0.1 * 0.2 / (np.sqrt(v) + 0.01), rel=1e-5)


def _update(rnd, value, n):
    return Payload({"w": arr(value, value)}, {"round": rnd, "num_examples": n})


@pytest.mark.parametrize(
    "options, expected",
    [
        (FedAvgOptions(server_lr=1.0), 2.5),  # mean delta = (1*1 + 3*3)/4 = 2.5
        (FedAvgOptions(server_lr=0.5), 1.25),
        (FedAvgMOptions(server_lr=1.0, momentum=0.9), 2.5),
    ],
)
def test_servers_aggregate_sample_weighted(options, expected):
    server = make_server(options, {"w": arr(0.0, 0.0)}, num_clients=4, clients_per_round=2, seed=0)
    server.aggregate(1, {0: _update(1, 1.0, 1), 1: _update(1, 3.0, 3)})
    assert server.global_state["w"].tolist() == pytest.approx([expected, expected])


@pytest.mark.parametrize("options", [FedAdamOptions(), FedYogiOptions()])
def test_adaptive_servers_move_towards_the_update(options):
    server = make_server(options, {"w": arr(0.0, 0.0)}, num_clients=4, clients_per_round=2, seed=0)
    server.aggregate(1, {0: _update(1, 1.0, 1)})
    assert np.all(server.global_state["w"] > 0)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
@pytest.mark.parametrize("tau", [1e-3, 1e-9])
def test_with_flowers_options_fedadam_and_fedyogi_are_flowers_strategies(name, tau):
    """initial_v: zero (and, for FedAdam, bias_correction) give Flower 1.41's FedAdam / FedYogi on the same client
    models, round after round; the defaults (Reddi et al.: v0 = tau^2, no correction) do not."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAdam, FedYogi

    rng = np.random.default_rng(0)
    x0 = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    flower_options = {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": tau}
    ours = {"server_lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": tau}
    cls, options = {"fedadam": (FedAdam, FedAdamOptions), "fedyogi": (FedYogi, FedYogiOptions)}[name]
    flower = cls(initial_parameters=ndarrays_to_parameters([x0["a"], x0["b"]]), **flower_options)
    matched = make_server(options(**ours, initial_v="zero", bias_correction=name == "fedadam"), dict(x0),
                          num_clients=3, clients_per_round=3, seed=0)
    reddi = make_server(options(**ours), dict(x0), num_clients=3, clients_per_round=3, seed=0)
    for rnd in (1, 2, 3):
        models = {c: {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32)
                      for k, v in matched.global_state.items()} for c in range(3)}
        examples = {0: 10, 1: 30, 2: 5}
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([m["a"], m["b"]]), examples[c], {}))
                   for c, m in models.items()]
        expected, _ = flower.aggregate_fit(rnd, results, [])
        for server in (matched, reddi):
            server.aggregate(rnd, {c: Payload(m, {"round": rnd, "num_examples": examples[c]})
                                   for c, m in models.items()})
        a, b = parameters_to_ndarrays(expected)
        np.testing.assert_allclose(matched.global_state["a"], a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(matched.global_state["b"], b, rtol=1e-5, atol=1e-6)
    if name == "fedadam" or tau > 1e-6:  # (Yogi's v from tau^2 = 1e-18 or from 0: the same to float32)
        assert not np.allclose(reddi.global_state["a"], a, rtol=1e-3)


def test_random_selection_is_deterministic_and_distinct():
    from fedpeft.algorithms import random_selection

    a = random_selection(100, 10, seed=1, rnd=3)
    assert a == random_selection(100, 10, seed=1, rnd=3)
    assert len(set(a)) == 10 and all(0 <= c < 100 for c in a)
    assert a != random_selection(100, 10, seed=1, rnd=4)
