"""runtime.workers: a round's clients on forked worker processes sharing the frozen backbone
(fedpeft.runtime.workers). The same metrics as in one process (to float32 rounding: the workers' torch threads
reduce in another order), whichever worker trains which client; a worker that dies fails its clients for that
round only; no worker outlives a killed run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from helpers import crash_at_round, metrics_difference, tiny_config, without_timings

from fedpeft.algorithms.fedavg.options import FedAvgOptions
from fedpeft.algorithms.robust.registry import ROBUST_RULES
from fedpeft.config.load import ConfigError, load_config
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.workers import WorkerPoolTransport

# FLOPs are measured on sampled steps per process (each worker samples its own), so they and the simulated time
# computed from them are estimates that differ between one process and several; the fused passes' figures are
# summed over the workers' passes
ESTIMATES = {"flops", "client_flops", "fused_sub_batches", "fused_micro_steps", "fused_padded_share",
             "alone_padded_share", "clients_per_pass", "workers", "worker_private_mb"}  # (and how it ran)


def learning(rows):
    return [{k: v for k, v in r.items() if k not in ESTIMATES and "sim_" not in k} for r in without_timings(rows)]


def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    rt = EmbeddedRuntime(tiny_config("federation.rounds=2", "federation.num_clients=6",
                                     "federation.clients_per_round=4", *overrides), tmp_path / name)
    rt.run()
    return read_metrics(tmp_path / name)


@pytest.mark.needs_data
@pytest.mark.parametrize("method", [
    ["peft.method=lora"],
    ["peft.method=ia3", "algorithm={name: fedprox, mu: 0.1}"],
    ["peft.method=houlsby"],
    ["peft.method=prompt_tuning"],
    ["algorithm.name=fedsa_lora", "eval.personalized=true"],  # each client's own B: state the parent keeps
    ["algorithm={name: hetlora, rank_groups: [{rank: 4, share: 0.5}, {rank: 16, share: 0.5}]}"],
    ["algorithm={name: headprune, sparsity: 0.5}"],  # the clients' head importance reaches the server's observer
    ["federation.attackers={fraction: 0.25, attack: sign_flip}"],
    ["algorithm.robust={rule: median}", "federation.attackers={fraction: 0.25, attack: label_flip}",
     "federation.min_replies=3"],
    ["algorithm.name=fedpeptao", "peft.method=prefix_tuning", "peft.num_virtual_tokens=4"],  # server momentum
], ids=["lora", "ia3-fedprox", "houlsby", "prompt_tuning", "fedsa_lora", "hetlora", "headprune", "attackers",
        "median-label-flip", "fedpeptao"])
def test_workers_give_the_metrics_of_one_process(tmp_path, method):
    """Against one process with the same clients_per_pass (a fused pass draws its dropout masks for the fused
    batch, so with dropout on clients_per_pass itself changes the metrics; see tests/test_clients_per_pass.py)."""
    one = {p: run(tmp_path, f"one{p}", *method, f"runtime.clients_per_pass={p}") for p in (1, 2)}
    for workers, per_pass in ((2, 1), (3, 1), (2, 2), (3, 2)):
        rows = run(tmp_path, f"w{workers}p{per_pass}", *method, f"runtime.workers={workers}",
                   f"runtime.clients_per_pass={per_pass}")
        difference = metrics_difference(learning(rows), learning(one[per_pass]))
        assert difference is None, f"workers={workers} clients_per_pass={per_pass}: {difference}"


@pytest.mark.needs_data
@pytest.mark.parametrize("method", [
    ["runtime.clients_per_pass=1"],
    ["algorithm={name: headprune, sparsity: 0.5}", "runtime.clients_per_pass=2"],  # reports to the observer
    ["algorithm.name=fedsa_lora", "eval.personalized=true", "runtime.clients_per_pass=2"],  # the parent's state
], ids=["lora", "headprune-fused", "fedsa_lora-fused"])
def test_spawned_workers_give_the_metrics_of_one_process(tmp_path, method):
    """Workers started as on CUDA, where they cannot be forked: spawned, each rebuilding the experiment from the
    run's config (here on a CPU)."""
    one = run(tmp_path, "one", *method)
    cfg = tiny_config("federation.rounds=2", "federation.num_clients=6", "federation.clients_per_round=4", *method,
                      "runtime.workers=2")
    rt = EmbeddedRuntime(cfg, tmp_path / "spawned", transport=WorkerPoolTransport(2, start="spawn"))
    rt.run()
    rows = read_metrics(tmp_path / "spawned")
    assert all(r["workers"] == 2 for r in rows[1:])
    difference = metrics_difference(learning(rows), learning(one))
    assert difference is None, difference


