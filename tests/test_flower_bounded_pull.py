"""The ServerApp's bounded reply pull (fedpeft.runtime.flower.bounded_pull): a reply over its byte budget is
refused before its bulk data is held, whether it says its size honestly, lies about its shape, or repeats one
chunk to inflate far beyond what it uploaded. The logic is checked in-process on objects built by Flower's own
code; the last test measures the peak memory of a real ServerApp refusing a reply 16x over the cap."""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.proto.message_pb2 import Message as MessageProto
from flwr.proto.message_pb2 import ObjectTree, PullObjectResponse
from flwr.proto.runtime_pb2 import PullAppMessagesResponse
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from helpers import write_flower_app

from fedpeft.runtime.flower import bounded_pull
from fedpeft.runtime.flower.bounded_pull import (
    OBJECT_OVERHEAD,
    BoundedPull,
    ReplyRefused,
    ReplyTooLarge,
    read_messages_answer,
    read_object_answer,
)

MiB = 1 << 20
PIECE = 64 << 10  # what an HTTP read hands over at a time
CHUNK = 5 * MiB  # Flower's array chunk size


pytestmark = pytest.mark.usefixtures("flower_task_identity")  # Flower messages are made here


def pieces(data: bytes, counter: list[int] | None = None):
    """``data`` as an HTTP body arrives: in pieces; ``counter`` gets the bytes handed out."""
    for start in range(0, len(data), PIECE):
        if counter is not None:
            counter.append(min(PIECE, len(data) - start))
        yield data[start:start + PIECE]


def reply(data: bytes, shape: tuple[int, ...] | None = None) -> Message:
    """A fedpeft-shaped reply: one uint8 array (whose shape may lie about ``data``) and an info record."""
    array = Array(dtype="uint8", shape=shape or (len(data),), stype="fedpeft.wire", data=data)
    return Message(RecordDict({"payload": ArrayRecord({"payload": array}), "fedpeft": ConfigRecord({"round": 1})}),
                   dst_node_id=3, message_type=MessageType.TRAIN)


class StoredPull(BoundedPull):
    """The pull's logic over objects held here, each handed out through the streamed PullObject reader as a
    serialized answer, as the SuperLink sends it; records the bytes each object read took."""

    def __init__(self, message: Message):
        self.poll_s = 0.0
        self.store = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
        self.tree = get_object_tree(message)
        self.root = message.object_id
        self.fetched: list[str] = []
        self.read_bytes = 0

    def _pull_object(self, object_id, limit, deadline):
        self.fetched.append(object_id)
        answer = PullObjectResponse(object_found=True, object_available=True,
                                    object_content=self.store[object_id]).SerializeToString()
        counter: list[int] = []
        try:
            return read_object_answer(pieces(answer, counter), limit).content
        finally:
            self.read_bytes += sum(counter)

    def run(self, max_bytes: int) -> Message:
        contents = self._pull_objects(self.tree, max_bytes, deadline=0.0)
        return bounded_pull._rebuild(self.root, contents)


def test_a_reply_within_the_cap_comes_back_whole():
    data = np.random.default_rng(0).integers(0, 256, 12 * MiB, dtype=np.uint8).tobytes()
    got = StoredPull(reply(data)).run(16 * MiB)
    assert got.content.array_records["payload"]["payload"].data == data
    assert got.content.config_records["fedpeft"]["round"] == 1


def test_an_honest_reply_over_the_cap_is_refused_before_any_chunk():
    data = b"\x05" * (64 * MiB)
    pull = StoredPull(reply(data))
    with pytest.raises(ReplyRefused, match=f"its arrays hold {64 * MiB} bytes, more than the {16 * MiB} allowed"):
        pull.run(16 * MiB)
    kinds = [bounded_pull._object_kind(pull.store[oid]) for oid in pull.fetched]
    assert "ArrayChunk" not in kinds and kinds[-1] == "Array"  # parents first: the header decides
    assert pull.read_bytes < 64 << 10


