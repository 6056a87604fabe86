"""The Flower transport's asynchronous half (FlowerTransport.start_clients and poll_arrivals) on Flower's own
SuperLink state, in this process: the in-memory link state and Grid of Flower's simulation engine, with this test
playing the SuperNode (it takes a pushed message and stores a reply, as the Fleet API does). It checks, with
Flower's own TTL rules, that a reply that came while the server was not pulling is still taken after
federation.round_timeout_s (runtime.flower.reply_grace_s), that a client with no reply is given up at the first
poll after round_timeout_s, and that a client no SuperNode serves fails at its start."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from flwr.app import Message
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid
from helpers import tiny_config

from fedpeft import wire
from fedpeft.runtime.flower.records import pack
from fedpeft.runtime.flower.server_app import FlowerTransport

RUN, SUPERLINK = 7, 1
TIMEOUT = 0.5  # federation.round_timeout_s of these tests


@pytest.fixture
def link():
    """Flower's in-memory SuperLink state holding run RUN with one SuperNode, and the Grid a ServerApp of that run
    gets: (grid, state, node id)."""
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN, SUPERLINK, 1  # (the ServerApp's)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(RUN)
    run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID
    state.run_ids[RUN] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=RUN)
    node = state.create_node("owner", "owner", secrets.token_bytes(32), heartbeat_interval=1e9)
    state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=1e9)
    grid = InMemoryGrid(factory)
    grid.set_run(run)
    yield grid, state, node
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def transport(link, *overrides: str) -> FlowerTransport:
    """A FlowerTransport on ``link`` whose partition 0 the one SuperNode serves (as if it had claimed it)."""
    grid, _, node = link
    cfg = tiny_config("runtime.name=flower", f"federation.round_timeout_s={TIMEOUT}", "runtime.flower.num_supernodes=1",
                      "runtime.flower.poll_interval_s=0.01", "federation.asynchronous={rule: fedbuff, buffer_size: 1}",
                      *overrides)
    t = FlowerTransport(grid, cfg)
    t.max_payload = 1 << 20
    t.described.add(node)
    t.partitions.node_of[0] = node
    return t


def payload(value: float) -> wire.Payload:
    return wire.Payload({"w": np.full(4, value, np.float32)}, {"round": 1, "num_examples": 4})


def answer(link) -> None:
    """The SuperNode's part: take the message waiting for it and store its reply, an update of 2s."""
    _, state, node = link
    (msg,) = state.get_message_ins(node_id=node, limit=1)
    reply = Message(pack(wire.encode(payload(2.0)), round=1), reply_to=msg)
    reply.metadata.__dict__["_message_id"] = reply.object_id  # (the Fleet API names a reply by its content)
    assert state.store_message_res(reply)


@pytest.mark.parametrize("grace", [5.0, 0.0])
def test_a_reply_that_came_while_the_server_was_busy_is_taken_within_the_grace(link, grace):
    """The client answers in time, but the server next pulls after round_timeout_s (it was aggregating or
    evaluating): the message outlived round_timeout_s by reply_grace_s, so the reply is still there. Without the
    grace, Flower refuses a reply whose message expired, and the update is lost."""
    t = transport(link, f"runtime.flower.reply_grace_s={grace}")
    started, failed = t.start_clients(1, {0: payload(1.0)})
    assert failed == {} and list(started) == [0]
    (pushed,) = t.streaming.values()
    assert pushed.message.metadata.ttl == pytest.approx(TIMEOUT + grace)
    answer(link)
    time.sleep(TIMEOUT + 0.3)  # the server is busy elsewhere
    ((cid, draw, (update, n_down, n_up, failure)),) = t.poll_arrivals()
    assert (cid, draw, n_down) == (0, 1, started[0]) and not t.streaming
    if grace:
        assert failure is None and n_up > 0
        np.testing.assert_array_equal(update.arrays["w"], np.full(4, 2.0, np.float32))
    else:
        assert update is None and failure == (f"no reply within federation.round_timeout_s={TIMEOUT:g} s (the "
                                              "message expired)")


def test_a_client_without_a_reply_is_given_up_at_the_first_poll_after_its_timeout(link):
    t = transport(link)
    t.start_clients(3, {0: payload(1.0)})
    assert t.poll_arrivals() == []  # (waits one poll interval: still in time)
    time.sleep(TIMEOUT)
    ((cid, draw, (update, _, n_up, failure)),) = t.poll_arrivals()
    assert (cid, draw, update, n_up) == (0, 3, None, 0)
    assert failure == f"no reply within federation.round_timeout_s={TIMEOUT:g} s (client stopped or disconnected)"
    assert t.unavailable() == {0}  # its message lives on for reply_grace_s: not started again meanwhile
    answer(link)  # too late: nothing waits for it any more
    assert t.poll_arrivals() == [] and not t.streaming
    t.given_up[0] = time.monotonic()  # (as if reply_grace_s had passed)
    assert t.unavailable() == set()


def test_a_client_no_supernode_serves_fails_at_its_start_and_the_others_start(link):
    t = transport(link, "runtime.flower.num_supernodes=2")  # partition 1 has no SuperNode
    started, failed = t.start_clients(1, {0: payload(1.0), 1: payload(1.0)})
    assert list(started) == [0]
    assert failed == {1: (None, 0, 0, "no SuperNode online serves partition 1")}
    answer(link)
    ((cid, _, (update, _, _, failure)),) = t.poll_arrivals()
    assert cid == 0 and failure is None and update is not None