@pytest.mark.needs_data
def test_spawned_workers_measure_clients_per_pass_in_the_runs_process(tmp_path):
    cfg = tiny_config("federation.rounds=1", "federation.num_clients=8", "federation.clients_per_round=8",
                      "runtime.workers=2", "runtime.clients_per_pass=auto")
    rt = EmbeddedRuntime(cfg, tmp_path / "run", transport=WorkerPoolTransport(2, start="spawn"))
    rt.run()
    events = (tmp_path / "run" / "events.log").read_text()
    assert "runtime.workers 2: 2 workers x" in events and "measured by the run's process" in events
    row = read_metrics(tmp_path / "run")[-1]
    assert row["workers"] == 2 and row["clients_per_pass"] == rt.transport.cohort.chosen
    assert len(row["client_num_examples"]) == 8


@pytest.mark.needs_data
@pytest.mark.parametrize("per_pass", ["1", "auto"])  # (auto: the run's process measures once every worker is built)
def test_a_spawned_worker_that_died_is_replaced(tmp_path, per_pass):
    cfg = tiny_config("federation.rounds=1", "federation.num_clients=4", "federation.clients_per_round=4",
                      "runtime.workers=2", f"runtime.clients_per_pass={per_pass}")
    rt = EmbeddedRuntime(cfg, tmp_path / "run", transport=WorkerPoolTransport(2, start="spawn"))
    rt.transport.procs[0].kill()  # (while it builds)
    rt.run()
    row = read_metrics(tmp_path / "run")[-1]
    assert row["workers"] == 2 and row["rejected"] == {} and len(row["client_num_examples"]) == 4
    assert sorted(rt.transport.devices) == [0, 1] and set(rt.transport.devices.values()) == {"cpu"}


class ScriptOptions(FedAvgOptions):
    name: typing.Literal["script_fedavg"] = "script_fedavg"  # type: ignore[assignment]


@pytest.mark.needs_data
def test_a_spawned_worker_that_cannot_build_the_experiment_stops_the_run_with_why(tmp_path):
    """An algorithm registered only in the run's process (a script's, not a listed plugin) is not in a spawned
    worker, which says so."""
    import fedpeft
    from fedpeft.algorithms import ALGORITHMS
    from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer

    fedpeft.register_algorithm("script_fedavg", options=ScriptOptions, server=FedAvgServer,
                               client=lambda options: FedAvgClient())
    try:
        cfg = tiny_config("federation.rounds=1", "runtime.workers=2", "algorithm.name=script_fedavg")
        rt = EmbeddedRuntime(cfg, tmp_path / "run", transport=WorkerPoolTransport(2, start="spawn"))
        with pytest.raises(RuntimeError, match="worker 0: the worker could not build the experiment"):
            rt.run()
    finally:
        ALGORITHMS.remove("script_fedavg")
    assert all(p is None for p in rt.transport.procs)  # (closed: none left behind)


@pytest.mark.needs_data
def test_spawned_workers_with_an_experiment_of_the_callers_are_refused(tmp_path):
    from fedpeft.runtime.setup import build_experiment

    cfg = tiny_config("runtime.workers=2")
    with pytest.raises(ConfigError, match="spawned workers build the experiment from the run's config"):
        EmbeddedRuntime(cfg, tmp_path / "run", experiment=build_experiment(cfg),
                        transport=WorkerPoolTransport(2, start="spawn"))


@pytest.mark.needs_data
def test_spawned_workers_on_a_cpu_need_a_number(tmp_path):
    cfg = tiny_config("runtime.workers=auto")
    with pytest.raises(ConfigError, match="runtime.workers auto with spawned workers on a CPU: give their number"):
        EmbeddedRuntime(cfg, tmp_path / "run", transport=WorkerPoolTransport("auto", start="spawn"))


