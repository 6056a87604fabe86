"""Stochastic Lanczos quadrature of a Hessian and FedPepTAO's kept-parameter ratio, on losses whose
Hessian is known exactly."""

import numpy as np
import pytest
import torch

from fedpeft.algorithms.fedpeptao.hessian_spectrum import kept_ratio, lanczos_spectrum, share_above


def test_lanczos_finds_the_eigenvalues_of_a_quadratic():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    eig = np.array([-1.0, 0.5, 1.0, 2.0, 3.0, 7.0])
    a = torch.tensor(q @ np.diag(eig) @ q.T, dtype=torch.float64)
    x = torch.tensor(rng.normal(size=(2, 3)), dtype=torch.float64, requires_grad=True)  # 6 parameters

    def loss():
        v = x.reshape(-1)
        return 0.5 * v @ a @ v

    theta, w = lanczos_spectrum(loss, [x], steps=50, probes=2, seed=1)
    assert len(theta) == 12 and w.sum() == pytest.approx(1.0)
    for k in range(2):  # each probe spans the whole space: its Ritz values are the eigenvalues
        np.testing.assert_allclose(np.sort(theta[6 * k:6 * k + 6]), eig, atol=1e-8)


def test_a_single_lanczos_step_gives_the_rayleigh_quotient():
    x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    d = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64)
    theta, w = lanczos_spectrum(lambda: 0.5 * (d * x * x).sum(), [x], steps=1)
    assert theta.tolist() == pytest.approx([3.0]) and w.tolist() == pytest.approx([1.0])  # mean of d (v = +-1/sqrt3)


def test_share_above_by_hand():
    theta, w = np.array([1.0, 3.0]), np.array([0.5, 0.5])
    assert share_above(2.0, theta, w, variance=1e-8) == pytest.approx(0.5)
    assert share_above(1.0, theta, w, variance=1e-8) == pytest.approx(0.75)  # half of the node at 1


def test_kept_ratio_is_the_settled_share_above_the_threshold():
    # a positive spectrum: the share above t is flat from t = 0.1 on, so everything is kept
    assert kept_ratio(np.array([0.5, 1.0, 2.0, 3.0]), np.full(4, 0.25)) == pytest.approx(1.0)
    # one node below the first step (0.1): the share settles at 3/4 by t = 0.3
    assert kept_ratio(np.array([0.01, 2.0, 2.5, 3.0]), np.full(4, 0.25)) == pytest.approx(0.75)
    # most mass near 0: the share falls below half of r(0) at every coarse step, the step is halved
    # until the share settles before the cluster, which is then kept (the reference's behaviour)
    assert kept_ratio(np.array([0.01, 0.02, 0.03, 2.0]), np.full(4, 0.25)) > 0.9
