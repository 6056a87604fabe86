"""The secured Flower deployment (TLS, SuperNode authentication, fedpeft's SuperLink launcher) under the attacks of
issue 35, on loopback: the SuperLink serves its Control and Runtime APIs to 127.0.0.1 only, so a process connecting
from 127.0.0.2 with the public ca.crt is an outsider on another machine. Every attack is refused and logged;
the operator's own registrations, runs and SuperNodes keep working. One deployment serves every test here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import tiny_config, write_flower_app

from fedpeft.rundir import read_metrics
from fedpeft.runtime.flower.credentials import make_credentials
from fedpeft.runtime.flower.launch import (
    LocalDeployment,
    flower_executable,
    free_port,
    run_flower,
    write_connection,
)
from fedpeft.runtime.flower.partitions import pinned_key_fingerprint

pytestmark = [pytest.mark.slow, pytest.mark.needs_data]
OUTSIDE = [sys.executable, str(Path(__file__).parent / "outside_address.py")]  # connects from 127.0.0.2
EVIL_SERVER = '''
from pathlib import Path
from flwr.serverapp import ServerApp

app = ServerApp()


@app.main()
def main(grid, context):
    Path(context.run_config["marker"]).write_text("the outsider's code ran on the server")
'''


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """The operator's deployment: SuperNode keys 0 and 1 serve partitions 0 and 1; key 2 is registered too (a
    participant's, used to claim a partition that is not its own). The outsider holds ca.crt and a key of its own."""
    root = tmp_path_factory.mktemp("secured")
    creds = make_credentials(root / "creds", supernodes=3)
    outsider = make_credentials(root / "outsider", supernodes=1)
    with LocalDeployment(2, root / "logs", credentials=creds, control_from=["127.0.0.1/32"]) as dep:
        register = flwr(dep.env, "supernode", "register", str(creds / "supernode-2.pub"), "fedpeft")
        assert register.returncode == 0, register.stdout
        home = root / "outsider-home"
        write_connection(home, dep.address, str(creds / "ca.crt"))
        yield {"dep": dep, "creds": creds, "outsider_key": outsider / "supernode-0.pub", "root": root,
               "outsider_env": {**dep.env, "FLWR_HOME": str(home)}}


def flwr(env: dict[str, str], *args: str, outside: bool = False) -> subprocess.CompletedProcess:
    command = [*OUTSIDE, "flwr"] if outside else [flower_executable("flwr")]
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    done.stdout += done.stderr
    return done


def operator_nodes(secured) -> dict[str, str]:
    """node id -> status, as the operator's `flwr supernode ls` reports them."""
    listed = flwr(secured["dep"].env, "supernode", "ls", "fedpeft", "--format", "json")
    assert listed.returncode == 0, listed.stdout
    return {str(n["node-id"]): n["status"] for n in json.loads(listed.stdout[listed.stdout.index("{"):])["nodes"]}


def refused_by_the_filter(done: subprocess.CompletedProcess) -> bool:
    return done.returncode != 0 and "--control-from" in " ".join(done.stdout.split())


