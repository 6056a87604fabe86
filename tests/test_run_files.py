"""Atomic and verified run files: a kill at any write resumes to the same run; a full or read-only disk gives one
line and leaves the resumable state as it was; a damaged checkpoint, config.yaml or adapter is refused with one
line naming the file; what killed writes left behind is removed when the run next opens its directory."""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import assert_same_run, tiny_config
from safetensors.numpy import load_file, save_file

import fedpeft
from fedpeft import checkpoint, wire
from fedpeft.adapters import AdapterError, load_adapter
from fedpeft.cli import main
from fedpeft.config import ConfigError, dump_config
from fedpeft.durable import RunFileError, atomic_write
from fedpeft.integrity import PLACEHOLDER, seal
from fedpeft.rundir import (
    RunWriter,
    config_digest_of,
    read_metrics,
    read_saved_config,
    remove_leftovers,
)
from fedpeft.runtime.resume import resume_config, resume_point

HERE = Path(__file__).parent


# -- helpers -----------------------------------------------------------------------------------------------------
def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def fail_fsync(monkeypatch, matches, err: int = errno.ENOSPC) -> list[str]:
    """Make os.fsync raise OSError(err) for the files whose path ``matches(path)`` says; returns the paths hit."""
    real, hit = os.fsync, []

    def fsync(fd: int) -> None:
        path = fd_path(fd)
        if matches(path):
            hit.append(path)
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return hit


def read_only(monkeypatch, folder: Path, err: int = errno.EROFS) -> None:
    """Every attempt to create, open for writing, rename or remove something under ``folder`` fails with ``err``,
    as on a read-only file system (the tests run as root, which chmod does not stop)."""
    prefix = str(folder.resolve())
    real_os_open, real_open, real_replace, real_rename = os.open, builtins.open, os.replace, os.rename

    def under(path) -> bool:
        return isinstance(path, (str, Path)) and os.path.abspath(path).startswith(prefix)

    def refuse(path) -> None:
        raise OSError(err, os.strerror(err), str(path))

    def os_open(path, flags, *args, **kwargs):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if under(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def moved(real):
        def move(src, dst, *args, **kwargs):
            if under(src) or under(dst):
                refuse(dst)
            return real(src, dst, *args, **kwargs)
        return move

    def removed(real):
        def remove(path, *args, **kwargs):  # a read-only mount refuses even a missing file's removal (EROFS)
            if under(path):
                refuse(path)
            return real(path, *args, **kwargs)
        return remove

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "replace", moved(real_replace))
    monkeypatch.setattr(os, "rename", moved(real_rename))
    monkeypatch.setattr(os, "unlink", removed(os.unlink))
    monkeypatch.setattr(os, "remove", removed(os.remove))


