"""The Flower runtime on real Flower processes over loopback: a SuperLink and two SuperNodes started and
stopped by the tests on free ports, fedpeft's ServerApp and ClientApp, tiny random models, real data."""

import math
import threading
import time

import numpy as np
import pytest
from helpers import tiny_config, without_timings

from fedpeft import checkpoint
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runlock import RunDirectoryBusy, RunLock
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.flower.launch import LocalDeployment, run_flower
from fedpeft.runtime.resume import resume_config

pytestmark = [pytest.mark.slow, pytest.mark.needs_data]  # every test here reads the real datasets
# FLOPs are measured on sampled steps per process, so the estimates (only those, and the simulated time computed
# from them) differ between runtimes
ESTIMATES = {"flops", "client_flops"}


def comparable(rows):
    return [{k: v for k, v in r.items() if k not in ESTIMATES and "sim_" not in k} for r in without_timings(rows)]


# An update's JSON metadata carries the client's measured loss at full precision (its time and FLOPs are written
# at a fixed width: wire.clock_text). The ClientApps train with fewer math threads than the embedded runtime, so
# the loss's last bits, and with them the length of its shortest text (by a few characters, never 8), can differ;
# safetensors pads the header to a multiple of 8 bytes, so an upload's size moves by 0 or 8 bytes (seen: HetLoRA's
# 15064 against 15056). Every upload count may differ by one alignment step per update it sums; the rounds'
# tensors and every download are byte-identical and compared exactly.
ALIGNMENT = 8


def upload_slack(rows: list[dict]) -> list[dict[str, int]]:
    """Per metrics row, the bytes each upload figure may differ by: ALIGNMENT per update it sums."""
    out, so_far = [], 0
    for row in rows:
        n = len(row.get("bytes_up") or {}) if isinstance(row, dict) else 0
        so_far += n
        out.append({"bytes_up": ALIGNMENT, "bytes_up_total": ALIGNMENT * n, "cum_bytes_up": ALIGNMENT * so_far,
                    "cum_bytes": ALIGNMENT * so_far})
    return out


def assert_same_metrics(a, b, rel=1e-5, slack=0, uploads=None, top=True):
    """Equal structure and values; floats to a relative tolerance (the ClientApps train with fewer math
    threads than the embedded runtime, so sums are reduced in another order); given a list of metrics rows
    (``top``), upload counts to ``upload_slack``."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-7), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_metrics(a[k], b[k], rel, (uploads or {}).get(k, slack), top=False)
    elif isinstance(a, list):
        assert len(a) == len(b)
        rows = upload_slack(a) if top and all(isinstance(r, dict) for r in a) else None
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_metrics(x, y, rel, slack, rows[i] if rows else None, top=False)
    elif slack and isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
        assert abs(a - b) <= slack, (a, b)
    else:
        assert a == b


def test_upload_counts_may_differ_by_one_alignment_step_per_update():
    rows = [{"round": 1, "bytes_up": {"0": 100, "2": 50}, "bytes_up_total": 150, "cum_bytes_up": 150},
            {"round": 2, "bytes_up": {"1": 60}, "bytes_up_total": 60, "cum_bytes_up": 210}]
    moved = [{**rows[0], "bytes_up": {"0": 108, "2": 42}, "bytes_up_total": 150, "cum_bytes_up": 150},
             {**rows[1], "bytes_up": {"1": 68}, "bytes_up_total": 68, "cum_bytes_up": 218}]
    assert_same_metrics(rows, moved)
    for key, value in (("bytes_up", {"1": 69}), ("bytes_up_total", 69), ("cum_bytes_up", 235), ("round", 3)):
        with pytest.raises(AssertionError):
            assert_same_metrics(rows, [rows[0], {**rows[1], key: value}])


def assert_same_globals(run_a, run_b, rtol=1e-5, atol=1e-6):
    """The final global trainable parameters of two runs (from their last checkpoints) agree."""
    ga = checkpoint.load(run_a)[1]["server"]["global_state"]
    gb = checkpoint.load(run_b)[1]["server"]["global_state"]
    assert ga.keys() == gb.keys()
    for k in ga:
        np.testing.assert_allclose(gb[k], ga[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """SuperNodes in process isolation, each with fedpeft's long-lived ClientApp worker (the default)."""
    with LocalDeployment(2, tmp_path_factory.mktemp("flower")) as d:
        yield d


