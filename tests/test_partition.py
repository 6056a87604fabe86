import numpy as np
import pytest

from fedpeft.data.partition import (
    PartitionError,
    client_sizes,
    dirichlet_label,
    dirichlet_quantity,
    format_stats,
    iid,
    partition,
    partition_stats,
)


def _check_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert len(np.unique(allidx)) == n


def test_client_sizes_equal_split_by_hand():
    rng = np.random.default_rng(0)
    # 10 examples, 3 clients, min 1: spare 7 -> shares 7/3 each -> floor 2,2,2, remainder 1 to client 0
    assert client_sizes(10, 3, rng, None, 1).tolist() == [4, 3, 3]
    assert client_sizes(9, 3, rng, None, 2).tolist() == [3, 3, 3]
    with pytest.raises(PartitionError, match="cannot give 5 clients at least 3"):
        client_sizes(10, 5, rng, None, 3)


@pytest.mark.parametrize("num_clients", [10, 100, 1000])
def test_iid_partition_covers_everything_once(num_clients):
    parts = iid(9000, num_clients, np.random.default_rng(1))
    _check_disjoint_cover(parts, 9000)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_clients", [10, 100, 1000])
def test_dirichlet_label_handles_many_clients(num_clients):
    labels = np.random.default_rng(0).integers(0, 3, size=9000)
    parts = dirichlet_label(labels, num_clients, 0.1, np.random.default_rng(2))
    _check_disjoint_cover(parts, 9000)
    assert min(len(p) for p in parts) >= 1


def test_label_skew_grows_as_alpha_shrinks():
    labels = np.repeat(np.arange(4), 500)
    tv = {}
    for alpha in (100.0, 1.0, 0.05):
        parts = dirichlet_label(labels, 20, alpha, np.random.default_rng(3))
        tv[alpha] = partition_stats(parts, labels)["tv_distance_to_global_mean"]
    assert tv[100.0] < 0.1 < tv[1.0] < tv[0.05]
    assert tv[0.05] > 0.5


def test_label_skew_with_dirichlet_sizes():
    labels = np.repeat(np.arange(2), 1000)
    parts = dirichlet_label(labels, 10, 1.0, np.random.default_rng(4), size_alpha=5.0)
    sizes = [len(p) for p in parts]
    _check_disjoint_cover(parts, 2000)
    assert len(set(sizes)) > 1


def test_quantity_skew_has_iid_labels_and_uneven_sizes():
    n = 5000
    parts = dirichlet_quantity(n, 10, 0.5, np.random.default_rng(5), min_size=10)
    _check_disjoint_cover(parts, n)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 10 and sizes.max() > 2 * sizes.min()


def test_partitions_are_deterministic_by_seed():
    labels = np.random.default_rng(0).integers(0, 5, size=1000)
    for scheme in ("iid", "dirichlet_label", "dirichlet_quantity"):
        a = partition(scheme, 50, np.random.default_rng(7), n=1000, labels=labels, alpha=0.3)
        b = partition(scheme, 50, np.random.default_rng(7), n=1000, labels=labels, alpha=0.3)
        c = partition(scheme, 50, np.random.default_rng(8), n=1000, labels=labels, alpha=0.3)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_label_skew_without_labels_is_a_clear_error():
    with pytest.raises(PartitionError, match="needs class labels"):
        partition("dirichlet_label", 10, np.random.default_rng(0), n=100, labels=None)


def test_stats_by_hand():
    labels = np.array([0, 0, 1, 1, 1, 2])
    parts = [np.array([0, 1]), np.array([2, 3, 4, 5])]
    stats = partition_stats(parts, labels)
    assert stats["size_min"] == 2 and stats["size_max"] == 4 and stats["num_examples"] == 6
    assert stats["clients"][0]["labels"] == {"0": 2}
    assert stats["clients"][1]["labels"] == {"1": 3, "2": 1}
    assert stats["classes_per_client_mean"] == 1.5
    # client 0 entropy 0; client 1: -(.75 ln .75 + .25 ln .25)
    expected = (0 + -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))) / 2
    assert stats["label_entropy_mean"] == pytest.approx(expected)
    assert "client  size  labels" in format_stats(stats)


def test_partition_stats_keep_class_names_that_say_more_than_the_ids():
    from fedpeft.data.partition import format_stats, partition_stats

    parts = [np.array([0, 1]), np.array([2])]
    labels = np.array([0, 1, 1])
    named = partition_stats(parts, labels, label_names=["neg", "pos"])
    assert named["label_names"] == ["neg", "pos"] and "neg:1 pos:1" in format_stats(named)
    plain = partition_stats(parts, labels, label_names=["0", "1"])
    assert "label_names" not in plain and "0:1 1:1" in format_stats(plain)