@pytest.mark.needs_data
@pytest.mark.parametrize("rule", ROBUST_RULES.names())
def test_every_robust_rule_gives_the_metrics_of_one_process_with_workers(tmp_path, rule):
    """The server's rule sees the updates of 2 workers as those of one process (attackers among the clients)."""
    options = ", trim_fraction: 0.2" if rule == "trimmed_mean" else ""  # (one of 5 updates trimmed at each end)
    both = (f"algorithm.robust={{rule: {rule}{options}}}", "federation.attackers={fraction: 0.2, attack: sign_flip}",
            "federation.num_clients=8", "federation.clients_per_round=5", "federation.min_replies=5")  # (Krum: n > 2f + 2)
    difference = metrics_difference(learning(run(tmp_path, "w2", *both, "runtime.workers=2")),
                                    learning(run(tmp_path, "one", *both)))
    assert difference is None, difference


@pytest.mark.needs_data
def test_differential_privacy_with_workers_clips_every_update_and_accounts_every_round(tmp_path):
    """(DP's server samples the clients from a secret generator, so no two runs select the same clients to compare
    with one process: the workers' updates are checked against the bound instead.)"""
    rows = run(tmp_path, "dp", "algorithm.dp.noise_multiplier=0.5", "algorithm.dp.clipping_norm=0.5",
               "runtime.workers=2", "train.local_steps=2")[1:]
    assert all(r["workers"] == 2 for r in rows)
    eps = [r["dp_epsilon"] for r in rows]
    assert all(isinstance(e, float) for e in eps) and eps[0] < eps[-1]
    assert all(r["rejected"] == {} for r in rows)  # the clients clipped in the workers: every update within the bound
    assert all(len(r["client_num_examples"]) == 4 and r["agg_update_norm"] > 0 for r in rows)


def test_shares_are_even_and_hold_whole_fused_passes():
    t = WorkerPoolTransport(3)
    t.cohort = None
    for k, n, expected in ((1, 4, [[0], [1, 2], [3]]), (2, 5, [[0, 1], [2, 3], [4]]), (2, 4, [[0, 1], [2, 3]]),
                           (1, 7, [[0, 1], [2, 3, 4], [5, 6]])):
        t.run = type("Run", (), {"cfg": tiny_config(f"runtime.clients_per_pass={k}")})()
        assert t._shares(list(range(n))) == expected, (k, n)


@pytest.mark.needs_data
def test_an_error_in_a_client_half_stops_the_run_as_without_workers(tmp_path, monkeypatch):
    from fedpeft.runtime import local_work

    def broken(exp, client, rnd, cid, *args, **kwargs):
        raise ValueError(f"client {cid} cannot train")

    monkeypatch.setattr(local_work, "train_client", broken)
    rt = EmbeddedRuntime(tiny_config("runtime.workers=2"), tmp_path / "run")
    with pytest.raises(RuntimeError, match="ValueError: client . cannot train"):
        rt.run()
    assert all(p is None for p in rt.transport.procs)


@pytest.mark.needs_data
def test_a_worker_that_dies_fails_its_clients_for_that_round_and_is_replaced(tmp_path, monkeypatch):
    from fedpeft.runtime import local_work

    trained = local_work.train_client

    def dies_in_round_1(exp, client, rnd, cid, *args, **kwargs):
        if rnd == 1 and cid in (0, 1):  # (the first worker's share of round 1 holds the first two selected)
            os.kill(os.getpid(), signal.SIGKILL)
        return trained(exp, client, rnd, cid, *args, **kwargs)

    monkeypatch.setattr(local_work, "train_client", dies_in_round_1)  # before the workers are forked
    cfg = tiny_config("federation.rounds=2", "federation.num_clients=4", "federation.clients_per_round=4",
                      "federation.min_replies=2", "runtime.workers=2")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    assert isinstance(rt.transport, WorkerPoolTransport)
    rt.run()
    first, second = read_metrics(tmp_path / "run")[1:]
    assert len(first["rejected"]) == 2 and "round_failed" not in first
    assert all("worker 0 died (killed by signal 9)" in why for why in first["rejected"].values())
    assert len(first["client_num_examples"]) == 2  # the other worker's two were aggregated
    assert not second.get("rejected")  # round 2: a new worker, every client trained
    assert len(second["client_num_examples"]) == 4
    assert all(p is None for p in rt.transport.procs)  # the run's end stopped them