def test_flower_gives_the_same_results_as_embedded(deployment, tmp_path):
    cfg = tiny_config("algorithm.name=headprune", "algorithm.selection=loss", "algorithm.sparsity=0.5",
                      "federation.rounds=3", "eval.every=1", "peft.dropout=0.1")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    summary = run_flower(cfg, tmp_path / "flower", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 3 and summary["rejected_updates"] == 0
    a, b = read_metrics(tmp_path / "embedded"), read_metrics(tmp_path / "flower")
    assert [r["round"] for r in b] == [0, 1, 2, 3]
    assert_same_metrics(comparable(a), comparable(b))  # losses, accuracies, selections, bytes up and down
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")
    assert all(v > 0 for r in b[1:] for v in r["client_flops"].values())  # measured in the ClientApps
    # progress inside a round: the ServerApp's lines, in events.log and in the stream the launcher's bar follows
    for log_file in (tmp_path / "flower" / "events.log", tmp_path / "flower" / "flower" / "flwr-run.log"):
        text = log_file.read_text()
        assert "round 3/3: 1 of 2 clients done" in text and "round 3/3: 2 of 2 clients done" in text, log_file
        assert "round 3/3 done: loss" in text, log_file

    # the launcher takes the run directory's lock: a directory another process writes is refused
    held = RunLock.acquire(tmp_path / "flower")
    with pytest.raises(RunDirectoryBusy):
        run_flower(resume_config(tmp_path / "flower", 4), tmp_path / "flower", resume=True, deployment=deployment,
                   log=lambda m: None)
    held.release()
    # a finished Flower run takes more rounds and ends like the embedded run extended the same way
    summary = run_flower(resume_config(tmp_path / "flower", 4), tmp_path / "flower", resume=True,
                         deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 4
    EmbeddedRuntime.resume(tmp_path / "embedded", rounds=4).run()
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(read_metrics(tmp_path / "flower")))
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")


def test_a_plugin_algorithm_runs_on_flower_like_embedded(deployment, tmp_path):
    from conftest import REPO

    from fedpeft.config import load_config

    example = REPO / "examples" / "custom_algorithm"  # the SuperNodes load the plugin named in the run's config
    cfg = load_config(example / "config.yaml", ["runtime.progress=false"], plugins=[str(example / "plugin.py")])
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    summary = run_flower(cfg, tmp_path / "flower", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 2 and summary["rejected_updates"] == 0
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(read_metrics(tmp_path / "flower")))
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")


@pytest.mark.parametrize("algorithm", [
    ["algorithm.name=hetlora", "algorithm.rank_groups=[{rank: 1, share: 0.5}, {rank: 4, share: 0.5}]"],
    ["algorithm.name=ffa_lora"],  # every ClientApp builds the same frozen A from the seed (checked by digest)
    ["algorithm.name=fedsa_lora", "eval.personalized=true"],  # B kept in the SuperNode; personalized scores
    ["algorithm.name=flora"],  # each SuperNode merges the stacked rounds into its own backbone
])
def test_federated_lora_methods_run_on_flower_like_embedded(algorithm, deployment, tmp_path):
    cfg = tiny_config(*algorithm, "peft.r=4", "federation.rounds=3", "federation.clients_per_round=3")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    summary = run_flower(cfg, tmp_path / "flower", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 3 and summary["rejected_updates"] == 0
    rows = read_metrics(tmp_path / "flower")
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(rows))
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")
    if "client_rank" in rows[1]:  # heterogeneous ranks: clients of rank 1 send and receive less than rank 4
        for r in rows[1:]:
            by_rank = sorted(r["clients"], key=lambda c: r["client_rank"][str(c)])
            assert r["bytes_up"][str(by_rank[0])] <= r["bytes_up"][str(by_rank[-1])]
            assert len({r["client_rank"][str(c)] for c in r["clients"]}) < 2 or (
                r["bytes_up"][str(by_rank[0])] < r["bytes_up"][str(by_rank[-1])])


def test_over_selection_and_a_deadline_act_in_real_time_on_flower(deployment, tmp_path):
    """3 clients selected a round for 2 (two of them on one SuperNode, which trains one message at a time): the
    first 2 updates to arrive are aggregated and the third is dropped, not waited for and not a failure; a
    deadline no client can meet drops every update and fails the round."""
    cfg = tiny_config("system.over_selection=0.5", "federation.rounds=2", "train.local_steps=2")
    summary = run_flower(cfg, tmp_path / "over", deployment=deployment, log=lambda m: None)
    rows = read_metrics(tmp_path / "over")
    for row in rows[1:]:
        assert len(row["clients"]) == 3 and len(row["client_num_examples"]) == 2 and row["sim_dropped"] == 1
        (why,) = row["rejected"].values()
        assert "the round closed with the first 2 updates to arrive (system.over_selection 0.5" in why
        assert "round_failed" not in row
    assert summary["sim_dropped_updates"] == 2 and summary["rounds"] == 2

    cfg = tiny_config("system.deadline_s=0.05", "federation.rounds=1", "train.local_steps=2")
    run_flower(cfg, tmp_path / "deadline", deployment=deployment, log=lambda m: None)
    row = read_metrics(tmp_path / "deadline")[1]
    assert row["sim_dropped"] == 2 and "round_failed" in row
    assert all("no update within system.deadline_s=0.05 s (in real time)" in why for why in row["rejected"].values())


def test_buffered_asynchronous_aggregation_runs_on_flower_in_real_time(deployment, tmp_path):
    """FedBuff on Flower's Grid: clients are pushed without waiting and their replies taken as they come, a freed
    slot refilled at once. One client training at a time and a buffer of one: each aggregation takes the one
    update, trained from the current model: the run is synchronous FedAvg's with one client a round. Two training
    at once and a buffer of one: each aggregation takes the first reply and refills that slot, so the client of
    the first refill that replied second (its message was pushed before any later one) is aggregated at least one
    version stale; with a buffer of two, a window can hold a client refilled during it. FedAsync (a buffer of one,
    the client's model mixed in) is the same schedule."""
    EmbeddedRuntime(tiny_config("federation.rounds=3", "federation.clients_per_round=1"), tmp_path / "sync").run()
    cfg = tiny_config("federation.rounds=3", "federation.clients_per_round=1",
                      "federation.asynchronous={rule: fedbuff, buffer_size: 1}")
    summary = run_flower(cfg, tmp_path / "serial", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 3 and summary["rejected_updates"] == 0
    rows = read_metrics(tmp_path / "serial")
    assert [r["client_staleness"] for r in rows[1:]] == [{str(c): 0 for c in r["clients"]} for r in rows[1:]]
    assert [r["async_started"] for r in rows[1:]] == [1, 1, 1]
    assert all(r["sim_time_s"] is None and r["sim_round_s"] is None for r in rows[1:])  # real time: no clock

    def as_rounds(rows):
        return [{k: v for k, v in r.items() if k not in ("client_staleness", "async_started")}
                for r in comparable(rows)]

    assert_same_metrics(as_rounds(read_metrics(tmp_path / "sync")), as_rounds(rows))
    assert_same_globals(tmp_path / "sync", tmp_path / "serial")

    for rule, buffer_size in (("fedbuff", 1), ("fedbuff", 2), ("fedasync", 1)):
        run = tmp_path / f"{rule}{buffer_size}"
        cfg = tiny_config("federation.rounds=3", f"federation.asynchronous={{rule: {rule}, buffer_size: "
                          f"{buffer_size}}}")
        summary = run_flower(cfg, run, deployment=deployment, log=lambda m: None)
        rows = read_metrics(run)
        assert summary["rounds"] == 3 and summary["rejected_updates"] == 0
        assert all(len(r["clients"]) == buffer_size for r in rows[1:])
        assert list(rows[1]["client_staleness"].values()) == [0] * buffer_size
        # every training started was aggregated, or is among the 2 still in flight at the end
        assert 0 <= sum(r["async_started"] for r in rows[1:]) - 3 * buffer_size <= 2
        staleness = [s for r in rows[2:] for s in r["client_staleness"].values()]
        assert all(0 <= s <= i for i, r in enumerate(rows[1:]) for s in r["client_staleness"].values())
        if buffer_size == 1:
            assert max(staleness) >= 1


def test_an_image_classification_run_on_flower_is_the_embedded_run(deployment, tmp_path):
    """A ViT on MNIST with Houlsby adapters: the SuperNodes decode their images and send only the adapters and
    the head, as the embedded runtime does."""
    from conftest import DATA_DIR

    cfg = tiny_config("model.name=tiny-vit", "task.type=image_classification", f"task.dataset={DATA_DIR / 'mnist'}",
                      "task.train_split=test[:80%]", "task.eval_split=test[80%:]", "task.split_shuffle_seed=0",
                      "task.max_train_examples=48", "eval.max_examples=32", "peft.method=houlsby",
                      "federation.rounds=2")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    summary = run_flower(cfg, tmp_path / "flower", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 2 and summary["rejected_updates"] == 0
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(read_metrics(tmp_path / "flower")))
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")
    assert {k.split(".")[-3] for k in checkpoint.load(tmp_path / "flower")[1]["server"]["global_state"]
            if "classifier" not in k} == {"adapter"}  # only the adapters and the head travelled


def test_attackers_and_a_robust_rule_run_on_flower_like_embedded(deployment, tmp_path):
    from test_tracking import check_tensorboard

    # the attack happens in the ClientApps (which agree with the server on who attacks through the seed only);
    # the tracker runs in the ServerApp's process and receives every row, as in the embedded runtime
    cfg = tiny_config("federation.clients_per_round=3", "federation.min_replies=3", "federation.rounds=3",
                      "algorithm.robust={rule: median}",
                      "federation.attackers={fraction: 0.25, attack: sign_flip, factor: 3}",
                      "runtime.loggers=[tensorboard]")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    run_flower(cfg, tmp_path / "flower", deployment=deployment, log=lambda m: None)
    rows = read_metrics(tmp_path / "flower")
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(rows))
    assert_same_globals(tmp_path / "embedded", tmp_path / "flower")
    assert any(r.get("adversarial_clients") for r in rows[1:])
    assert all("client_update_norm" in r for r in rows[1:])
    check_tensorboard(tmp_path / "flower", rows, cfg)


def run_killing_a_supernode(cfg, tmp_path, *, supernodes: int, victim: int, restart_after_s: float = 0.0):
    """Run cfg on local SuperNodes into tmp_path/run; once round 1's checkpoint exists, SIGKILL SuperNode
    ``victim`` (and its ClientApp worker), then after ``restart_after_s`` start a new SuperNode (new node
    id) for its partition. Returns the run's summary."""
    with LocalDeployment(supernodes, tmp_path / "flower-logs") as dep:
        done: dict = {}
        thread = threading.Thread(target=lambda: done.update(
            s=run_flower(cfg, tmp_path / "run", deployment=dep, log=lambda m: None)))
        thread.start()
        deadline = time.time() + 300
        while time.time() < deadline and not (tmp_path / "run" / "checkpoint.safetensors").exists():
            time.sleep(0.05)
        dep.kill_supernode(victim)
        thread.join(timeout=restart_after_s)
        dep.supernodes[victim] = dep.start_supernode(victim)
        thread.join(timeout=400)
    return done["s"]


def test_a_killed_client_fails_its_round_and_the_run_goes_on(tmp_path):
    """SuperNode 1 is killed during round 2 and started again: round 2 aggregates the other client's
    update after the timeout, the failure is logged, later rounds use the new SuperNode, the run ends."""
    cfg = tiny_config("federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=5",
                      "federation.round_timeout_s=20", "federation.min_replies=1", "train.local_steps=2")
    summary = run_killing_a_supernode(cfg, tmp_path, supernodes=2, victim=1)  # its round-2 message: no answer
    assert summary["rounds"] == 5
    rows = read_metrics(tmp_path / "run")
    assert rows[1]["rejected"] == {}
    assert "no reply within federation.round_timeout_s=20 s" in rows[2]["rejected"]["1"]
    assert list(rows[2]["client_train_loss"]) == ["0"] and "round_failed" not in rows[2]
    assert rows[5]["rejected"] == {} and set(rows[5]["client_train_loss"]) == {"0", "1"}
    log = (tmp_path / "run" / "events.log").read_text()
    assert "update of client 1 rejected: no reply" in log
    assert read_summary(tmp_path / "run")["rejected_updates"] >= 1


def test_a_killed_server_resumes_from_its_checkpoint_and_ends_like_an_uninterrupted_run(tmp_path):
    cfg = tiny_config("federation.rounds=4", "eval.every=1", "train.local_steps=2", "peft.dropout=0.1")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    outcome: dict = {}

    def first_attempt(dep):
        try:
            outcome["summary"] = run_flower(cfg, tmp_path / "run", deployment=dep, log=lambda m: None)
        except RuntimeError as exc:
            outcome["error"] = str(exc)

    with LocalDeployment(2, tmp_path / "logs-1", warm=False) as dep:  # Flower's own ClientApp processes
        thread = threading.Thread(target=first_attempt, args=(dep,))
        thread.start()
        deadline = time.time() + 300
        while time.time() < deadline and not (tmp_path / "run" / "checkpoint.safetensors").exists():
            time.sleep(0.05)
        dep.kill_superlink()  # the SuperLink, its SuperExec and the ServerApp, mid-run
        thread.join(timeout=120)
    assert not thread.is_alive() and "without results" in outcome.get("error", "")
    done = checkpoint.load(tmp_path / "run")[0]
    assert 1 <= done < 4
    with LocalDeployment(2, tmp_path / "logs-2") as dep:  # resumed with warm ClientApp workers
        summary = run_flower(cfg, tmp_path / "run", resume=True, deployment=dep, log=lambda m: None)
    assert summary["rounds"] == 4
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")), comparable(read_metrics(tmp_path / "run")))
    assert_same_globals(tmp_path / "embedded", tmp_path / "run")


def test_tls_and_supernode_authentication(tmp_path):
    """A SuperLink with TLS and SuperNode authentication, keys registered with `flwr supernode register`,
    SuperNodes connecting with the CA certificate and their private keys (all from fedpeft's helper). The config
    pins no partition, so the run pins partition i to the key of the SuperNode i it started."""
    from fedpeft.config import load_config
    from fedpeft.runtime.flower.credentials import make_credentials, partition_keys

    creds = make_credentials(tmp_path / "creds", supernodes=2)
    cfg = tiny_config("federation.rounds=1", "train.local_steps=1")
    with LocalDeployment(2, tmp_path / "logs", credentials=creds) as dep:
        summary = run_flower(cfg, tmp_path / "run", deployment=dep, log=lambda m: None)
    assert summary["rounds"] == 1 and summary["rejected_updates"] == 0
    logs = [(tmp_path / "logs" / f).read_text() for f in ("superlink.log", "supernode-0.log", "supernode-1.log")]
    assert not any("--insecure" in text for text in logs)  # Flower warns when a channel is insecure
    ran = load_config(tmp_path / "run" / "config.yaml", [])
    assert ran.runtime.flower.partition_keys == partition_keys(creds, 2) and cfg.runtime.flower.partition_keys is None


def test_flower_simulation_engine_gives_the_same_results_as_embedded(tmp_path):
    """The same ServerApp and ClientApp on Flower's Ray simulation engine: a SuperLink started with
    --simulation, 2 virtual SuperNodes serving 4 clients, ClientApps in Ray actors."""
    cfg = tiny_config("runtime.flower.engine=simulation", "federation.rounds=2", "eval.every=1")
    EmbeddedRuntime(cfg, tmp_path / "embedded").run()
    summary = run_flower(cfg, tmp_path / "simulation", log=lambda m: None)
    assert summary["rounds"] == 2 and summary["rejected_updates"] == 0
    assert_same_metrics(comparable(read_metrics(tmp_path / "embedded")),
                        comparable(read_metrics(tmp_path / "simulation")))
    assert_same_globals(tmp_path / "embedded", tmp_path / "simulation")
    assert "ClientAppActor" in (tmp_path / "simulation" / "flower" / "flwr-run.log").read_text()  # Ray's actors


def test_secure_aggregation_gives_fedavg_results_without_showing_the_server_an_update(tmp_path):
    """SecAgg+ (Flower's workflow and client mod) on 2 SuperNodes, one client each: the global model after
    3 rounds matches plain FedAvg in the embedded runtime up to the quantization error."""
    base = ["federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=3", "eval.every=1",
            "train.local_steps=2"]
    EmbeddedRuntime(tiny_config(*base), tmp_path / "embedded").run()
    cfg = tiny_config(*base, "runtime.name=flower", "runtime.flower.secure_aggregation.clipping_range=1.0")
    summary = run_flower(cfg, tmp_path / "secure", log=lambda m: None)
    assert summary["rounds"] == 3 and summary["rejected_updates"] == 0
    a, b = read_metrics(tmp_path / "embedded"), read_metrics(tmp_path / "secure")
    money = {"bytes_down", "bytes_up", "bytes_down_total", "bytes_up_total", "cum_bytes", "cum_bytes_up",
             "cum_bytes_down", "agg_update_norm"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in money | {"agg_lora_aggregation_error"}}
                          for r in comparable(rows)]
    assert_same_metrics(strip(a), strip(b), rel=1e-4)  # losses and accuracies: the models agree
    for ra, rb in zip(a[1:], b[1:]):
        # the LoRA aggregation error needs each client's factors, which SecAgg+ hides from the server
        assert "agg_lora_aggregation_error" in ra and "agg_lora_aggregation_error" not in rb
        assert math.isclose(ra["agg_update_norm"], rb["agg_update_norm"], rel_tol=1e-4)
        # every SecAgg+ stage is counted; the masked update alone is 8 bytes per entry (int64) vs 4 in the clear
        assert all(rb["bytes_up"][c] > 1.9 * ra["bytes_up"][c] for c in ra["bytes_up"])
    assert_same_globals(tmp_path / "embedded", tmp_path / "secure", rtol=1e-4, atol=1e-6)


