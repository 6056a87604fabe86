"""FedPepTAO's server step (paper 002, Algorithm 2) against values computed by hand."""

import numpy as np
import pytest

from fedpeft.algorithms.fedpeptao.adaptive_server import adaptive_step, server_lr


def a(x):
    return {"p": np.array([x], dtype=np.float32)}


def step(prev):
    return adaptive_step(a(1.0), [a(0.2), a(-0.4)], num_examples=[1, 3], local_steps=[2, 4], client_lr=0.1,
                         c_clients=[None, None], c_global=None, momentum=None, prev_update=prev,
                         beta=0.9, eta=0.5, sampled_fraction=0.5)


def test_a_round_by_hand():
    # p = (1/4, 3/4); Delta = 0.05 - 0.3 = -0.25; c_A = -0.2/(2*0.1) = -1, c_B = 0.4/(4*0.1) = 1;
    # c_g = 0.5 * (0.25*(-1) + 0.75*1) = 0.25; g = -0.25 - 0.1 = -0.35;
    # m_A = 0.1*g + 0.25 + 1 = 1.215, m_B = 0.1*g + 0.25 - 1 = -0.785; w_i = 0.75 - 0.5 m_i
    w, m, cg, c, delta = step(a(0.1))
    assert delta["p"][0] == pytest.approx(-0.25)
    assert [ci["p"][0] for ci in c] == pytest.approx([-1.0, 1.0])
    assert cg["p"][0] == pytest.approx(0.25)
    assert m["p"][0] == pytest.approx(0.25 * 1.215 + 0.75 * -0.785)
    assert w["p"][0] == pytest.approx(0.25 * (0.75 - 0.5 * 1.215) + 0.75 * (0.75 + 0.5 * 0.785))


def test_the_first_round_is_fedavg_with_control_variates():
    w, m, cg, _c, _delta = step(None)
    assert w["p"][0] == pytest.approx(0.75) and m is None and cg["p"][0] == pytest.approx(0.25)


def test_server_learning_rate_decays_to_a_floor():
    assert server_lr(1, 0.05, 0.99, 1e-4) == pytest.approx(0.0495)
    assert server_lr(1000, 0.05, 0.99, 1e-4) == 1e-4


def test_without_control_variates_the_momentum_sees_only_the_update_difference():
    w, m, cg, c, _delta = adaptive_step(a(1.0), [a(0.2), a(-0.4)], num_examples=[1, 3], local_steps=[2, 4],
                                       client_lr=0.1, c_clients=[None, None], c_global=None, momentum=a(1.0),
                                       prev_update=a(0.1), beta=0.9, eta=0.5, sampled_fraction=0.5,
                                       control_variates=False)
    # m = 0.9 * 1 + 0.1 * (-0.25 - 0.1) = 0.865 for both clients; w = 0.75 - 0.5 * 0.865
    assert m["p"][0] == pytest.approx(0.865)
    assert w["p"][0] == pytest.approx(0.75 - 0.5 * 0.865)
    assert cg["p"][0] == 0.0 and all(ci["p"][0] == 0.0 for ci in c)