def test_a_lying_shape_whose_repeated_chunk_inflates_256x_is_refused():
    """The zip bomb: shape says 16 bytes, the header lists one 5 MiB chunk again and again (dedup by id)."""
    data = b"\x01" * (13 * CHUNK)
    pull = StoredPull(reply(data, shape=(16,)))
    uploaded = sum(len(content) for content in pull.store.values())
    assert uploaded < 6 * MiB  # what the client uploaded
    with pytest.raises(ReplyRefused, match=f"an array declares 16 bytes but its chunks make {13 * CHUNK}"):
        pull.run(16 * MiB)
    assert pull.read_bytes < 6 * MiB


def test_a_lying_shape_with_distinct_chunks_is_refused_once_its_budget_is_spent():
    data = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
    pull = StoredPull(reply(data, shape=(16,)))
    with pytest.raises(ReplyRefused, match="more than the .* bytes left of its budget"):
        pull.run(16 * MiB)
    # never read beyond the budget: the refused object's size is known before its content is read
    assert pull.read_bytes <= 16 * MiB + OBJECT_OVERHEAD + PIECE


def test_an_array_header_that_cannot_be_read_refuses_the_reply(monkeypatch):
    pull = StoredPull(reply(b"\x02" * 100))
    array_id = next(oid for oid, c in pull.store.items() if bounded_pull._object_kind(c) == "Array")
    head, body = pull.store[array_id].split(b"\x00", 1)
    meta = json.loads(body)
    for broken in ({**meta, "shape": [-1]}, {**meta, "dtype": "no-such-dtype"}, {**meta, "arraychunk_ids": [7]},
                   {k: v for k, v in meta.items() if k != "shape"}):
        pull.store[array_id] = head + b"\x00" + json.dumps(broken).encode()
        with pytest.raises(ReplyRefused, match="an array header that cannot be read"):
            pull.run(MiB)


def test_objects_that_do_not_make_a_message_refuse_the_reply():
    pull = StoredPull(reply(b"\x02" * 100))
    pull.root = next(oid for oid, c in pull.store.items() if bounded_pull._object_kind(c) == "ConfigRecord")
    with pytest.raises(ReplyRefused, match="not a Message"):
        pull.run(MiB)