@pytest.mark.needs_data
def test_a_killed_run_with_workers_resumes_to_the_same_result(tmp_path, monkeypatch):
    """FedSA-LoRA: each client's own tensors are state the parent checkpoints, and the resumed run's new workers
    get them back."""
    overrides = ("federation.rounds=3", "federation.num_clients=6", "federation.clients_per_round=4",
                 "algorithm.name=fedsa_lora", "eval.personalized=true", "runtime.workers=2")
    EmbeddedRuntime(tiny_config(*overrides), tmp_path / "full").run()
    rt = EmbeddedRuntime(tiny_config(*overrides), tmp_path / "cut")
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    assert all(p is None for p in rt.transport.procs)  # the workers stopped with the run
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    difference = metrics_difference(learning(read_metrics(tmp_path / "cut")), learning(read_metrics(tmp_path / "full")))
    assert difference is None, difference


@pytest.mark.needs_data
def test_no_worker_outlives_a_killed_run(tmp_path):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from helpers import tiny_config\n"
        "from fedpeft.runtime.embedded import EmbeddedRuntime\n"
        "cfg = tiny_config('federation.rounds=200', 'runtime.workers=2', 'federation.clients_per_round=4')\n"
        "EmbeddedRuntime(cfg, sys.argv[2]).run()\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "run")])
    children: list[int] = []
    deadline = time.monotonic() + 300
    while len(children) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        path = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        children = [int(p) for p in path.read_text().split()] if path.exists() else []
    assert len(children) >= 2, "the run's workers never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{c}").exists() and "Z" not in _state(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [c for c in children if Path(f"/proc/{c}").exists() and "Z" not in _state(c)]
    assert alive == [], f"workers {alive} outlived the killed run"


@pytest.mark.needs_data
def test_a_run_killed_mid_round_resumes_to_the_same_result(tmp_path):
    """kill -9 of the run's process while its workers train round 2 (a worker kills it): the resumed run, with new
    workers, ends where the uninterrupted run does."""
    overrides = ["federation.rounds=3", "federation.num_clients=6", "federation.clients_per_round=4",
                 "algorithm.name=fedsa_lora", "eval.personalized=true", "runtime.workers=2"]
    EmbeddedRuntime(tiny_config(*overrides), tmp_path / "full").run()
    script = (
        "import os, signal, sys; sys.path.insert(0, sys.argv[1])\n"
        "from helpers import tiny_config\n"
        "from fedpeft.runtime import local_work\n"
        "from fedpeft.runtime.embedded import EmbeddedRuntime\n"
        "trained = local_work.train_client\n"
        "def kill_the_run(exp, client, rnd, cid, *args, **kwargs):\n"
        "    if rnd == 2:\n"
        "        os.kill(os.getppid(), signal.SIGKILL)\n"
        "    return trained(exp, client, rnd, cid, *args, **kwargs)\n"
        "local_work.train_client = kill_the_run\n"
        f"EmbeddedRuntime(tiny_config(*{overrides!r}), sys.argv[2]).run()\n")
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "cut")],
                          timeout=300, check=False)
    assert done.returncode == -signal.SIGKILL
    assert [r["round"] for r in read_metrics(tmp_path / "cut")] == [0, 1]  # killed in round 2
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    difference = metrics_difference(learning(read_metrics(tmp_path / "cut")), learning(read_metrics(tmp_path / "full")))
    assert difference is None, difference


