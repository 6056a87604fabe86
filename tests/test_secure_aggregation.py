"""Secure aggregation (SecAgg+) pieces that need no Flower processes: the config rules, the quantization
range, and the server's refusal of a masked-vector reply that carries an update in the clear. The whole
protocol on real SuperNodes is in test_flower.py."""

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from helpers import tiny_config

from fedpeft.runtime.flower.secure import CountingGrid, quantization_range

SECURE = "runtime.flower.secure_aggregation.clipping_range=1.0"
FLOWER_2 = ["runtime.name=flower", "federation.num_clients=2", "runtime.flower.num_supernodes=2"]


def test_quantization_range_keeps_the_masked_sum_within_int32():
    assert quantization_range(2) == quantization_range(3) == 2**30  # int32 entries: at most 2^30
    for k in (4, 5, 10, 100, 1000):
        q = quantization_range(k)
        assert q & (q - 1) == 0 and k * q < 2**32 <= 2 * k * q  # the sum stays below the modulus 2^32


@pytest.mark.parametrize("overrides, message", [
    (["federation.num_clients=2", "runtime.flower.num_supernodes=2"], "needs runtime.name: flower"),
    ([*FLOWER_2, "algorithm.name=headprune"], "needs the clients' updates in the clear"),
    ([*FLOWER_2, "algorithm.dp.noise_multiplier=1.0"], "algorithm.dp together are not supported"),
    (["runtime.name=flower", "federation.num_clients=4", "runtime.flower.num_supernodes=2"], "one SuperNode per client"),
    ([*FLOWER_2, "federation.clients_per_round=1"], "clients_per_round >= 2"),
])
def test_secure_aggregation_refuses_what_it_cannot_protect(overrides, message):
    with pytest.raises(Exception, match=message):
        tiny_config(*overrides, SECURE)


def test_secure_aggregation_config_is_accepted_for_the_fedavg_family():
    for name in ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox"):
        cfg = tiny_config(*FLOWER_2, f"algorithm.name={name}", SECURE)
        assert cfg.runtime.flower.secure_aggregation.clipping_range == 1.0


def _message(node: int, stage: str, arrays: list[np.ndarray] | None = None, error: bool = False):
    content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage})})
    if arrays is not None:
        content["fitres.parameters"] = ArrayRecord(arrays)
    return SimpleNamespace(content=None if error else content, metadata=SimpleNamespace(dst_node_id=node),
                           has_error=lambda: error, has_content=lambda: not error,
                           error=SimpleNamespace(reason="boom\nTraceback (most recent call last):\n  ..."))


def test_a_reply_with_the_update_in_the_clear_is_refused_and_counted():
    """Node 1 answers the masked-vector stage with plain arrays (no SecAgg+ mod), node 2 with an error,
    node 3 not at all, node 4 correctly: node 1's reply never reaches the workflow (which drops node 2
    itself, as with Flower's Grid)."""
    stage = Stage.COLLECT_MASKED_VECTORS
    replies = {"m1": _message(1, stage, [np.ones(3, dtype=np.float32)]), "m2": _message(2, stage, error=True),
               "m4": _message(4, stage, [])}
    runtime = SimpleNamespace(_exchange=lambda msgs, timeout: (replies, ["m1", "m2", "m3", "m4"]))
    grid = CountingGrid(runtime, timeout=5.0)
    sent = [_message(n, stage) for n in (1, 2, 3, 4)]
    out = grid.send_and_receive(sent)
    assert out == [replies["m2"], replies["m4"]]
    assert "in the clear" in grid.dropped[1] and "boom" in grid.dropped[2] and "no reply" in grid.dropped[3]
    assert "\n" not in grid.dropped[2]  # a client's multi-line reason is kept to its first line
    assert 4 not in grid.dropped
    assert set(grid.bytes_down) == {1, 2, 3, 4} and all(b > 0 for b in grid.bytes_down.values())
    assert grid.bytes_up[1] > grid.bytes_up[4] > 0 and 2 not in grid.bytes_up and 3 not in grid.bytes_up


def test_unreadable_clear_text_metrics_are_dropped_not_fatal():
    from fedpeft.runtime.flower.secure import readable_meta

    assert readable_meta('{"train_loss": 0.5, "round": 2, "x": [1]}') == {"train_loss": 0.5, "round": 2}
    for bad in (None, "not json", "[1, 2]", '{"round": 2}', '{"train_loss": NaN}', '{"train_loss": "0.5"}'):
        assert readable_meta(bad) == {}, bad
