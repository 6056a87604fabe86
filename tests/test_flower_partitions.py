"""Which SuperNode serves which partition (fedpeft.runtime.flower.partitions, FlowerTransport.refresh_nodes):
a SuperNode cannot displace one that serves a partition and still answers; a restarted SuperNode (same key), or
one replacing a SuperNode that left or stopped answering, takes over; pinned keys close the rest. Played here
against a fake SuperLink; tests/test_flower_security.py plays the displacement on real Flower processes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives import serialization
from flwr.app import ConfigRecord, RecordDict

from fedpeft.config import load_config
from fedpeft.runtime.flower.credentials import make_credentials
from fedpeft.runtime.flower.partitions import (
    PartitionTable,
    node_key_fingerprint,
    pinned_key_fingerprint,
)
from fedpeft.runtime.flower.server_app import DESCRIBE, FlowerTransport

pytestmark = pytest.mark.usefixtures("flower_task_identity")  # Flower messages are made here


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Three SuperNode key pairs: their public keys as the SuperLink lists them (PEM) and as OpenSSH lines."""
    creds = make_credentials(tmp_path_factory.mktemp("creds"), supernodes=3)
    out = []
    for i in range(3):
        line = (creds / f"supernode-{i}.pub").read_text().strip()
        pem = serialization.load_ssh_public_key(line.encode()).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        out.append(SimpleNamespace(line=line, pem=pem))
    return out


class FakeSuperLink:
    """SuperNodes that answer describe messages with their partition while alive, and the Grid calls on them."""

    def __init__(self):
        self.nodes: dict[int, dict] = {}  # node id -> {key, partition, alive}
        self.sent: dict[str, int] = {}  # message id -> destination
        self.asked: list[int] = []

    def add(self, node: int, key: bytes, partition: int, count: int = 2) -> None:
        self.nodes[node] = {"key": key, "partition": partition, "alive": True, "count": count}

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=v["key"]) for n, v in self.nodes.items()]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            assert msg.metadata.message_type == DESCRIBE
            mid = f"m{len(self.sent)}"
            self.sent[mid] = msg.metadata.dst_node_id
            self.asked.append(msg.metadata.dst_node_id)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            node = self.nodes.get(self.sent[mid])
            if node and node["alive"]:
                info = ConfigRecord({"partition-id": node["partition"], "num-partitions": node["count"]})
                out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid), has_error=lambda: False,
                                           content=RecordDict({"fedpeft": info})))
        return out


def server(link: FakeSuperLink, *overrides: str) -> FlowerTransport:
    """The ServerApp's node bookkeeping over ``link`` (no model, no run directory)."""
    cfg = load_config(None, ["federation.num_clients=2", "federation.round_timeout_s=0.2",
                             "runtime.flower.poll_interval_s=0.01", *overrides])
    rt = FlowerTransport.__new__(FlowerTransport)
    rt.cfg, rt.grid, rt.puller, rt.max_payload = cfg, link, None, 1 << 20
    rt.partitions = PartitionTable(cfg.runtime.flower.partition_keys)
    rt.num_partitions, rt.described = cfg.runtime.flower.num_supernodes, set()
    return rt


@pytest.mark.parametrize("pinned", [False, True])
def test_a_supernode_answering_first_with_another_partition_count_is_refused(keys, caplog, pinned):
    """The number of partitions is the config's (runtime.flower.num_supernodes), never the first answer's: a
    SuperNode saying num-partitions=1 would otherwise take every client (c mod 1 = 0), and with pinned keys leave
    the run waiting for partitions that can never be served."""
    link = FakeSuperLink()
    link.add(0, keys[2].pem, 0, count=1)  # the lowest node id: asked, and answering, first
    link.add(1, keys[0].pem, 0)
    link.add(2, keys[1].pem, 1)
    pins = [f"runtime.flower.partition_keys={{0: '{keys[0].line}', 1: '{keys[1].line}'}}"] if pinned else []
    rt = server(link, *pins)
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
    assert rt.num_partitions == 2 and rt.node_of_partition == {0: 1, 1: 2}
    assert "SuperNode 0 says num-partitions=1 but the run has runtime.flower.num_supernodes=2" in caplog.text


def test_partition_keys_must_name_partitions_of_the_run(keys):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match=r"partition_keys: partition 2 does not exist: the run has num_supernodes=2"):
        load_config(None, [f"runtime.flower.partition_keys={{2: '{keys[0].line}'}}"])


def two_served_partitions(keys) -> tuple[FakeSuperLink, FlowerTransport]:
    """SuperNodes 1 and 2 (keys 0 and 1) serving partitions 0 and 1, as the ServerApp has settled them."""
    link = FakeSuperLink()
    link.add(1, keys[0].pem, 0)
    link.add(2, keys[1].pem, 1)
    rt = server(link)
    rt.refresh_nodes(timeout=0.5)
    return link, rt