def test_secure_aggregation_survives_a_client_dropping_out(tmp_path):
    """3 clients on 3 SuperNodes, all selected: SuperNode 2 is killed as round 2 starts; round 2 securely
    aggregates the other two clients (stock Flower 1.41 failed such a round: see secure.SecAggPlus), the
    dropout is logged, and the run goes on with a new SuperNode. Losses at every stage are covered in
    test_secure_aggregation_protocol.py."""
    cfg = tiny_config("federation.num_clients=3", "federation.clients_per_round=3", "federation.rounds=3",
                      "federation.round_timeout_s=30", "federation.min_replies=2", "train.local_steps=2",
                      "runtime.name=flower", "runtime.flower.num_supernodes=3",
                      "runtime.flower.secure_aggregation.clipping_range=1.0")
    # restarted 10 s later, well inside round 2 (a SecAgg+ stage waits up to 30 s for the dead node)
    summary = run_killing_a_supernode(cfg, tmp_path, supernodes=3, victim=2, restart_after_s=10)
    assert summary["rounds"] == 3
    rows = read_metrics(tmp_path / "run")
    assert rows[1]["rejected"] == {} and set(rows[1]["client_train_loss"]) == {"0", "1", "2"}
    assert "SecAgg+ stage" in rows[2]["rejected"]["2"] and "round_failed" not in rows[2]
    assert set(rows[2]["client_train_loss"]) == {"0", "1"} and rows[2]["agg_update_norm"] > 0
    assert rows[3]["rejected"] == {} and set(rows[3]["client_train_loss"]) == {"0", "1", "2"}
    assert "update of client 2 rejected" in (tmp_path / "run" / "events.log").read_text()