def one_error_line(err: str) -> str:
    """The only ``error:`` line of a command's stderr (and no traceback)."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def tree_digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob(".*")
                  if p.name not in (".fedpeft.lock", ".fedpeft.owner.json"))


def assert_same_run_and_adapters(a: Path, b: Path) -> None:
    """The same metrics, summary and final state (helpers.assert_same_run), and byte-identical adapters."""
    assert_same_run(a, b)
    for adapter in ("adapter", "best_adapter"):
        assert (a / adapter).is_dir() == (b / adapter).is_dir()
        if (a / adapter).is_dir():
            assert tree_digest(a / adapter) == tree_digest(b / adapter), adapter


def write_config(path: Path, *overrides: str) -> Path:
    path.write_text(dump_config(tiny_config(*overrides)))
    return path


# -- atomic writes, a full disk, a read-only directory -------------------------------------------------------------
def test_a_full_disk_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("old")
    fail_fsync(monkeypatch, lambda p: p.endswith(".tmp"))
    with pytest.raises(RunFileError) as refused:
        atomic_write(target, b"x" * 5000, then="continue with: fedpeft run --resume run")
    message = str(refused.value)
    assert message.startswith(f"cannot write {target}: no space left on the disk (4.9 KiB needed, ")
    assert " free); free space there, then continue with: fedpeft run --resume run" in message
    assert "\n" not in message and isinstance(refused.value, fedpeft.UserError)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("err,what", [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_a_read_only_directory_is_one_line(tmp_path, monkeypatch, err, what):
    target = tmp_path / "partition.json"
    target.write_text("old")
    read_only(monkeypatch, tmp_path, err)
    with pytest.raises(RunFileError, match=f"^{re.escape(f'cannot write {target}: {what}; make {tmp_path} writable')}"):
        atomic_write(target, b"new")
    monkeypatch.undo()
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["partition.json"]


def test_a_full_disk_reported_by_safetensors_is_one_line_too(tmp_path):
    """safetensors (Rust) writes adapters and checkpoints' tensors; it reports the system's error in its text."""
    from safetensors import SafetensorError

    from fedpeft.durable import is_refused_write, refused_write

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert is_refused_write(full) and not is_refused_write(SafetensorError("Error while deserializing header"))
    message = str(refused_write(tmp_path / "adapter", full, needed=3 * 2**20, then="continue"))
    assert message.startswith(f"cannot write {tmp_path / 'adapter'}: no space left on the disk (3.0 MiB needed, ")


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    from fedpeft.rundir import new_run_dir

    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(RunFileError, match=re.escape(f"cannot write {tmp_path / 'ro' / 'run'}: read-only file system")
                       + ".*then start the run again"):
        new_run_dir(tiny_config(), tmp_path / "ro" / "run")


def test_a_metrics_row_the_disk_refuses_is_cut_back(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path, tiny_config())
    try:
        writer.row({"round": 0, "eval_accuracy": 0.5})
        with monkeypatch.context() as patched:
            fail_fsync(patched, lambda p: p.endswith("metrics.jsonl"))
            with pytest.raises(RunFileError, match=r"metrics.jsonl: no space left on the disk \(\d+ bytes needed.*"
                                                   + re.escape(f"then continue with: fedpeft run --resume {tmp_path}")):
                writer.row({"round": 1, "eval_accuracy": 0.75})
        assert (tmp_path / "metrics.jsonl").read_text() == '{"round": 0, "eval_accuracy": 0.5}\n'
        writer.row({"round": 1, "eval_accuracy": 0.75})  # once there is space, the next row follows on its line
    finally:
        writer.close()
    assert [r["round"] for r in read_metrics(tmp_path)] == [0, 1]


def test_config_yaml_is_rewritten_whole_or_not_at_all(tmp_path, monkeypatch):
    RunWriter(tmp_path, tiny_config("train.lr=0.002")).close()
    before = (tmp_path / "config.yaml").read_bytes()
    with monkeypatch.context() as patched:
        fail_fsync(patched, lambda p: "config.yaml" in p)
        with pytest.raises(RunFileError, match="config.yaml: no space left"):
            RunWriter(tmp_path, tiny_config("train.lr=0.002", "federation.rounds=5"))
    assert (tmp_path / "config.yaml").read_bytes() == before and leftovers(tmp_path) == []
    assert resume_config(tmp_path).train.lr == 0.002


# -- checkpoints ---------------------------------------------------------------------------------------------------
def small_state() -> dict:
    return {"server": {"global_state": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                       "last_loss": {3: 0.5, 17: float("inf")}, "steps": np.array([1, 2], dtype=np.int64)},
            "clients": {1: {"c": np.full(3, 0.25)}}}


def test_a_flipped_bit_anywhere_in_a_checkpoint_is_refused(tmp_path):
    checkpoint.save(tmp_path, 4, small_state())
    path = tmp_path / checkpoint.FILENAME
    good = path.read_bytes()
    assert checkpoint.load(tmp_path)[0] == 4
    for at in range(len(good)):  # one bit in every byte: the header's length, its JSON, the seal, the tensors
        damaged = bytearray(good)
        damaged[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(checkpoint.CheckpointError, match=f"^{re.escape(str(path))} ") as refused:
            checkpoint.load(tmp_path)
        assert "\n" not in str(refused.value)
    path.write_bytes(good)
    assert checkpoint.load(tmp_path)[0] == 4


def sealed_payload(arrays: dict, meta: dict) -> bytes:
    data = wire.encode(wire.Payload(arrays, {"sha256": PLACEHOLDER, **meta}))
    return seal(data, 8, 8 + int.from_bytes(data[:8], "little"))


def test_nan_or_inf_in_a_checkpoint_is_refused_unless_it_was_saved_so(tmp_path, caplog):
    state = {"server": {"v": np.array([1.0, np.inf], dtype=np.float32)}}
    with caplog.at_level("WARNING", logger="fedpeft"):
        checkpoint.save(tmp_path, 1, state)  # e.g. FedAdam's second moment overflowing: kept, and said
    assert "NaN or infinite values (/server/v)" in caplog.text
    assert np.isinf(checkpoint.load(tmp_path)[1]["server"]["v"][1])
    arrays, tree = checkpoint.pack_state({"server": {"w": np.array([0.5, np.nan], dtype=np.float32)}})
    meta = {"format": checkpoint.SEALED_FORMAT, "round": 1, "nonfinite": [], "state": tree}
    (tmp_path / checkpoint.FILENAME).write_bytes(sealed_payload(arrays, meta))  # a NaN it was not saved with
    with pytest.raises(checkpoint.CheckpointError, match="holds NaN or infinite values in '/server/w'"):
        checkpoint.load(tmp_path)


def test_a_checkpoint_without_its_seal_loads_only_when_allowed(tmp_path, caplog):
    """Format 1 (before the seal), or a sealed checkpoint stripped of it: refused unless the reader opts in."""
    arrays, tree = checkpoint.pack_state(small_state())
    old = wire.encode(wire.Payload(arrays, {"format": 1, "round": 3, "state": tree}))
    (tmp_path / checkpoint.FILENAME).write_bytes(old)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / checkpoint.FILENAME} carries no SHA-256 seal")
    assert "--allow-unsealed" in str(refused.value) and "\n" not in str(refused.value)
    with caplog.at_level("WARNING", logger="fedpeft"):
        assert checkpoint.load(tmp_path, allow_unsealed=True)[0] == 3
    assert "carries no checksum (allowed by allow_unsealed)" in caplog.text
    arrays["/server/global_state/0"] = np.array([np.nan] * 6, dtype=np.float32).reshape(2, 3)
    (tmp_path / checkpoint.FILENAME).write_bytes(wire.encode(wire.Payload(arrays, {"format": 1, "round": 3,
                                                                                   "state": tree})))
    with pytest.raises(checkpoint.CheckpointError, match="NaN or infinite"):
        checkpoint.load(tmp_path, allow_unsealed=True)


def test_a_stripped_checkpoint_is_refused_and_sealed_again_on_request(tmp_path):
    checkpoint.save(tmp_path, 2, small_state())
    payload = wire.decode((tmp_path / checkpoint.FILENAME).read_bytes())
    stripped = {k: v for k, v in payload.meta.items() if k not in ("sha256", "nonfinite")}
    (tmp_path / checkpoint.FILENAME).write_bytes(wire.encode(wire.Payload(payload.arrays, {**stripped, "format": 1})))
    with pytest.raises(checkpoint.CheckpointError, match="carries no SHA-256 seal"):
        checkpoint.load(tmp_path)
    assert checkpoint.seal_older(tmp_path) and not checkpoint.seal_older(tmp_path)  # sealed once
    rnd, state = checkpoint.load(tmp_path)
    assert rnd == 2 and np.array_equal(state["server"]["global_state"]["w"],
                                       small_state()["server"]["global_state"]["w"])


def test_the_seal_misses_no_bit_of_the_header(tmp_path):
    """'e' and 'E' differ by one bit and read as the same JSON number: the seal covers bytes, not meanings."""
    checkpoint.save(tmp_path, 1, {"x": 1e-05})
    data = (tmp_path / checkpoint.FILENAME).read_bytes()
    at = data.index(b"1e-05")
    (tmp_path / checkpoint.FILENAME).write_bytes(data[:at] + b"1E-05" + data[at + 5:])
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256 does not match"):
        checkpoint.load(tmp_path)


# -- the saved config ------------------------------------------------------------------------------------------------
@pytest.fixture
def saved_run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    RunWriter(run, tiny_config("train.lr=0.001")).close()
    return run


def test_a_saved_config_cut_at_any_point_is_refused(saved_run):
    path = saved_run / "config.yaml"
    text = path.read_bytes()
    cuts = [i + 1 for i, c in enumerate(text) if c == ord("\n")][:-1]  # every line boundary but the end
    cuts += [len(text) // 2, 30, 5]  # mid-line, inside the checksum line
    for cut in cuts:
        path.write_bytes(text[:cut])
        with pytest.raises(ConfigError) as refused:
            read_saved_config(saved_run)
        assert str(refused.value).startswith(f"{path} ") and "\n" not in str(refused.value)
        assert "fedpeft config CONFIG [--set ...] >" in str(refused.value)
    path.write_bytes(text)
    assert resume_config(saved_run).train.lr == 0.001


@pytest.mark.parametrize("damage,says", [
    (lambda text: b"", "is empty: the run's saved config is lost"),
    (lambda text: b"\n\n", "is empty"),
    (lambda text: text[: len(text) // 2], "does not match the checksum on its first line"),
    (lambda text: text.replace(b"lr: 0.001", b"lr: 0.003"), "does not match the checksum"),  # one bit
    (lambda text: text.split(b"\n", 1)[1], "carries no SHA-256 seal (no # sha256 first line)"),  # stripped
    # unsealed files, read with --allow-unsealed: the other checks still hold
    (lambda text: text.split(b"\n", 1)[1].replace(b"  lr: 0.001", b" lr: [0.001"), "not valid YAML"),
    (lambda text: b"# just a comment\n", "holds no settings"),
])
def test_a_damaged_saved_config_is_refused_on_resume_in_one_line(saved_run, capsys, damage, says):
    path = saved_run / "config.yaml"
    path.write_bytes(damage(path.read_bytes()))
    opt_in = ["--allow-unsealed"] if says in ("not valid YAML", "holds no settings") else []
    assert main(["run", "--resume", str(saved_run), "--no-progress", *opt_in]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(path) in line and says in line


def test_a_config_without_checksum_is_used_only_when_allowed_and_whole(saved_run, caplog, capsys):
    """A config.yaml from an older fedpeft, or written again with `fedpeft config`, has no checksum line: refused
    unless the reader opts in; a resume that does seals it in place, once."""
    path = saved_run / "config.yaml"
    path.write_text(dump_config(tiny_config("train.lr=0.001")).replace("train:", "trainn:"))
    with pytest.raises(ConfigError, match="carries no SHA-256 seal"):
        read_saved_config(saved_run)
    with pytest.raises(ConfigError, match="lacks train"):  # opting in does not let a cut-short file through
        read_saved_config(saved_run, allow_unsealed=True)
    path.write_text(dump_config(tiny_config("train.lr=0.001")))
    with caplog.at_level("WARNING", logger="fedpeft"):
        assert read_saved_config(saved_run, allow_unsealed=True)["train"]["lr"] == 0.001
    assert "has no checksum (allowed by allow_unsealed)" in caplog.text
    assert main(["run", "--resume", str(saved_run), "--no-progress"]) == 2
    assert "--allow-unsealed" in one_error_line(capsys.readouterr().err)
    assert resume_config(saved_run, allow_unsealed=True).train.lr == 0.001
    assert path.read_text().startswith("# sha256 ") and read_saved_config(saved_run)["train"]["lr"] == 0.001


def test_a_resume_refuses_a_config_that_changed_since_the_checkpoint(saved_run):
    cfg = tiny_config("train.lr=0.001")
    (saved_run / "metrics.jsonl").write_text('{"round": 1}\n')
    checkpoint.save(saved_run, 1, {"config_sha256": config_digest_of(cfg)})
    assert resume_point(saved_run, 5)[0][0] == 1  # more rounds: the one change a resume takes
    (saved_run / "config.yaml").write_text(dump_config(tiny_config("train.lr=0.001", "federation.rounds=9")))
    assert resume_point(saved_run, 9)[0][0] == 1  # written again by hand, as it was: accepted
    (saved_run / "config.yaml").write_text(dump_config(tiny_config("train.lr=0.003")))  # ... or not
    with pytest.raises(ConfigError, match="config.yaml differs from the config the checkpoint of round 1 was saved "
                                          "with"):
        resume_point(saved_run, 2)


def test_a_resume_refuses_metrics_that_lost_checkpointed_rounds(saved_run):
    (saved_run / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1}\n{"round": 3}\n')
    checkpoint.save(saved_run, 3, {})
    with pytest.raises(checkpoint.CheckpointError, match=r"metrics.jsonl lacks the rows of round\(s\) 2, which the "
                                                         "checkpoint of round 3 follows: the file was damaged"):
        resume_point(saved_run, 5)
    (saved_run / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n{"round": 4, "cut')
    assert [r["round"] for r in resume_point(saved_run, 5)[1]] == [1, 2, 3]


# -- leftovers -------------------------------------------------------------------------------------------------------
def test_events_log_drops_only_the_lines_a_full_or_read_only_disk_refuses(tmp_path, capsys):
    """A line the disk refuses is dropped quietly (the next run file written fails with the one-line reason);
    any other failure of the handler is logging's usual report on stderr."""
    import errno
    import logging

    from fedpeft.rundir import _EventsLog

    handler = _EventsLog(tmp_path / "events.log", encoding="utf-8")
    record = logging.LogRecord("fedpeft", logging.WARNING, __file__, 0, "a line", None, None)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            handler.handleError(record)
        assert capsys.readouterr().err == ""
        try:
            raise TypeError("not all arguments converted during string formatting")
        except TypeError:
            handler.handleError(record)
        assert "TypeError: not all arguments converted" in capsys.readouterr().err
    finally:
        handler.close()