def test_a_second_supernode_cannot_take_a_partition_that_is_served_and_answering(keys, caplog):
    link, rt = two_served_partitions(keys)
    assert rt.node_of_partition == {0: 1, 1: 2}
    link.add(9, keys[2].pem, 0)  # a registered SuperNode of someone else, claiming partition 0
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
        rt.refresh_nodes(timeout=0.5)  # asked again each round, logged once
    assert rt.node_of_partition == {0: 1, 1: 2}
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [(f"SuperNode 9 (key {node_key_fingerprint(keys[2].pem)}) claims partition 0, which "
                        "SuperNode 1 serves and still answers for: refused")]
    link.nodes[1]["alive"] = False  # killed; Flower still lists it online for up to a minute
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {0: 9, 1: 2}
    assert "SuperNode 9 now serves partition 0: SuperNode 1 did not answer its last message" in caplog.text
    assert link.asked[-2:] == [1, 1]  # asked at each refresh, the last time in vain


def test_the_replacement_of_a_supernode_that_missed_its_last_message_takes_over_without_asking(keys, caplog):
    """As when a SuperNode is killed mid-round and started again (a new node id): its round timed out."""
    link, rt = two_served_partitions(keys)
    link.nodes[2]["alive"] = False
    rt.partitions.answered(2, False)  # what _exchange records when its train message got no reply
    link.add(5, keys[2].pem, 1)
    link.asked.clear()
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=5.0)
    assert rt.node_of_partition == {0: 1, 1: 5} and link.asked == [5]
    assert "SuperNode 5 now serves partition 1: SuperNode 2 did not answer its last message" in caplog.text


def test_a_restart_with_the_same_key_takes_over_and_a_supernode_that_left_frees_its_partition(keys, caplog):
    link = FakeSuperLink()
    link.add(1, keys[0].pem, 0)
    rt = server(link)
    rt.refresh_nodes(timeout=0.5)
    link.add(3, keys[0].pem, 0)  # the same SuperNode started again before the old id expired
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {0: 3}
    assert "SuperNode 3 has the key of SuperNode 1 (restarted): it now serves partition 0" in caplog.text
    del link.nodes[3]
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {} and "SuperNode 3 (partition 0) is no longer online" in caplog.text


def test_a_contender_gets_a_partition_its_supernode_left_without_asking_anyone(keys):
    link = FakeSuperLink()
    link.add(1, keys[0].pem, 0)
    link.add(2, keys[1].pem, 0)  # two claims on one free partition at once: the lower id is taken
    rt = server(link)
    rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {0: 1} and rt.partitions.contenders == {2: 0}
    del link.nodes[1]
    link.asked.clear()
    rt.refresh_nodes(timeout=0.5, recheck=False)
    assert rt.node_of_partition == {0: 2} and link.asked == []


def test_while_waiting_for_supernodes_a_contender_is_not_asked_about_again(keys):
    link = FakeSuperLink()
    link.add(1, keys[0].pem, 0)
    link.add(2, keys[1].pem, 0)
    rt = server(link)
    rt.refresh_nodes(timeout=0.5, recheck=False)
    link.asked.clear()
    rt.refresh_nodes(timeout=0.5, recheck=False)
    assert link.asked == [] and rt.node_of_partition == {0: 1}
    rt.refresh_nodes(timeout=0.5)  # a round: the incumbent is asked and still answers
    assert link.asked == [1] and rt.node_of_partition == {0: 1}


def test_pinned_keys_keep_any_other_supernode_off_a_partition_even_a_free_one(keys, caplog):
    link = FakeSuperLink()
    link.add(4, keys[2].pem, 0)  # first to claim the free partition 0, with the wrong key
    rt = server(link, f"runtime.flower.partition_keys={{0: '{keys[0].line}'}}")
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {}
    pinned = pinned_key_fingerprint(keys[0].line)
    assert f"claims partition 0, which runtime.flower.partition_keys pins to key {pinned}: refused" in caplog.text
    link.add(6, keys[0].pem, 0)
    link.add(7, keys[1].pem, 1)  # partition 1 is not pinned
    rt.refresh_nodes(timeout=0.5)
    assert rt.node_of_partition == {0: 6, 1: 7}


def test_fingerprints_are_openssh_ones_from_either_form(keys):
    pinned = pinned_key_fingerprint(keys[0].line)
    assert pinned == node_key_fingerprint(keys[0].pem) != node_key_fingerprint(keys[1].pem)
    assert pinned.startswith("SHA256:") and len(pinned) == len("SHA256:") + 43
    assert pinned_key_fingerprint(pinned) == pinned
    assert node_key_fingerprint(b"") == ""