@pytest.mark.needs_data
def test_workers_auto_measures_both_numbers_once_and_a_resumed_run_keeps_them(tmp_path, monkeypatch):
    """runtime.threads 4 on any machine: the probe of one worker runs 4 threads in a forked process, and 2 workers
    2 threads each (GNU OpenMP hung a forked process's first parallel region with more than one thread before the
    workers trained on a thread of their own); in a subprocess, so that a hang fails the test."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from helpers import tiny_config\n"
        "from fedpeft.runtime.embedded import EmbeddedRuntime\n"
        "cfg = tiny_config('federation.rounds=2', 'federation.num_clients=8', 'federation.clients_per_round=8', "
        "'runtime.threads=4', 'runtime.workers=auto', 'runtime.clients_per_pass=auto')\n"
        "EmbeddedRuntime(cfg, sys.argv[2]).run()\n")
    subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "run")], timeout=600,
                   check=True)
    events = (tmp_path / "run" / "events.log").read_text()
    assert events.count("runtime.workers auto measured") == 1
    assert "runtime.clients_per_pass auto measured" not in events  # (the probe processes log no choice of theirs)
    measured = next(line for line in events.splitlines() if "runtime.workers auto measured" in line)
    assert "1 x " in measured and "2 x " in measured  # (the candidates: 1, 2, 4 workers, while not 20% slower)
    rows = read_metrics(tmp_path / "run")[1:]
    workers = rows[0]["workers"]
    assert workers in (1, 2, 4) and all(r["workers"] == workers for r in rows)
    assert f"measured {workers} workers x" in measured

    def measured_again(self, cids):
        raise AssertionError("the resumed run measured again")

    monkeypatch.setattr(WorkerPoolTransport, "measure", measured_again)
    resumed = EmbeddedRuntime.resume(tmp_path / "run", rounds=3)
    resumed.run()
    assert resumed.transport.workers == workers
    assert [r["workers"] for r in read_metrics(tmp_path / "run")[1:]] == [workers] * 3


@pytest.mark.needs_data
def test_a_probe_that_dies_ends_the_search_at_fewer_workers(tmp_path, monkeypatch):
    """A probe process of 2 workers killed (as by the out-of-memory killer): auto keeps 1 worker, says why, and
    the run goes on at once (its partner is not left waiting at the barrier)."""
    import torch

    from fedpeft.runtime import workers

    real = workers._plain_rate

    def dies_among_two(run, cids):
        if torch.get_num_threads() == 1 and 0 in cids:  # (a probe of 2 workers on 2 threads: 1 thread each)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(run, cids)

    monkeypatch.setattr(workers, "_plain_rate", dies_among_two)
    cfg = tiny_config("federation.rounds=1", "federation.num_clients=4", "federation.clients_per_round=4",
                      "runtime.threads=2", "runtime.workers=auto")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    start = time.monotonic()
    rt.run()
    assert time.monotonic() - start < 300
    assert rt.transport.workers == 1
    events = (tmp_path / "run" / "events.log").read_text()
    assert "the probe of 2 workers failed, so no more are tried: the probe 0 of 2 workers died" in events
    assert "measured 1 workers x 1 clients per pass" in events
    assert read_metrics(tmp_path / "run")[-1]["workers"] == 1


@pytest.mark.needs_data
def test_a_probe_with_its_figure_trains_on_until_every_probe_has_one(tmp_path, monkeypatch):
    """Probes are timed under the same load: a probe of 2 workers whose figure comes first goes on training while
    its partner (made slow here) is still timing, instead of leaving it the whole machine."""
    import torch

    from fedpeft.runtime import workers

    real, calls = workers._plain_rate, tmp_path / "calls"

    def slow_partner(run, cids):
        if torch.get_num_threads() == 1:  # (a probe of 2 workers on 2 threads: 1 thread each)
            with calls.open("a") as f:
                f.write(f"{0 in cids}\n")
            if 0 not in cids:
                time.sleep(3)
        return real(run, cids)

    monkeypatch.setattr(workers, "_plain_rate", slow_partner)
    cfg = tiny_config("federation.rounds=1", "federation.num_clients=4", "federation.clients_per_round=4",
                      "runtime.threads=2", "runtime.workers=auto")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    made = calls.read_text().split()
    assert "False" in made and made.count("True") >= 2, made


@pytest.mark.needs_data
def test_a_worker_that_does_not_answer_in_time_is_killed_and_its_clients_fail(tmp_path, monkeypatch):
    from fedpeft.runtime import local_work

    trained = local_work.train_client

    def hangs_in_round_1(exp, client, rnd, cid, *args, **kwargs):
        if rnd == 1 and cid in (0, 1):
            os.kill(os.getpid(), signal.SIGSTOP)  # (alive, never answering: only a kill ends it)
        return trained(exp, client, rnd, cid, *args, **kwargs)

    monkeypatch.setattr(local_work, "train_client", hangs_in_round_1)
    cfg = tiny_config("federation.rounds=2", "federation.num_clients=4", "federation.clients_per_round=4",
                      "federation.min_replies=2", "runtime.worker_timeout_s=10", "runtime.workers=2")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    first, second = read_metrics(tmp_path / "run")[1:]
    assert len(first["rejected"]) == 2, first["rejected"]
    assert all("worker 0 did not answer within runtime.worker_timeout_s 10 s and was killed" in why
               for why in first["rejected"].values())
    assert len(first["client_num_examples"]) == 2 and len(second["client_num_examples"]) == 4


@pytest.mark.needs_data
def test_memory_running_out_in_a_worker_reaches_the_runs_checkpoint_and_every_worker(tmp_path, monkeypatch):
    """A fused pass that ran out of memory in one worker halves clients_per_pass there; the run's process takes the
    halving, so its checkpoint keeps it, and every worker trains with it from the next round."""
    from fedpeft import checkpoint
    from fedpeft.runtime.cohort import Cohort

    real, first = Cohort._train_group, tmp_path / "first"

    def out_of_memory_in_one_worker_in_round_1(self, group, seed):
        if seed[1] == 1 and self.limit is None:
            try:
                first.open("x").close()  # (the first worker there; the other trains on with 2)
            except FileExistsError:
                pass
            else:
                self.limit = 1  # (what FusedTrainer leaves after halving 2 to 1)
        return real(self, group, seed)

    monkeypatch.setattr(Cohort, "_train_group", out_of_memory_in_one_worker_in_round_1)
    rt = EmbeddedRuntime(tiny_config("federation.rounds=2", "federation.num_clients=8",
                                     "federation.clients_per_round=8", "runtime.workers=2",
                                     "runtime.clients_per_pass=2"), tmp_path / "run")
    assert rt.transport.cohort.limit is None
    rt.run()
    assert rt.transport.cohort.limit == 1
    assert checkpoint.load(tmp_path / "run")[1]["clients_per_pass"]["limit"] == 1
    rows = read_metrics(tmp_path / "run")
    assert rows[1]["clients_per_pass"] == 2 and rows[2]["clients_per_pass"] == 1


def test_a_transport_of_its_own_with_workers_is_refused():
    from fedpeft.runtime.inprocess import InProcessTransport

    with pytest.raises(ConfigError, match="a transport of its own"):
        EmbeddedRuntime(tiny_config("runtime.workers=2"), None, transport=InProcessTransport())


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize(("overrides", "needle"), [
    (["runtime.workers=2", "runtime.name=flower"], "applies to the embedded runtime"),
    (["runtime.workers=auto", "runtime.name=flower"], "applies to the embedded runtime"),
    (["runtime.workers=auto", "system.profile=mobile"], "where the simulated clock decides who trains"),
    (["runtime.workers=0"], "greater than or equal to 1"),
    (["runtime.worker_timeout_s=60"], "applies to worker processes"),
    (["runtime.workers=2", "system.profile=mobile"], "where the simulated clock decides who trains"),
    (["runtime.workers=2", "federation.asynchronous={rule: fedbuff}", "federation.num_clients=20"],
     "where the simulated clock decides who trains"),
])
def test_what_workers_cannot_do_is_refused_with_the_reason(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


ALLOCATOR_PROBE = """
import ctypes, sys
import torch
from fedpeft.runtime.workers import _return_large_frees

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
torch.ones(4 << 20)  # 16 MiB, mapped and freed: glibc raises its threshold for mapping a block to 16 MiB
if sys.argv[1] == "worker":
    _return_large_frees()
before = libc.mallinfo2().hblks
kept = torch.ones(512 << 10)  # 2 MiB
print(libc.mallinfo2().hblks - before)
"""


def _has_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc 2.33 or later (mallinfo2)")
def test_a_worker_maps_large_blocks_so_that_freeing_them_returns_the_memory():
    """Without _return_large_frees a 2 MiB tensor comes from the allocator's heap once a larger block was freed (and
    stays there when freed); a worker maps it (and unmaps it when freed)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    mapped = {who: subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE, who], capture_output=True, text=True,
                                  check=True, env=env).stdout.strip() for who in ("plain", "worker")}
    assert mapped == {"plain": "0", "worker": "1"}
