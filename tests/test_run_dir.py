"""The run directory: one writer at a time, nothing left by a refused run, restart in place, extension with more
rounds, the best round's adapter, and a clean stop on Ctrl-C (CLI-level, on tiny models and real data)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config, without_timings

from fedpeft.cli import main
from fedpeft.config import dump_config
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runlock import OWNER_FILE, RunDirectoryBusy, RunLock
from fedpeft.runtime.embedded import EmbeddedRuntime

HOLD_LOCK = """
import sys, time
from fedpeft.runlock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def write_config(path: Path, *overrides: str) -> Path:
    path.write_text(dump_config(tiny_config(*overrides)))
    return path


def adapter_digest(run_dir: Path, name: str = "adapter") -> str:
    return hashlib.sha256((run_dir / name / "adapter_model.safetensors").read_bytes()).hexdigest()


def hold_lock_in_other_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def stop_at_round(monkeypatch, rnd: int) -> None:
    """Every EmbeddedRuntime raises KeyboardInterrupt (Ctrl-C) when it reaches round ``rnd`` (pass a
    ``monkeypatch.context()``: undoing the test's own monkeypatch would also undo its working directory)."""
    real = EmbeddedRuntime.run_round

    def interrupted(self, r, wall_start):
        if r == rnd:
            raise KeyboardInterrupt
        return real(self, r, wall_start)

    monkeypatch.setattr(EmbeddedRuntime, "run_round", interrupted)