def test_a_temporary_file_of_a_running_fedpeft_eval_is_left_alone(tmp_path):
    """plots/ and eval/ are written without the run's lock (fedpeft eval): a temporary file there whose writer
    still runs is a write in progress, not a leftover."""
    import os

    (tmp_path / "eval").mkdir()
    live = tmp_path / "eval" / f".adapter-x.jsonl.{os.getppid()}.tmp"
    live.write_bytes(b"being written")
    assert remove_leftovers(tmp_path) == [] and live.is_file()


def test_leftovers_are_removed_and_a_cut_off_adapter_swap_is_undone(tmp_path):
    for name in (".checkpoint.safetensors.4242.tmp", "plots/.loss_vs_round.png.4194305.tmp",
                 "eval/.adapter-x.jsonl.4194306.tmp"):  # writers gone (above Linux's largest pid_max, 2**22)
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / "checkpoint.safetensors").write_bytes(b"kept")
    (tmp_path / "adapter").mkdir()  # a finished swap: the old one was not removed yet
    (tmp_path / ".adapter.old").mkdir()
    (tmp_path / ".adapter.new").mkdir()
    (tmp_path / ".best_adapter.old").mkdir()  # cut between its two renames: put back
    (tmp_path / ".best_adapter.old" / "fedpeft_adapter.json").write_text("{}")
    (tmp_path / ".best_adapter.new").mkdir()
    (tmp_path / ".notes.txt.12.tmp").write_text("not the run's")  # a run directory may hold other things
    (tmp_path / ".cache.old").mkdir()
    clients = tmp_path / "client_adapters"  # eval.save_client_adapters: one directory per client, swapped alike
    (clients / ".3.old").mkdir(parents=True)  # cut between its two renames: put back
    (clients / ".3.old" / "fedpeft_adapter.json").write_text("{}")
    (clients / ".4.new").mkdir()
    (clients / ".x.new").mkdir()  # not a client's
    done = remove_leftovers(tmp_path)
    assert len(done) == 9 and any("put .best_adapter.old back as best_adapter" in line for line in done)
    assert any("put .3.old back as 3" in line for line in done)
    assert leftovers(tmp_path) == [".cache.old", ".notes.txt.12.tmp", "client_adapters/.x.new"]
    assert sorted(p.name for p in clients.iterdir()) == [".x.new", "3"]
    assert (tmp_path / "best_adapter" / "fedpeft_adapter.json").is_file()
    assert (tmp_path / "checkpoint.safetensors").read_bytes() == b"kept"


