"""The SecAgg+ protocol as fedpeft runs it (Flower's workflow with fedpeft's dropout fix, Flower's client
mod), played in one process: the server side of :func:`fedpeft.runtime.flower.secure.secure_mean` against
clients that answer every stage through ``secaggplus_mod``, some of them lost at a chosen stage."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from helpers import tiny_config

from fedpeft.runtime.flower.records import META_KEY
from fedpeft.runtime.flower.secure import secure_mean

STAGES = [Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK]
NAMES = ["a", "b"]


pytestmark = pytest.mark.usefixtures("flower_task_identity")  # Flower messages are made here


class Clients:
    """Client c is SuperNode 100 + c; ``lost`` maps a client to the stage from which it stops answering."""

    def __init__(self, updates: dict[int, list[np.ndarray]], sizes: list[int], lost: dict[int, str]):
        self.updates, self.sizes, self.lost = updates, sizes, lost
        self.contexts = {c: Context(run_id=7, node_id=100 + c, node_config={}, state=RecordDict(), run_config={})
                         for c in updates}
        self.seen_by_server: list[Message] = []

    def exchange(self, messages, timeout):
        replies, ids = {}, []
        for i, msg in enumerate(messages):
            stage = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            mid = f"{stage}-{i}"
            ids.append(mid)
            cid = msg.metadata.dst_node_id - 100
            if cid in self.lost and STAGES.index(stage) >= STAGES.index(self.lost[cid]):
                continue
            received = copy.deepcopy(msg)  # what the client decodes (the mod edits its copy)

            def train(m, ctx, cid=cid):
                res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(self.updates[cid]), self.sizes[cid],
                             {META_KEY: json.dumps({"round": 1, "train_loss": 0.5})})
                return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=m)

            reply = secaggplus_mod(received, self.contexts[cid], train)
            self.seen_by_server.append(reply)
            replies[mid] = reply
        return replies, ids


def run_protocol(num_clients: int, lost: dict[int, str], clipping_range: float = 1.0):
    rng = np.random.default_rng(3)
    updates = {c: [rng.uniform(-0.5, 0.5, (4, 3)).astype(np.float32), rng.uniform(-0.5, 0.5, 5).astype(np.float32)]
               for c in range(num_clients)}
    sizes = [int(n) for n in rng.integers(5, 50, num_clients)]
    clients = Clients(updates, sizes, lost)
    cfg = tiny_config(f"federation.num_clients={num_clients}", f"federation.clients_per_round={num_clients}",
                      "runtime.name=flower", f"runtime.flower.num_supernodes={num_clients}", "federation.round_timeout_s=1",
                      f"runtime.flower.secure_aggregation.clipping_range={clipping_range}",
                      "runtime.flower.secure_aggregation.reconstruction_threshold=2")
    runtime = SimpleNamespace(cfg=cfg, node_of_partition={c: 100 + c for c in range(num_clients)},
                              num_partitions=num_clients, exp=SimpleNamespace(parts=[range(n) for n in sizes]),
                              _exchange=clients.exchange)
    payloads = {c: b"fedpeft payload %d" % c for c in range(num_clients)}
    mean, replies, dropped, _down, _up = secure_mean(runtime, 1, payloads, NAMES)
    return mean, replies, dropped, updates, sizes, clients


def weighted_mean(updates, sizes, clients):
    w = np.array([sizes[c] for c in clients], dtype=np.float64)
    return [sum(wi * updates[c][i] for wi, c in zip(w, clients)) / w.sum() for i in range(len(NAMES))]


@pytest.mark.parametrize("lost", [{}, {4: Stage.SETUP}, {4: Stage.SHARE_KEYS}, {4: Stage.COLLECT_MASKED_VECTORS},
                                  {1: Stage.SETUP, 3: Stage.COLLECT_MASKED_VECTORS}, {2: Stage.UNMASK}])
def test_the_server_gets_the_weighted_mean_of_the_clients_that_finished(lost):
    mean, replies, dropped, updates, sizes, _clients = run_protocol(5, lost)
    finished = [c for c in range(5) if c not in lost or lost[c] == Stage.UNMASK]  # unmask-stage loss: update is in
    assert sorted(replies) == finished
    assert sorted(dropped) == sorted(c for c in lost if c not in finished)
    expect = weighted_mean(updates, sizes, finished)
    step = 2 * 1.0 / 2**28  # quantization step for 5 clients (Q = 2^28) with clipping_range 1
    for name, e in zip(NAMES, expect):
        np.testing.assert_allclose(mean[name], e, atol=4 * step + 1e-7)
    assert all(replies[c] == (sizes[c], {"round": 1, "train_loss": 0.5}) for c in finished)


def test_no_reply_the_server_sees_holds_a_client_update():
    _, _, _, updates, _, clients = run_protocol(3, {})
    plain = {u.tobytes() for us in updates.values() for u in us}
    for reply in clients.seen_by_server:
        assert all(len(r) == 0 for r in reply.content.array_records.values())  # the mod cleared the clear update
        for values in reply.content.config_records[RECORD_KEY_CONFIGS].values():
            for v in values if isinstance(values, list) else [values]:
                assert not (isinstance(v, bytes) and v in plain)


def test_too_many_losses_fail_the_round_without_a_mean():
    mean, replies, dropped, *_ = run_protocol(3, {0: Stage.COLLECT_MASKED_VECTORS, 1: Stage.COLLECT_MASKED_VECTORS})
    assert mean is None and replies == {} and sorted(dropped) == [0, 1, 2]
