"""Checkpoints and `fedpeft run --resume`: a killed run continues and ends exactly like an uninterrupted one."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    assert_same_run,
    crash_at_round,
    crash_in_checkpoint,
    tiny_config,
)

from fedpeft import checkpoint
from fedpeft.cli import main as cli_main
from fedpeft.config import dump_config
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runtime.cohort import Cohort
from fedpeft.runtime.embedded import EmbeddedRuntime


def test_state_tree_round_trips_exactly(tmp_path):
    state = {"server": {"global_state": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "m": None,
                        "last_loss": {3: 0.5, 17: float("inf")}, "global_loss": float("nan")},
             "clients": {5: {"c": np.ones(2, dtype=np.float64), "steps": [1, 2], "flag": True, "name": "x"}}}
    checkpoint.save(tmp_path, 7, state)
    rnd, back = checkpoint.load(tmp_path)
    assert rnd == 7
    assert np.array_equal(back["server"]["global_state"]["w"], state["server"]["global_state"]["w"])
    assert back["server"]["last_loss"] == {3: 0.5, 17: float("inf")} and np.isnan(back["server"]["global_loss"])
    assert back["clients"][5]["c"].dtype == np.float64 and back["clients"][5]["steps"] == [1, 2]
    assert back["server"]["m"] is None and back["clients"][5]["flag"] is True


def test_damaged_or_missing_checkpoint_is_refused_and_never_loaded(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint.safetensors"):
        checkpoint.load(tmp_path)
    checkpoint.save(tmp_path, 2, {"x": np.zeros(1000, dtype=np.float32)})
    good = (tmp_path / checkpoint.FILENAME).read_bytes()
    # a writer killed mid-write leaves only its temporary file; the previous checkpoint is intact
    (tmp_path / f".{checkpoint.FILENAME}.999.tmp").write_bytes(good[: len(good) // 2])
    assert checkpoint.load(tmp_path)[0] == 2
    (tmp_path / checkpoint.FILENAME).write_bytes(good[: len(good) // 2])  # damaged by other means
    with pytest.raises(checkpoint.CheckpointError, match="damaged"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("algorithm", ["algorithm.name=fedavgm", "algorithm.name=fedadam",
                                       "runtime.clients_per_pass=2"])  # clients trained together, dropout on
@pytest.mark.needs_data
def test_resume_after_a_crash_ends_like_an_uninterrupted_run(algorithm, tmp_path, monkeypatch):
    cfg = tiny_config(algorithm, "federation.rounds=4", "peft.dropout=0.1", "eval.every=1")
    EmbeddedRuntime(cfg, tmp_path / "full").run()

    crashed = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_in_checkpoint(monkeypatch, 3)  # the round's metrics row is written, its checkpoint never is
    with pytest.raises(KeyboardInterrupt):
        crashed.run()
    monkeypatch.undo()
    assert [r["round"] for r in read_metrics(tmp_path / "cut")] == [0, 1, 2, 3]
    assert checkpoint.load(tmp_path / "cut")[0] == 2
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:  # and a row cut off mid-write by the crash
        f.write('{"round": 4, "train_lo')
    assert [r["round"] for r in read_metrics(tmp_path / "cut")] == [0, 1, 2, 3]

    resumed = EmbeddedRuntime.resume(tmp_path / "cut")
    assert resumed.start_round == 3
    resumed.run()
    assert_same_run(tmp_path / "full", tmp_path / "cut")
    assert "resumed" in (tmp_path / "cut" / "events.log").read_text()


@pytest.mark.needs_data
def test_a_resumed_run_keeps_the_clients_per_pass_auto_measured_and_the_out_of_memory_limit(tmp_path, monkeypatch):
    cfg = tiny_config("runtime.clients_per_pass=auto", "federation.rounds=3", "federation.clients_per_round=4",
                      "eval.every=1")
    monkeypatch.setattr(Cohort, "probe", lambda self, *a, **k: 4)
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    rt.transport.cohort.limit = 2  # as if a pass had run out of memory with 4
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    monkeypatch.undo()
    monkeypatch.setattr(Cohort, "probe", lambda self, *a, **k: pytest.fail("auto measured again after resuming"))
    resumed = EmbeddedRuntime.resume(tmp_path / "cut")
    assert (resumed.transport.cohort.chosen, resumed.transport.cohort.limit) == (4, 2)
    resumed.run()
    assert [r.get("clients_per_pass") for r in read_metrics(tmp_path / "cut")[1:]] == [2, 2, 2]


@pytest.mark.needs_data
def test_headprune_selection_state_survives_resume(tmp_path, monkeypatch):
    cfg = tiny_config("algorithm.name=headprune", "algorithm.selection=loss", "algorithm.sparsity=0.5",
                      "federation.rounds=5", "federation.num_clients=4", "eval.every=1")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_at_round(rt, monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    assert_same_run(tmp_path / "full", tmp_path / "cut")


@pytest.mark.needs_data
def test_cli_resume_after_sigkill(tmp_path):
    """A real `fedpeft run` process killed with SIGKILL after its second checkpoint, then resumed."""
    cfg = tiny_config("federation.rounds=12", "eval.every=3", "train.local_steps=4")
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    assert cli_main(["run", str(config), "--run-dir", str(tmp_path / "full"), "--no-progress"]) == 0

    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "fedpeft.cli", "run", str(config), "--run-dir", str(cut),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if checkpoint.load(cut)[0] >= 2:
                break
        except checkpoint.CheckpointError:
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = checkpoint.load(cut)[0]
    assert 2 <= done < 12 and not (cut / "summary.json").exists()
    assert cli_main(["run", "--resume", str(cut), "--no-progress"]) == 0
    assert_same_run(tmp_path / "full", cut)


@pytest.mark.needs_data
def test_resume_refuses_a_finished_run_and_extra_arguments(tmp_path, capsys):
    cfg = tiny_config("federation.rounds=1")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    assert cli_main(["run", "--resume", str(tmp_path / "run")]) == 2
    assert "already finished" in capsys.readouterr().err
    assert cli_main(["run", "x.yaml", "--resume", str(tmp_path / "run")]) == 2
    assert "give no config file" in capsys.readouterr().err


@pytest.mark.needs_data
def test_privacy_spent_carries_over_a_resume(tmp_path, monkeypatch):
    """DP noise is fresh entropy (not reproducible), but the accountant is checkpointed: a resumed run
    reports exactly the epsilon of an uninterrupted one, over every round."""
    cfg = tiny_config("algorithm.dp.noise_multiplier=0.8", "federation.rounds=4", "train.local_steps=1")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    real_round = rt.run_round
    monkeypatch.setattr(rt, "run_round", lambda rnd, w: (_ for _ in ()).throw(KeyboardInterrupt) if rnd == 3
                        else real_round(rnd, w))
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    full, cut = read_summary(tmp_path / "full"), read_summary(tmp_path / "cut")
    assert cut["dp_releases"] == full["dp_releases"] == 4
    assert cut["dp_epsilon"] == pytest.approx(full["dp_epsilon"], rel=1e-9)

