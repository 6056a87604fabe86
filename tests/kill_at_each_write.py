"""Driver of tests/test_run_files.py::test_a_kill_at_every_write_resumes_to_the_same_run (a script, run in a fresh
process: ``python kill_at_each_write.py OUT_DIR``).

It builds one tiny experiment, then forks every run from it (single-threaded torch, so forking is safe and every
run computes alike): an uninterrupted reference run (OUT_DIR/ref), then for every N one run (OUT_DIR/kill-N)
killed with SIGKILL just before its N-th write into the run directory and resumed as `fedpeft run --resume`
would. A write is an fsync, an os.replace or an os.rename of a path in the run directory: every file fedpeft
writes there goes through one of them (fedpeft.durable). Killed before an fsync, the file is also cut in half
first (for metrics.jsonl its last row), as a crash in the middle of the write would leave it. For every third N,
the resume itself is killed at one of its first writes and resumed again. OUT_DIR/report.json holds the number of
writes, the paths written and each child's exit status."""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

torch.set_num_threads(1)  # deterministic, and no thread pool to break in a forked child
sys.path.insert(0, str(Path(__file__).parent))
from helpers import tiny_config

from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.resume import resume_config
from fedpeft.runtime.setup import build_experiment

# the best adapter is saved after round 1 and replaced after round 2 (its loss improves), so the swap of an
# adapter directory is cut at each of its steps too
SETTINGS = ["federation.rounds=2", "task.max_train_examples=32", "eval.max_examples=16", "task.metric=loss",
            "train.lr=0.03", "eval.at_start=false"]


def cut_short(path: str) -> None:
    """What a crash in the middle of writing ``path`` leaves: half of it (of its last row, for metrics.jsonl, which
    is appended to). Atomic writes fsync a temporary file, so this must never show in a run's files."""
    if not os.path.isfile(path):
        return  # a directory's fsync
    with open(path, "rb+") as fh:
        data = fh.read()
        start = data.rstrip(b"\n").rfind(b"\n") + 1 if path.endswith("metrics.jsonl") else 0
        fh.truncate(start + (len(data) - start) // 2)


def kill_at_write(run_dir: Path, kill_at: int | None) -> Callable[[], int]:
    """Count the writes into ``run_dir`` from now on; SIGKILL this process before write number ``kill_at``.
    Returns what says (how many writes so far, the paths written)."""
    prefix = str(run_dir.resolve())
    count = 0
    seen: set[str] = set()
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def point(path: str, written: bool = False) -> None:
        nonlocal count
        if not path.startswith(prefix):
            return
        count += 1
        seen.add(os.path.relpath(path, prefix))
        if count == kill_at:
            if written:  # not yet on disk: the crash may cut it short
                cut_short(path)
            os.kill(os.getpid(), signal.SIGKILL)

    def fsync(fd: int) -> None:
        point(os.readlink(f"/proc/self/fd/{fd}"), written=True)
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs) -> None:
        point(os.path.abspath(dst))
        real_replace(src, dst, *args, **kwargs)

    def rename(src, dst, *args, **kwargs) -> None:
        point(os.path.abspath(dst))
        real_rename(src, dst, *args, **kwargs)

    os.fsync, os.replace, os.rename = fsync, replace, rename
    return lambda: (count, sorted(seen))


def in_child(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child; its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
        except BaseException:  # noqa: BLE001 (reported through the exit status)
            traceback.print_exc()
            code = 1
        os._exit(code)
    return os.waitpid(pid, 0)[1]


def main(out: Path) -> None:
    cfg = tiny_config(*SETTINGS)
    warm = build_experiment(cfg)  # a first run pays for what torch and the tokenizer set up once per process
    EmbeddedRuntime(cfg, out / "warm", experiment=warm).run()
    exp = build_experiment(cfg)  # untouched by any run: every child starts from it

    def start(run_dir: Path, kill_at: int | None = None) -> None:
        counter = kill_at_write(run_dir, kill_at)
        EmbeddedRuntime(cfg, run_dir, experiment=exp).run()
        count, paths = counter()
        (out / f"{run_dir.name}.writes").write_text(json.dumps({"count": count, "paths": paths}))

    def resume(run_dir: Path, kill_at: int | None = None) -> None:
        kill_at_write(run_dir, kill_at)
        try:
            saved = resume_config(run_dir)
        except FileNotFoundError:  # killed before config.yaml was in place: no run there yet, start it again
            EmbeddedRuntime(cfg, run_dir, experiment=exp).run()
            return
        try:
            runtime = EmbeddedRuntime(saved, run_dir, resume=True, experiment=exp)
        except FileExistsError as exc:  # killed after its summary was written: nothing left to do
            if "already finished" not in str(exc):
                raise
            return
        runtime.run()

    report: dict = {"ref": in_child(lambda: start(out / "ref")), "runs": {}}
    written = json.loads((out / "ref.writes").read_text())
    total = written["count"]
    report.update(writes=total, paths=written["paths"])
    for n in range(1, total + 1):
        run_dir = out / f"kill-{n}"
        statuses = [in_child(lambda: start(run_dir, n))]  # noqa: B023 (called at once)
        if n % 3 == 0:
            statuses.append(in_child(lambda: resume(run_dir, 1 + (n // 3) % 6)))  # noqa: B023
        statuses.append(in_child(lambda: resume(run_dir)))  # noqa: B023
        report["runs"][n] = statuses
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