def test_an_object_answer_over_its_limit_is_refused_before_its_content_is_read():
    answer = PullObjectResponse(object_found=True, object_available=True,
                                object_content=b"x" * (8 * MiB)).SerializeToString()
    counter: list[int] = []
    with pytest.raises(ReplyRefused, match=f"an object of {8 * MiB} bytes"):
        read_object_answer(pieces(answer, counter), 4 * MiB)
    assert sum(counter) <= PIECE
    got = read_object_answer(pieces(answer), 8 * MiB)
    assert got.found and got.available and got.content == b"x" * (8 * MiB)
    waiting = read_object_answer(pieces(PullObjectResponse(object_found=True).SerializeToString()), 10)
    assert waiting.found and not waiting.available


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _length_delimited(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _deep_tree_bytes(depth: int) -> bytes:
    """An ObjectTree nested deeper than protobuf parses (protobuf cannot even build it)."""
    tree = ObjectTree(object_id="leaf").SerializeToString()
    for _ in range(depth):
        tree = _length_delimited(1, b"x") + _length_delimited(2, tree)
    return tree


def test_a_pull_answer_with_a_huge_or_unreadable_tree_refuses_that_reply_only():
    """Three replies in one PullMessages answer: an honest one, one whose tree lists a million chunk ids and one
    whose tree nests deeper than protobuf parses; only the last two are refused, the first is kept."""
    def proto(i: int) -> MessageProto:
        m = MessageProto()
        m.metadata.message_id, m.metadata.reply_to_message_id = f"reply-{i}", f"asked-{i}"
        return m

    huge = ObjectTree(object_id="big", children=[ObjectTree(object_id=f"{i:064d}") for i in range(1_000_000)])
    answer = PullAppMessagesResponse(messages_list=[proto(0), proto(1), proto(2)],
                                     message_object_trees=[ObjectTree(object_id="ok"), huge]).SerializeToString()
    answer += _length_delimited(2, _deep_tree_bytes(200))  # the third tree
    got = read_messages_answer(pieces(answer), max_items=3, tree_bytes=1 * MiB)
    assert [r.proto.metadata.reply_to_message_id for r in got] == ["asked-0", "asked-1", "asked-2"]
    assert got[0].refused is None and got[0].tree.object_id == "ok"
    assert isinstance(got[1].refused, ReplyTooLarge) and "object tree has" in str(got[1].refused)
    assert got[1].tree is None and str(got[2].refused) == "its object tree cannot be read"


def test_a_pull_answer_that_is_cut_short_is_an_error_not_a_hang():
    answer = PullAppMessagesResponse(messages_list=[MessageProto()],
                                     message_object_trees=[ObjectTree(object_id="a" * 64)]).SerializeToString()
    with pytest.raises(ReplyRefused, match="truncated"):
        read_messages_answer(pieces(answer[:-10]), max_items=1, tree_bytes=MiB)


def test_a_refused_reply_reaches_the_round_as_an_error_reply_with_its_reason():
    """FlowerTransport._pull: what the bounded pull refuses becomes an error reply (code REPLY_REFUSED) to the
    message it answers; a size refusal names the limit that applies (the update cap, the describe limit)."""
    from fedpeft.runtime.flower.server_app import DESCRIBE, REPLY_REFUSED, FlowerTransport

    class Puller:
        def pull(self, limits, deadline):
            self.limits = dict(limits)
            return {}, {"train": ReplyTooLarge("its arrays hold 9 bytes, more than the 4 allowed"),
                        "describe": ReplyRefused("its objects did not all reach the SuperLink in time")}

    rt = FlowerTransport.__new__(FlowerTransport)
    rt.puller, rt.max_payload = Puller(), 4
    sent = {"train": Message(RecordDict(), dst_node_id=3, message_type=MessageType.TRAIN),
            "describe": Message(RecordDict(), dst_node_id=4, message_type=DESCRIBE)}
    got = dict(rt._pull(sent, deadline=0.0))
    assert rt.puller.limits == {"train": 4, "describe": 64 << 10}
    assert all(r.has_error() and r.error.code == REPLY_REFUSED for r in got.values())
    assert got["train"].error.reason == ("reply refused before it was pulled: its arrays hold 9 bytes, more than "
                                         "the 4 allowed (runtime.max_payload_mb)")
    assert got["describe"].error.reason == ("reply refused before it was pulled: its objects did not all reach the "
                                            "SuperLink in time")


# -- the real thing: a ServerApp's peak memory while it refuses a reply 16x over the cap --------------------

CLIENT = '''
import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    ask = msg.content.config_records["ask"]
    n, lie, random = int(ask["bytes"]), bool(ask["lie"]), bool(ask["random"])
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes() if random else b"\\x01" * n
    array = Array(dtype="uint8", shape=(16,) if lie else (n,), stype="fedpeft.wire", data=data)
    return Message(RecordDict({"payload": ArrayRecord({"payload": array})}), reply_to=msg)
'''

SERVER = '''
import gc
import hashlib
import json
import re
import time

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedpeft.runtime.flower.bounded_pull import BoundedPull

app = ServerApp()
MiB = 1 << 20


def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    node = sorted(grid.get_node_ids())[0]
    puller = BoundedPull(grid)
    results = []
    for case in json.loads(cfg["cases"]):
        ask = ConfigRecord({"bytes": case["mib"] * MiB, "lie": case["lie"], "random": case["random"]})
        msg = Message(RecordDict({"ask": ask}), dst_node_id=node, message_type=MessageType.TRAIN, ttl=600)
        (mid,) = grid.push_messages([msg])
        gc.collect()
        before = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
        accepted, refused, data = [], {}, None
        deadline = time.monotonic() + 300
        while not accepted and not refused and time.monotonic() < deadline:
            if case["plain"]:
                accepted = list(grid.pull_messages([mid]))
            else:
                accepted, refused = puller.pull({mid: case["cap_mib"] * MiB}, deadline)
            time.sleep(0.05)
        if accepted:  # Flower's pull gives a list, fedpeft's a dict by the message answered
            reply = accepted[mid] if isinstance(accepted, dict) else accepted[0]
            data = reply.content.array_records["payload"]["payload"].data
            del reply
        why = refused.get(mid)
        results.append({**case, "growth": status("VmHWM") - before, "refused": str(why) if why else None,
                        "sha256": hashlib.sha256(data).hexdigest() if data is not None else None})
        del accepted, data
    open(cfg["out"], "w").write(json.dumps(results))
'''


def write_app(folder, cases, out):
    write_flower_app(folder, "bigreply", {"client": CLIENT, "server": SERVER}, serverapp="server:app",
                     clientapp="client:app", config={"cases": json.dumps(cases), "out": str(out)})


@pytest.mark.slow
def test_the_server_app_refuses_a_reply_16x_over_the_cap_within_a_few_mib(tmp_path):
    """A real SuperLink and SuperNode on loopback, a ServerApp pulling replies of 256 MiB with a 16 MiB cap: told
    honestly, with a lying shape over one repeated chunk (5 MiB uploaded) and with a lying shape over distinct
    chunks. Each is refused and the ServerApp's peak RSS (VmHWM, reset before the pull) grows by at most the cap
    plus 4 MiB. Flower's own pull of the repeated-chunk reply grows it by its inflated size (the measurement
    sees memory), and an 8 MiB reply under the cap arrives intact."""
    from fedpeft.runtime.flower.launch import LocalDeployment, flower_executable, write_connection

    big = {"mib": 256, "cap_mib": 16, "plain": False}
    cases = [{**big, "lie": False, "random": False}, {**big, "lie": True, "random": False},
             {**big, "lie": True, "random": True}, {**big, "lie": True, "random": False, "plain": True},
             {"mib": 8, "cap_mib": 16, "plain": False, "lie": False, "random": True}]
    out = tmp_path / "results.json"
    write_app(tmp_path / "app", cases, out)
    with LocalDeployment(1, tmp_path / "logs", warm=False) as dep:  # Flower's own ClientApp process per message
        write_connection(tmp_path / "logs" / "home", dep.address, None)
        done = subprocess.run([flower_executable("flwr"), "run", str(tmp_path / "app"), "fedpeft", "--stream"],
                              env=dep.env, cwd=tmp_path, capture_output=True, text=True, timeout=500, check=False)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    honest, repeated, distinct, plain, small = json.loads(out.read_text())
    cap = 16 * MiB
    assert honest["refused"].startswith(f"its arrays hold {256 * MiB} bytes, more than the {cap} allowed")
    assert repeated["refused"] == f"an array declares 16 bytes but its chunks make {256 * MiB}"
    assert "bytes left of its budget" in distinct["refused"]
    for case in (honest, repeated, distinct):
        assert case["growth"] <= cap + 4 * MiB, case
    assert plain["refused"] is None and plain["growth"] > 200 * MiB  # what the bounded pull saves
    expected = np.random.default_rng(8 * MiB).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
    assert small["refused"] is None and small["sha256"] == hashlib.sha256(expected).hexdigest()
    print("peak RSS growth (MiB):", {name: round(c["growth"] / MiB, 1) for name, c in
                                     zip(("honest", "repeated", "distinct", "plain", "small"), json.loads(out.read_text()))})