@pytest.mark.parametrize(("value", "message"), [
    ("{0: abc}", "partition_keys[0]: 'abc' is neither an OpenSSH public key line"),
    ("{0: 'SHA256:short'}", "partition_keys[0]: 'SHA256:short' is not a SHA256 fingerprint"),
    ("{-1: 'SHA256:x'}", "greater than or equal to 0"),
])
def test_a_bad_pinned_key_is_refused_in_one_line(value, message):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, [f"runtime.flower.partition_keys={value}"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pinned_keys_are_refused_on_the_simulation_engine(keys):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match="virtual SuperNodes have no keys"):
        load_config(None, ["runtime.flower.engine=simulation", f"runtime.flower.partition_keys={{0: '{keys[0].line}'}}"])


def test_a_new_run_on_a_superlink_must_pin_its_partitions_or_say_any(keys, tmp_path):
    """Without SuperNode authentication keys change at every start, so the ServerApp cannot tell whether pins would
    ever be served: a new run on a SuperLink of one's own must give the keys or say any, in one line naming both,
    before anything starts. The config itself stays valid, so an older run that pins nothing is still read and
    resumed (as any, with a warning)."""
    from fedpeft.config import ConfigError
    from fedpeft.launchers import run_config
    from fedpeft.runtime.flower.launch import check_partitions_pinned

    remote = ["runtime.name=flower", "runtime.flower.superlink=10.0.0.1:8000"]
    cfg = load_config(None, remote)  # valid: a run directory holding it is still read (eval, report, resume)
    with pytest.raises(ConfigError) as err:
        run_config(cfg, tmp_path / "run", on_run_dir=lambda path: None)
    message = str(err.value)
    assert "\n" not in message and message.startswith("runtime.flower.partition_keys: without it a run on the "
                                                      "SuperLink at superlink='10.0.0.1:8000' lets any SuperNode")
    assert "`fedpeft flower credentials` prints the setting" in message and "partition_keys: any" in message
    assert not (tmp_path / "run").exists()
    said: list[str] = []
    check_partitions_pinned(cfg, True, said.append)  # resuming a run from before the rule: any, said
    assert len(said) == 1 and "(as partition_keys: any)" in said[0]
    for fine in (["runtime.flower.partition_keys=any"], [f"runtime.flower.partition_keys={{0: '{keys[0].line}'}}"]):
        check_partitions_pinned(load_config(None, [*remote, *fine]), False, said.append)
    pinned = load_config(None, [*remote, f"runtime.flower.partition_keys={{0: '{keys[0].line}'}}"])
    assert pinned.runtime.flower.partition_keys == {0: pinned_key_fingerprint(keys[0].line)}
    for local in ([], ["runtime.flower.engine=simulation", remote[1]]):  # a local deployment; virtual SuperNodes
        check_partitions_pinned(load_config(None, local), False, said.append)
    assert len(said) == 1
    for bad, says in (("all", r"partition_keys: 'all' is neither any nor a mapping"), ("{}", "pins no partition")):
        with pytest.raises(ConfigError, match=says) as err:
            load_config(None, [*remote, f"runtime.flower.partition_keys={bad}"])
        assert "\n" not in str(err.value)


def test_any_pins_nothing(keys):
    link = FakeSuperLink()
    link.add(4, keys[2].pem, 0)
    rt = server(link, "runtime.flower.partition_keys=any")
    rt.refresh_nodes(timeout=0.5)
    assert rt.partitions.pinned == {} and rt.node_of_partition == {0: 4}


def test_a_deployment_started_here_with_credentials_pins_each_partition_to_its_supernode(tmp_path):
    """LocalDeployment registers supernode-i.pub itself and starts SuperNode i with its key: a run on it that pins
    nothing gets those pins (tests/test_flower.py's TLS run checks them in its config); any stays any."""
    from fedpeft.runtime.flower.credentials import partition_keys
    from fedpeft.runtime.flower.launch import LocalDeployment, pinned_to

    creds = make_credentials(tmp_path / "creds", supernodes=3)
    dep = LocalDeployment(3, tmp_path / "logs", credentials=creds)  # not started: pinning reads only its keys
    cfg = load_config(None, [])
    logged: list[str] = []
    pinned = pinned_to(cfg, dep, logged.append)
    expected = {i: pinned_key_fingerprint((creds / f"supernode-{i}.pub").read_text()) for i in range(2)}
    assert pinned.runtime.flower.partition_keys == expected == partition_keys(creds, 2)  # the run's 2 partitions
    assert cfg.runtime.flower.partition_keys is None and len(logged) == 1
    for kept in (load_config(None, ["runtime.flower.partition_keys=any"]),
                 load_config(None, [f"runtime.flower.partition_keys={{0: '{expected[1]}'}}"])):
        assert pinned_to(kept, dep, logged.append) is kept
    assert pinned_to(cfg, LocalDeployment(2, tmp_path / "logs"), logged.append) is cfg  # no keys to pin to