def test_an_outsider_with_the_ca_certificate_gets_nothing_but_the_fleet_api(secured, tmp_path):
    dep, env = secured["dep"], secured["outsider_env"]
    before = operator_nodes(secured)
    assert len(before) == 3 and sum(s == "online" for s in before.values()) == 2

    # its own SuperNode key: not registered, so its SuperNode cannot join
    assert refused_by_the_filter(flwr(env, "supernode", "register", str(secured["outsider_key"]), "fedpeft",
                                      outside=True))
    own_log = tmp_path / "outsider-supernode.log"
    with open(own_log, "wb") as out:  # in process isolation: it starts no ClientApp executor of its own
        own = subprocess.Popen([*OUTSIDE, "-m", "fedpeft.runtime.flower.fast_supernode", "--superlink", dep.address,
                                "--root-certificates", str(secured["creds"] / "ca.crt"), "--isolation", "process",
                                "--auth-supernode-private-key", str(secured["outsider_key"]).removesuffix(".pub"),
                                "--port", str(free_port()), "--node-config", "partition-id=0 num-partitions=2"],
                               env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert own.wait(timeout=60) != 0
    finally:
        LocalDeployment._stop(own)
    assert "Failed to activate SuperNode" in own_log.read_text()

    # its own Flower app: never runs on the server
    marker = tmp_path / "PWNED"
    app = write_flower_app(tmp_path / "evil", "evil", {"server": EVIL_SERVER}, serverapp="server:app",
                           clientapp="server:app", config={"marker": str(marker)}, publisher="outsider")
    assert refused_by_the_filter(flwr(env, "run", str(app), "fedpeft", "--stream", outside=True))

    # the operator's SuperNodes: cannot be removed
    victim = next(node for node, status in before.items() if status == "online")
    assert refused_by_the_filter(flwr(env, "supernode", "unregister", victim, "fedpeft", outside=True))
    assert refused_by_the_filter(flwr(env, "supernode", "ls", "fedpeft", outside=True))

    # the operator's next ServerApp task: cannot be taken; a forwarding header does not help
    ca = str(secured["creds"] / "ca.crt")
    protobuf = {"content-type": "application/protobuf"}
    with httpx.Client(transport=httpx.HTTPTransport(verify=ca, local_address="127.0.0.2")) as outsider:
        assert outsider.post(f"https://{dep.address}/v1/runtime/acquire-task", headers=protobuf).status_code == 403
        assert outsider.post(f"https://{dep.address}/v1/control/list-nodes",
                             headers={**protobuf, "x-forwarded-for": "127.0.0.1"}).status_code == 403
        assert outsider.get(f"https://{dep.address}/health").status_code == 200
        assert outsider.post(f"https://{dep.address}/v1/fleet/pull-messages",  # Flower's SuperNode authentication
                             headers=protobuf).status_code == 401

    assert operator_nodes(secured) == before and not marker.exists()
    log = (secured["root"] / "logs" / "superlink.log").read_text()
    for path in ("/v1/control/register-node", "/v1/control/start-run", "/v1/control/unregister-node",
                 "/v1/control/list-nodes", "/v1/runtime/acquire-task"):
        assert f"refused POST {path} from 127.0.0.2: the peer is outside --control-from" in log, path
    assert "refused POST /v1/control/list-nodes from 127.0.0.2: it carries a forwarding header" in log


def start_participant(secured, partition: int) -> subprocess.Popen:
    """A SuperNode with the registered key 2, connecting from 127.0.0.2 (the Fleet API is open to it), that
    claims ``partition`` (Flower's own ClientApp process per message)."""
    dep, creds = secured["dep"], secured["creds"]
    log = open(secured["root"] / "logs" / "participant.log", "ab")  # noqa: SIM115 (held by the process)
    try:
        return subprocess.Popen([*OUTSIDE, "-m", "fedpeft.runtime.flower.fast_supernode", "--superlink", dep.address,
                                 "--root-certificates", str(creds / "ca.crt"), "--auth-supernode-private-key",
                                 str(creds / "supernode-2"), "--port", str(free_port()),
                                 "--node-config", f"partition-id={partition} num-partitions=2"],
                                env=dep.env, stdout=log, stderr=subprocess.STDOUT, cwd=dep.cwd,
                                start_new_session=True)
    finally:
        log.close()


WAITING_PLUGIN = '''
"""FedAvg whose server waits, before configuring round 2, until the SuperNode whose log is ``wait_for`` has
registered: the rounds after it then see that SuperNode, however long its start took."""
import time
from pathlib import Path
from typing import Literal

import fedpeft
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedavg.options import FedAvgOptions


class WaitingOptions(FedAvgOptions):
    name: Literal["waiting_fedavg"] = "waiting_fedavg"
    wait_for: str = ""


class WaitingServer(FedAvgServer):
    def configure(self, rnd, clients):
        deadline = time.time() + 240
        while rnd == 2 and time.time() < deadline and not (
                Path(self.options.wait_for).exists() and "SuperNode ID:" in Path(self.options.wait_for).read_text()):
            time.sleep(0.1)
        return super().configure(rnd, clients)


fedpeft.register_algorithm("waiting_fedavg", options=WaitingOptions, server=WaitingServer,
                           client=lambda options: FedAvgClient())
'''


def test_a_registered_supernode_cannot_displace_the_one_serving_a_partition(secured, tmp_path):
    """The operator runs fedpeft (registration, `flwr run`, SuperNodes: all from this machine); once round 1 is
    done a second SuperNode (another registered key) claims partition 0. It is refused and logged; every round
    aggregates both clients from the operator's SuperNodes. (The server waits in round 2 until that SuperNode
    has registered, so a slow start cannot let the run end before the claim.) partition_keys: any, so that the
    displacement rule alone decides, not the pins this deployment would give a run by default."""
    import threading

    dep = secured["dep"]
    plugin = tmp_path / "waiting.py"
    plugin.write_text(WAITING_PLUGIN)
    participant_log = secured["root"] / "logs" / "participant.log"
    participant_log.unlink(missing_ok=True)
    cfg = tiny_config("federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=4",
                      "train.local_steps=1", "federation.round_timeout_s=60", "algorithm.name=waiting_fedavg",
                      f"algorithm.wait_for={participant_log}", "runtime.flower.partition_keys=any",
                      plugins=[str(plugin)])
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(s=run_flower(cfg, tmp_path / "run", deployment=dep,
                                                                   log=lambda m: None)))
    run.start()
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "run" / "checkpoint.safetensors").exists():
        time.sleep(0.05)
    participant = start_participant(secured, partition=0)
    try:
        run.join(timeout=600)
    finally:
        LocalDeployment._stop(participant)
    assert done["s"]["rounds"] == 4 and done["s"]["rejected_updates"] == 0
    rows = read_metrics(tmp_path / "run")
    assert all(set(r["client_train_loss"]) == {"0", "1"} for r in rows[1:])
    events = (tmp_path / "run" / "events.log").read_text()
    assert "claims partition 0, which SuperNode" in events and "serves and still answers for: refused" in events
    assert "now serves partition" not in events
    participant = (secured["root"] / "logs" / "participant.log").read_text()
    assert "Receiving: query.describe message" in participant and "Receiving: train" not in participant


def test_pinned_keys_keep_a_supernode_off_a_partition_it_claims_first(secured, tmp_path):
    """The startup race that the displacement rule cannot close: a registered SuperNode claiming partition 0 is
    online before the run starts. With runtime.flower.partition_keys it is refused, whatever the order."""
    creds = secured["creds"]
    keys = {i: (creds / f"supernode-{i}.pub").read_text().strip() for i in range(3)}
    participant = start_participant(secured, partition=0)
    try:
        cfg = tiny_config("federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=1",
                          "train.local_steps=1", f"runtime.flower.partition_keys={{0: '{keys[0]}', 1: '{keys[1]}'}}")
        summary = run_flower(cfg, tmp_path / "run", deployment=secured["dep"], log=lambda m: None)
    finally:
        LocalDeployment._stop(participant)
    assert summary["rounds"] == 1 and summary["rejected_updates"] == 0
    events = (tmp_path / "run" / "events.log").read_text()
    assert (f"claims partition 0, which runtime.flower.partition_keys pins to key {pinned_key_fingerprint(keys[0])}"
            ": refused") in events
    assert f"(key {pinned_key_fingerprint(keys[2])})" in events
