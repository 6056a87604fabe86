"""FedPepTAO's layer scores and selection (paper 002, Eq. 2-4, Algorithm 1) against hand-computed values."""

import math

import numpy as np
import pytest

from fedpeft.algorithms.fedpeptao.layer_selection import (
    aggregate_scores,
    cosine_kernel,
    layer_order,
    layer_score,
    select_layers,
)


def test_cosine_kernel_by_hand():
    k = cosine_kernel(np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [0.0, 0.0]]))
    s = 1 / math.sqrt(2)
    np.testing.assert_allclose(k, [[1, 0, s, 0], [0, 1, s, 0], [s, s, 1, 0], [0, 0, 0, 0]], atol=1e-12)


def test_cosine_kernel_flattens_token_positions():
    h = np.arange(24, dtype=np.float64).reshape(2, 3, 4) + 1  # 2 samples x 3 tokens x 4 features
    np.testing.assert_allclose(cosine_kernel(h), cosine_kernel(h.reshape(2, 12)))


def test_layer_score_by_hand():
    eps = 1e-5
    # orthogonal samples: kernel = identity, eigenvalues 1, 1
    assert layer_score(np.eye(2)) == pytest.approx(math.log(1 + eps) + 1 / (1 + eps))
    # identical samples: kernel of ones, eigenvalues 0 and 2 (similar states score high)
    same = layer_score(np.array([[1.0, 2.0], [2.0, 4.0]]))
    assert same == pytest.approx(((math.log(eps) + 1 / eps) + (math.log(2 + eps) + 1 / (2 + eps))) / 2)
    assert same > layer_score(np.eye(2))
    with pytest.raises(ValueError, match="at least 2 samples"):
        layer_score(np.ones((1, 3)))


def test_scores_are_aggregated_by_sample_count():
    np.testing.assert_allclose(aggregate_scores([[1.0, 2.0], [3.0, 4.0]], [1, 3]), [2.5, 3.5])
    with pytest.raises(ValueError, match="positive"):
        aggregate_scores([[1.0], [2.0]], [0, 3])


def test_orders():
    assert layer_order([0.5, 2.0, 2.0, 1.0]) == [1, 2, 3, 0]  # by score, ties by index
    assert layer_order([0.0] * 4, "ascending") == [0, 1, 2, 3]
    assert layer_order([0.0] * 4, "descending") == [3, 2, 1, 0]
    r = layer_order([0.0] * 6, "random", seed=3)
    assert sorted(r) == list(range(6)) and r == layer_order([0.0] * 6, "random", seed=3)
    with pytest.raises(ValueError, match="unknown layer order"):
        layer_order([0.0], "middle")


def test_selection_stops_once_the_parameter_ratio_is_reached():
    order = [2, 0, 3, 1]
    assert select_layers(order, [10] * 4, 0.25) == [2]
    assert select_layers(order, [10] * 4, 0.3) == [0, 2]  # 25% < 30%: one more layer
    assert select_layers(order, [10] * 4, 0.5) == [0, 2]
    assert select_layers(order, [10] * 4, 1.0) == [0, 1, 2, 3]
    assert select_layers(order, [40, 10, 10, 40], 0.2) == [0, 2]  # layer 2 holds 10%, then layer 0
    with pytest.raises(ValueError):
        select_layers(order, [10] * 4, 0.0)