@pytest.mark.needs_data
def test_a_second_writer_is_refused_while_the_first_lives(tmp_path, capsys):
    cfg = write_config(tmp_path / "tiny.yaml")
    assert main(["run", str(cfg), "--run-dir", "run", "--no-progress"]) == 0
    assert main(["run", "--resume", "run", "--set", "federation.rounds=3", "--no-progress"]) == 0  # lock released
    holder = hold_lock_in_other_process(tmp_path / "run")
    try:
        capsys.readouterr()
        assert main(["run", "--resume", "run", "--set", "federation.rounds=4", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"is being written by process {holder.pid}" in err and len(err.strip().splitlines()) == 1
        assert read_summary("run")["rounds"] == 3  # nothing was touched
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_after_a_crash_is_taken_over_and_logged(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = hold_lock_in_other_process(run_dir)
    with pytest.raises(RunDirectoryBusy):
        RunLock.acquire(run_dir)
    holder.send_signal(signal.SIGKILL)  # dies without releasing: the owner file stays
    holder.wait()
    assert (run_dir / OWNER_FILE).is_file()
    with caplog.at_level("WARNING", logger="fedpeft"):
        lock = RunLock.acquire(run_dir)
    assert f"process {holder.pid}" in caplog.text and "ended without releasing" in caplog.text
    assert json.loads((run_dir / OWNER_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run_dir / OWNER_FILE).exists()


@pytest.mark.parametrize("bad", [
    "task.dataset=./no-such-folder",  # the data cannot be read
    "runtime.device=cuda",  # no GPU on the test machines (skipped where there is one)
])
def test_a_refused_run_leaves_no_directory(tmp_path, capsys, bad):
    if bad == "runtime.device=cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    cfg = write_config(tmp_path / "tiny.yaml")
    assert main(["run", str(cfg), "--set", bad, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_headprune_with_a_method_without_heads_fails_before_loading(tmp_path, capsys, monkeypatch):
    from fedpeft.models import registry

    def no_loading(*args, **kwargs):
        raise AssertionError("nothing may load before the config is refused")

    monkeypatch.setattr(registry, "load_tokenizer", no_loading)
    monkeypatch.setattr(registry, "load_model", no_loading)
    cfg = write_config(tmp_path / "tiny.yaml")
    assert main(["run", str(cfg), "--set", "algorithm.name=headprune", "--set", "peft={method: houlsby}"]) == 2
    err = capsys.readouterr().err
    assert "headprune" in err and "set peft.method to one of ia3, lora" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.needs_data
def test_ctrl_c_before_the_first_checkpoint_then_restart_in_place(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "tiny.yaml")
    with monkeypatch.context() as patched:
        stop_at_round(patched, 1)
        assert main(["run", str(cfg), "--run-dir", "run", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "interrupted; no checkpoint yet, so it restarts from round 1; continue with: fedpeft run --resume run" in err
    assert "Traceback" not in err
    assert [r["round"] for r in read_metrics("run")] == [0]  # the initial evaluation only
    assert main(["run", str(cfg), "--run-dir", "run"]) == 2  # a new run may not mix with it ...
    assert "--resume run" in capsys.readouterr().err
    assert main(["run", "--resume", "run", "--no-progress"]) == 0  # ... but it restarts in place
    assert main(["run", str(cfg), "--run-dir", "fresh", "--no-progress"]) == 0
    assert without_timings(read_metrics("run")) == without_timings(read_metrics("fresh"))
    assert adapter_digest(Path("run")) == adapter_digest(Path("fresh"))


@pytest.mark.needs_data
def test_ctrl_c_after_a_checkpoint_names_the_round_to_resume_from(tmp_path, capsys, monkeypatch):
    cfg = write_config(tmp_path / "tiny.yaml", "federation.rounds=3")
    with monkeypatch.context() as patched:
        stop_at_round(patched, 3)
        assert main(["run", str(cfg), "--run-dir", "run", "--no-progress"]) == 130
    assert "the last checkpoint is after round 2; continue with: fedpeft run --resume run" in capsys.readouterr().err
    assert main(["run", "--resume", "run", "--no-progress"]) == 0
    assert read_summary("run")["rounds"] == 3


@pytest.mark.needs_data
def test_a_finished_run_extended_equals_a_longer_run(tmp_path, capsys):
    cfg = write_config(tmp_path / "tiny.yaml")
    assert main(["run", str(cfg), "--run-dir", "short", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["run", "--resume", "short", "--no-progress"]) == 2  # finished: more rounds are needed
    assert "--set federation.rounds=" in capsys.readouterr().err
    assert main(["run", "--resume", "short", "--set", "train.lr=0.1"]) == 2  # only the rounds may change
    assert main(["run", "--resume", "short", "--set", "federation.rounds=3", "--no-progress"]) == 0
    assert main(["run", str(cfg), "--run-dir", "long", "--set", "federation.rounds=3", "--no-progress"]) == 0
    assert without_timings(read_metrics("short")) == without_timings(read_metrics("long"))
    assert adapter_digest(Path("short")) == adapter_digest(Path("long"))
    assert read_summary("short")["rounds"] == 3 and "rounds: 3" in (Path("short") / "config.yaml").read_text()


@pytest.mark.needs_data
def test_best_adapter_holds_the_best_round(tmp_path):
    cfg = tiny_config("federation.rounds=3", "train.lr=0.05", "eval.max_examples=64")
    summary = EmbeddedRuntime(cfg, "run").run()
    meta = json.loads((tmp_path / "run" / "best_adapter" / "fedpeft_adapter.json").read_text())
    assert meta["round"] == summary["best_round"] and meta["eval_accuracy"] == summary["best"]
    assert json.loads((tmp_path / "run" / "adapter" / "fedpeft_adapter.json").read_text())["round"] == 3
    assert summary["best_adapter"] == "best_adapter"
    no_best = EmbeddedRuntime(tiny_config("eval.save_best=false"), "plain").run()
    assert no_best["best_adapter"] is None and not (tmp_path / "plain" / "best_adapter").exists()


@pytest.mark.needs_data
def test_a_failing_constructor_releases_the_lock_and_the_log(tmp_path, monkeypatch):
    import logging

    from fedpeft import algorithms

    handlers = list(logging.getLogger("fedpeft").handlers)
    with monkeypatch.context() as patched:
        patched.setattr(algorithms, "make_server", lambda *a, **k: (_ for _ in ()).throw(ValueError("broken")))
        with pytest.raises(ValueError, match="broken"):
            EmbeddedRuntime(tiny_config(), "run")
    assert logging.getLogger("fedpeft").handlers == handlers  # no events.log handler left attached
    assert not (tmp_path / "run" / OWNER_FILE).exists()
    RunLock.acquire(tmp_path / "run").release()  # free, and no stale-lock warning to give


@pytest.mark.needs_data
def test_a_resume_forgets_a_best_adapter_saved_after_the_checkpoint(tmp_path, monkeypatch):
    cfg = write_config(tmp_path / "tiny.yaml", "runtime.checkpoint_every=1")
    with monkeypatch.context() as patched:
        stop_at_round(patched, 2)
        assert main(["run", str(cfg), "--run-dir", "run", "--no-progress"]) == 130
    meta_path = tmp_path / "run" / "best_adapter" / "fedpeft_adapter.json"
    meta = json.loads(meta_path.read_text())
    meta["round"] = 2  # as if round 2 had been evaluated and saved before the crash
    meta_path.write_text(json.dumps(meta))
    assert main(["run", "--resume", "run", "--no-progress"]) == 0
    summary = read_summary("run")
    # round 2 ran again and did not beat round 0 (the best, whose adapter was replaced), so no adapter is kept:
    # the summary says so rather than naming an adapter of a round that no longer exists
    assert summary["best_round"] == 0 and summary["best_adapter"] is None and not meta_path.exists()


@pytest.mark.parametrize("bad", ["model.name=no-such-org/no-such-model", "task.dataset=no_such_dataset"])
def test_an_unknown_name_is_refused_before_torch_is_imported(tmp_path, bad):
    cfg = write_config(tmp_path / "tiny.yaml")
    probe = ("import sys; from fedpeft.cli import main; "
             f"rc = main(['run', {str(cfg)!r}, '--set', {bad!r}]); "
             "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                         check=False)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1