# -- runs: tiny-bert on SST-2 ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """A 3-round run (and its config file) that the runs cut short below must end like."""
    root = tmp_path_factory.mktemp("reference")
    config = write_config(root / "tiny.yaml", "federation.rounds=3")
    assert main(["run", str(config), "--run-dir", str(root / "run"), "--no-progress"]) == 0
    return config, root / "run"


@pytest.mark.needs_data
@pytest.mark.parametrize("refused", ["checkpoint", "adapter"])
def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_to_the_same_result(reference, tmp_path, monkeypatch,
                                                                                  capsys, refused):
    config, full = reference
    run = tmp_path / "run"
    if refused == "checkpoint":  # the second checkpoint (after round 2)
        written: list[str] = []
        real = os.fsync

        def counting(fd: int) -> None:
            if ".checkpoint.safetensors." in fd_path(fd):
                written.append(fd_path(fd))
                if len(written) == 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd)

        with monkeypatch.context() as patched:
            patched.setattr(os, "fsync", counting)
            assert main(["run", str(config), "--run-dir", str(run), "--no-progress"]) == 2
        target, done = run / "checkpoint.safetensors", 1
    else:  # the last round's adapter, written when the run ends
        with monkeypatch.context() as patched:
            fail_fsync(patched, lambda p: "/.adapter.new/" in p)
            assert main(["run", str(config), "--run-dir", str(run), "--no-progress"]) == 2
        target, done = run / "adapter", 3
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot write {target}: no space left on the disk (")
    assert " needed, " in line and " free); free space there, then continue with: fedpeft run --resume " in line
    assert checkpoint.load(run)[0] == done and leftovers(run) == [] and not (run / "adapter").exists()
    assert not (run / "summary.json").exists()
    assert main(["run", "--resume", str(run), "--no-progress"]) == 0
    assert_same_run_and_adapters(full, run)


@pytest.mark.needs_data
def test_a_read_only_run_directory_is_refused_in_one_line_and_left_as_it_was(reference, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference[1], run)
    before = tree_digest(run)
    capsys.readouterr()
    with monkeypatch.context() as patched:
        read_only(patched, run)
        assert main(["run", "--resume", str(run), "--set", "federation.rounds=4", "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"error: cannot write {run}/.fedpeft.lock: read-only file system; make {run} writable (or move the "
                    "run to a writable disk), then try again")
    assert tree_digest(run) == before


@pytest.mark.needs_data
def test_leftovers_of_a_killed_run_are_removed_when_it_resumes_and_logged(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[1], run)
    (run / ".checkpoint.safetensors.99999.tmp").write_bytes(b"cut off")
    (run / ".adapter.new").mkdir()
    (run / "plots").mkdir(exist_ok=True)
    (run / "plots" / ".accuracy_vs_round.png.99999.tmp").write_bytes(b"cut off")
    assert main(["run", "--resume", str(run), "--set", "federation.rounds=4", "--no-progress"]) == 0
    assert leftovers(run) == []
    events = (run / "events.log").read_text()
    assert "removed the temporary file" in events and ".checkpoint.safetensors.99999.tmp (7 bytes)" in events
    assert "removed " + str(run / ".adapter.new") in events


@pytest.mark.slow
@pytest.mark.needs_data
def test_a_kill_at_every_write_resumes_to_the_same_run(tmp_path):
    """The probe: SIGKILL just before each write into the run directory (every fsync and rename: a temporary
    file, its rename, a metrics row, each file of an adapter and each step of its swap, the checkpoint, the
    summary), then a resume (itself killed once more at one of its first writes for every third cut): every
    run ends with the metrics, summary, final global state and adapters of the uninterrupted run, and no
    temporary file left."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fedpeft.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "kill_at_each_write.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ref"] == 0 and report["writes"] >= 40, report  # the run writes that often (2 rounds)
    reference = tmp_path / "ref"
    durable = {re.sub(r"^\.(.+)\.new(/|$)", r"\1\2", re.sub(r"(^|/)\.([^/]+)\.\d+\.tmp$", r"\1\2", p))
               for p in report["paths"]}
    unwatched = [p for p in tree_digest(reference) if p not in durable | {".fedpeft.lock", "events.log"}]
    assert not unwatched, f"written without fsync or rename, so no kill was tried there: {unwatched}"
    for n, statuses in report["runs"].items():
        killed, *middle, resumed = statuses
        assert os.WIFSIGNALED(killed) and os.WTERMSIG(killed) == signal.SIGKILL, (n, statuses)
        assert all(s == 0 or os.WTERMSIG(s) == signal.SIGKILL for s in middle), (n, statuses)
        assert resumed == 0, (n, statuses, done.stderr[-3000:])
        run = tmp_path / f"kill-{n}"
        assert leftovers(run) == [], n
        assert_same_run_and_adapters(reference, run)


# -- tampered adapters -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tamper")
    config = write_config(root / "tiny.yaml", "federation.rounds=1", "eval.save_best=false")
    for method in ("lora", "houlsby"):
        assert main(["run", str(config), "--run-dir", str(root / method), "--set", f"peft={{method: {method}}}",
                     "--no-progress"]) == 0
    return root


def without_checksums(adapter: Path) -> None:
    """As an adapter saved before fedpeft recorded checksums: the other checks must still catch the damage."""
    meta = json.loads((adapter / "fedpeft_adapter.json").read_text())
    del meta["sha256"], meta["files"]
    (adapter / "fedpeft_adapter.json").write_text(json.dumps(meta, indent=2))


def rewrite_tensors(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def flip_a_bit(path: Path, at: float = 0.9) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def first_key(path: Path, part: str) -> str:
    return next(k for k in load_file(str(path)) if part in k)


def drop_lora_b(path: Path) -> None:
    rewrite_tensors(path, lambda t: t.pop(first_key(path, "lora_B")))


def nan_in_lora_a(path: Path) -> None:
    rewrite_tensors(path, lambda t: t[first_key(path, "lora_A")].__setitem__((0, 0), np.nan))


def resized_lora_a(path: Path) -> None:
    rewrite_tensors(path, lambda t: t.__setitem__(first_key(path, "lora_A"), np.zeros((3, 3), np.float32)))


def an_extra_tensor(path: Path) -> None:
    rewrite_tensors(path, lambda t: t.__setitem__("base_model.model.extra.lora_A.weight", np.zeros(2, np.float32)))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


PEFT_FILE, STATE_FILE, META = "adapter_model.safetensors", "fedpeft_adapter.safetensors", "fedpeft_adapter.json"
CASES = {  # name: (run, file, damage, with the checksums kept?, what the error says)
    "bit flip": ("lora", PEFT_FILE, flip_a_bit, True, "does not match the SHA-256 recorded in fedpeft_adapter.json"),
    "lora_B removed": ("lora", PEFT_FILE, drop_lora_b, True, "does not match the SHA-256"),
    "lora_B removed, old": ("lora", PEFT_FILE, drop_lora_b, False, "lacks 1 of the adapter's"),
    "NaN": ("lora", PEFT_FILE, nan_in_lora_a, True, "does not match the SHA-256"),
    "NaN, old": ("lora", PEFT_FILE, nan_in_lora_a, False, "holds NaN or infinite values"),
    "size mismatch, old": ("lora", PEFT_FILE, resized_lora_a, False, "size mismatch for"),
    "extra tensor, old": ("lora", PEFT_FILE, an_extra_tensor, False, "this adapter's model does not have"),
    "truncated": ("lora", PEFT_FILE, truncate, True, "does not match the SHA-256"),
    "truncated, old": ("lora", PEFT_FILE, truncate, False, "is not a readable safetensors file"),
    "weights deleted": ("lora", PEFT_FILE, Path.unlink, True, "adapter_model.safetensors is missing"),
    "weights deleted, old": ("lora", PEFT_FILE, Path.unlink, False, "adapter_model.safetensors is missing"),
    "peft config damaged, old": ("lora", "adapter_config.json", truncate, False, "is not valid JSON"),
    "json cut": ("lora", META, lambda p: p.write_bytes(p.read_bytes()[:-40]), True, "is not valid JSON"),
    "json value changed": ("lora", META, lambda p: p.write_text(p.read_text().replace('"round": 1', '"round": 3')),
                           True, "fedpeft_adapter.json does not match its SHA-256"),
    "state bit flip": ("houlsby", STATE_FILE, flip_a_bit, True, "does not match the SHA-256"),
    "state NaN, old": ("houlsby", STATE_FILE, lambda p: rewrite_tensors(p, lambda t: next(iter(t.values())).fill(
        np.inf)), False, "holds NaN or infinite values"),
    "state tensor removed, old": ("houlsby", STATE_FILE, lambda p: rewrite_tensors(p, lambda t: t.popitem()), False,
                                  "does not fit houlsby on tiny-bert (missing parameter"),
    "state weights deleted": ("houlsby", STATE_FILE, Path.unlink, True, "fedpeft_adapter.safetensors is missing"),
}


@pytest.mark.needs_data
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tampered_adapter_is_refused_by_load_adapter_and_fedpeft_eval(adapter_runs, tmp_path, capsys, case):
    method, name, damage, checksums, says = CASES[case]
    run = tmp_path / "run"
    shutil.copytree(adapter_runs / method, run)
    adapter = run / "adapter"
    if not checksums:
        without_checksums(adapter)
    damage(adapter / name)
    with pytest.raises(AdapterError) as refused:
        load_adapter(adapter, allow_unsealed=not checksums)
    message = str(refused.value)
    assert says in message and str(adapter) in message and "\n" not in message
    assert message.endswith(f"the adapter in {adapter} cannot be used: restore the directory from a copy, or use the "
                            "run's other adapter (fedpeft eval --adapter best|last)")
    capsys.readouterr()
    opt_in = [] if checksums else ["--allow-unsealed"]
    assert main(["eval", str(run), "--adapter", "last", "--max-examples", "8", *opt_in]) == 2
    assert says in one_error_line(capsys.readouterr().err)


@pytest.mark.needs_data
def test_an_untouched_adapter_loads_with_peft_and_fedpeft(adapter_runs, capsys):
    from peft import PeftModel

    from fedpeft.models import registry

    adapter = adapter_runs / "lora" / "adapter"
    meta = json.loads((adapter / META).read_text())
    assert meta["sha256"] != PLACEHOLDER and set(meta["files"]) >= {PEFT_FILE, "adapter_config.json"}
    base = registry.load_model("tiny-bert", "classification", num_labels=2)
    assert isinstance(PeftModel.from_pretrained(base, str(adapter)), PeftModel)  # the json's keys do not bother it
    assert load_adapter(adapter).meta["round"] == 1
    assert main(["eval", str(adapter_runs / "lora"), "--adapter", "last", "--max-examples", "8"]) == 0
    predictions = adapter_runs / "lora" / "eval" / "adapter-validation.jsonl"
    assert len(predictions.read_text().splitlines()) == 8 and leftovers(predictions.parent) == []


def test_yaml_module_reads_the_sealed_config(saved_run):
    """config.yaml's checksum is a comment: any YAML reader (plots, reports, a user's script) reads it as before."""
    raw = yaml.safe_load((saved_run / "config.yaml").read_text())
    assert raw["train"]["lr"] == 0.001 and raw["federation"]["rounds"] == 2