def test_a_flower_run_refused_on_its_data_says_why_in_one_line(tmp_path, capsys):
    from fedpeft.cli import main
    from fedpeft.config import dump_config

    data = tmp_path / "mine"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.jsonl").write_text('{"text": "fine", "label": 0}\n{"text": null, "label": 1}\n')
    (tmp_path / "tiny.yaml").write_text(dump_config(tiny_config(f"task.dataset={data}", "runtime.name=flower")))
    assert main(["run", str(tmp_path / "tiny.yaml"), "--run-dir", "run", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the Flower run ended") and "Traceback" not in err
    assert f"DataError: {data / 'train.jsonl'}: split 'train' row 2: 'text' is null" in err


TAMPERING_PLUGIN = '''
"""A modified ClientApp's algorithm: FedAvg whose clients 0-2 send metadata that once crashed the ServerApp."""
from typing import Literal

import fedpeft
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedavg.options import FedAvgOptions

BROKEN = {0: ("train_loss", "abc"), 1: ("num_examples", 10**400), 2: ("train_ops_analytic", [1.0])}


class TamperingOptions(FedAvgOptions):  # FedAvgServer reads FedAvg's options (server_lr, dp, robust)
    name: Literal["tampering_fedavg"] = "tampering_fedavg"


class TamperingClient(FedAvgClient):
    def fit(self, payload, ctx):
        update = super().fit(payload, ctx)
        if ctx.client_id in BROKEN:
            key, value = BROKEN[ctx.client_id]
            update.meta[key] = value
        return update


fedpeft.register_algorithm("tampering_fedavg", options=TamperingOptions, server=FedAvgServer,
                           client=lambda options: TamperingClient())
'''


def test_a_modified_client_sending_bad_metadata_cannot_crash_the_server_app(deployment, tmp_path):
    """The issue's probe as a test: SuperNodes whose ClientApp sends train_loss as a string, num_examples = 10**400
    and train_ops_analytic as a list. Each of those updates is rejected with the reason; the round aggregates the
    honest client's update and the run ends with results."""
    plugin = tmp_path / "tampering.py"
    plugin.write_text(TAMPERING_PLUGIN)
    from fedpeft.config import load_config

    cfg = load_config(None, ["model.name=tiny-bert", "task.dataset=sst2", "task.max_train_examples=64",
                             "task.max_length=32", "federation.num_clients=4", "federation.clients_per_round=4",
                             "federation.rounds=1", "train.batch_size=8", "eval.max_examples=32",
                             "runtime.progress=false", "algorithm.name=tampering_fedavg"], plugins=[str(plugin)])
    summary = run_flower(cfg, tmp_path / "run", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 1 and summary["failed_rounds"] == 0 and summary["rejected_updates"] == 3
    row = read_metrics(tmp_path / "run")[1]
    assert "update metadata train_loss: Input should be a valid number (got 'abc')" in row["rejected"]["0"]
    assert "update metadata num_examples: Input should be less than or equal to" in row["rejected"]["1"]
    assert "update metadata train_ops_analytic: Input should be a valid number" in row["rejected"]["2"]
    assert list(row["client_train_loss"]) == ["3"]
    assert "client 0 rejected: update metadata train_loss" in (tmp_path / "run" / "events.log").read_text()


OVERSIZED_PLUGIN = '''
"""A modified ClientApp's algorithm: FedAvg whose client 0 pads its update with 4 MiB of zeros."""
from typing import Literal

import numpy as np

import fedpeft
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedavg.options import FedAvgOptions


class PaddingOptions(FedAvgOptions):  # FedAvgServer reads FedAvg's options (server_lr, dp, robust)
    name: Literal["padding_fedavg"] = "padding_fedavg"


class PaddingClient(FedAvgClient):
    def fit(self, payload, ctx):
        update = super().fit(payload, ctx)
        if ctx.client_id == 0:
            update.arrays["padding"] = np.zeros(1 << 20, dtype=np.float32)
        return update


fedpeft.register_algorithm("padding_fedavg", options=PaddingOptions, server=FedAvgServer,
                           client=lambda options: PaddingClient())
'''


def test_an_update_over_the_size_cap_is_refused_before_the_server_app_pulls_it(deployment, tmp_path):
    """A modified ClientApp sends 4 MiB more than runtime.max_payload_mb = 1 allows: the ServerApp refuses the
    reply from its declared size (nothing of it is downloaded), the update is rejected with that reason, and the
    round aggregates the other clients'."""
    plugin = tmp_path / "padding.py"
    plugin.write_text(OVERSIZED_PLUGIN)
    from fedpeft.config import load_config

    cfg = load_config(None, ["model.name=tiny-bert", "task.dataset=sst2", "task.max_train_examples=64",
                             "task.max_length=32", "federation.num_clients=3", "federation.clients_per_round=3",
                             "federation.rounds=1", "train.batch_size=8", "eval.max_examples=32",
                             "runtime.progress=false", "runtime.max_payload_mb=1", "algorithm.name=padding_fedavg"],
                      plugins=[str(plugin)])
    summary = run_flower(cfg, tmp_path / "run", deployment=deployment, log=lambda m: None)
    assert summary["rounds"] == 1 and summary["failed_rounds"] == 0 and summary["rejected_updates"] == 1
    row = read_metrics(tmp_path / "run")[1]
    reason = row["rejected"]["0"]
    assert reason.startswith("reply refused before it was pulled: its arrays hold ") and reason.endswith(
        f"bytes, more than the {2**20} allowed (runtime.max_payload_mb)")
    assert sorted(row["client_train_loss"]) == ["1", "2"] and row["bytes_up"]["0"] == 0
    assert "client 0 rejected: reply refused before it was pulled" in (tmp_path / "run" / "events.log").read_text()
