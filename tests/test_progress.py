"""Progress inside a round (clients done, local steps), on the bar and in events.log; what a run tells a newcomer:
the number clients_per_pass auto measured, a model that predicts one class, the rows behind a personalized score,
library warnings kept off the console."""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np
from helpers import tiny_config
from tqdm import tqdm

from fedpeft.cli import end_of_run_line, main
from fedpeft.metrics.accounting import summarize
from fedpeft.metrics.scores import accuracy_interval, one_class, one_class_advice
from fedpeft.rundir import RunWriter
from fedpeft.runtime import progress
from fedpeft.runtime.embedded import EmbeddedRuntime


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_round_progress_counts_clients_and_throttles_step_lines():
    notes: list[str] = []
    clock = Clock()
    bar = tqdm(total=3, file=io.StringIO(), mininterval=0)
    p = progress.RoundProgress(3, notes.append, bar, clock=clock)
    p.round_started(2, [4, 7, 9])
    assert "0/3 clients" in str(bar)
    p.clients_training([4])
    for step in range(1, 5):
        clock.now += 25.0  # a slow local step: a line once a minute, not every step
        p.step(step, 10)
    assert notes == ["round 2/3: client 4 at local step 3 of 10 (75 s)"]
    assert "client 4 step 4/10" in str(bar)
    p.clients_done([4])
    p.clients_training([7, 9])
    p.clients_done([7, 9])
    assert notes[1:] == ["round 2/3: 1 of 3 clients done (client 4)", "round 2/3: 3 of 3 clients done (clients 7, 9)"]
    p.round_ended({"loss": "0.412", "accuracy": "0.8000"})
    assert notes[-1] == "round 2/3 done: loss 0.412, accuracy 0.8000"
    assert bar.n == 1 and "loss 0.412, accuracy 0.8000" in str(bar)


def test_follow_draws_the_flower_servers_progress_lines(tmp_path):
    """The launcher's bar follows the ServerApp's log lines as flwr run --stream appends them."""
    log_file = tmp_path / "flwr-run.log"
    log_file.write_text("an older run's line: round 9/9 done\n")
    bar = tqdm(total=3, file=io.StringIO(), mininterval=0)
    printed: list[str] = []
    follower = progress.FileFollower(log_file, bar, poll_s=0.01, write=printed.append)
    follower.start()
    with open(log_file, "a") as fh:
        fh.write("INFO fedpeft: round 1/3: 1 of 2 clients done (client 0)\n")
        fh.write("WARNING fedpeft: round 1: update of client 1 rejected: no reply\n")
        fh.write("INFO fedpeft: round 1/3 done: loss 0.700, MiB 0.1\nINFO fedpeft: round 2/3: 1 of 2 cli")
        fh.flush()
        follower.stop()
    assert bar.n == 1 and "loss 0.700, MiB 0.1" in str(bar)
    assert printed == ["WARNING fedpeft: round 1: update of client 1 rejected: no reply"]  # as embedded prints it
    with open(log_file, "a") as fh:
        fh.write("ents done (client 3)\n")
    follower.read()
    assert "loss 0.700, MiB 0.1, round 2: 1/2 clients" in str(bar)  # the last round's figures stay


def test_a_resumed_flower_runs_bar_starts_at_its_round_and_no_client_is_counted_twice():
    bar = tqdm(total=10, file=io.StringIO(), mininterval=0)
    progress.Follower(bar, print)(["INFO fedpeft: round 5/10: 1 of 3 clients done (client 2)"])
    assert bar.n == 4
    notes: list[str] = []
    p = progress.RoundProgress(10, notes.append)
    p.round_started(5, [1, 2, 3])
    p.clients_done([2])
    p.clients_done([1, 2, 3])  # the round stops waiting: 1 and 3 timed out, 2 was counted when it replied
    assert notes == ["round 5/10: 1 of 3 clients done (client 2)", "round 5/10: 3 of 3 clients done (clients 1, 3)"]


def test_a_run_writes_its_progress_and_what_auto_measured(tmp_path, monkeypatch, capsys):
    cfg = tiny_config("runtime.clients_per_pass=auto", "federation.clients_per_round=3", "runtime.progress=true")
    steps: list[tuple[int, int]] = []
    real = progress.RoundProgress.step

    def step(self, done, total):
        steps.append((done, total))
        real(self, done, total)

    monkeypatch.setattr(progress.RoundProgress, "step", step)
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    rt.run()
    events = (tmp_path / "run" / "events.log").read_text()
    assert "runtime.clients_per_pass auto measured" in events
    for rnd in (1, 2):
        assert f"round {rnd}/2: 3 of 3 clients done" in events and f"round {rnd}/2 done: loss" in events
    assert steps and all(0 < done <= total for done, total in steps)
    assert rt.exp.trainer.on_step is None  # the hook does not outlive the run
    bar = capsys.readouterr().err  # the bar, drawn on stderr
    assert "round 2: 0/3 clients" in bar and "round 2: 3/3 clients" in bar and "2/2" in bar


def test_one_class_is_found_only_when_the_labels_are_spread():
    assert one_class([1] * 96 + [0] * 4, [0] * 40 + [1] * 60) == (1, 0.96)
    assert one_class([1] * 90 + [0] * 10, [0] * 40 + [1] * 60) is None  # 90%: not one class
    assert one_class([1] * 100, [1] * 97 + [0] * 3) is None  # the data is (nearly) one class itself
    assert "task.metric: mcc" in one_class_advice("accuracy")
    assert "task.metric" not in one_class_advice("mcc")


def test_a_one_class_round_and_best_adapter_are_warned_of(tmp_path, caplog, capsys):
    """A classifier bias far towards class 0 and a learning rate too small to move it: one class for every row."""
    cfg = tiny_config("train.lr=1e-12", "federation.rounds=3", "eval.max_examples=32")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    bias = next(k for k in rt.server.global_state if "classifier" in k and k.endswith("bias"))
    rt.server.global_state[bias] = np.array([50.0, -50.0], dtype=rt.server.global_state[bias].dtype)
    assert rt.evaluate_global()["predicts_one_class"]["share"] == 1.0
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        summary = rt.run()
    warned = [r.getMessage() for r in caplog.records if "predicts" in r.getMessage()]
    assert len([w for w in warned if w.startswith("round")]) == 1  # the first round only; later ones in events.log
    assert "task.metric: mcc" in warned[0]
    assert any(w.startswith("best_adapter (round 0, accuracy") for w in warned)  # (eval.at_start: round 0 is best)
    assert summary["best_predicts_one_class"]["share"] >= 0.95
    events = (tmp_path / "run" / "events.log").read_text()
    assert "round 3: the global model predicts" in events
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run")]) == 0  # the best adapter, scored again: warned of there too
    assert "warning: the model predicts 'negative' for 100% of the rows" in capsys.readouterr().err


def test_a_personalized_headline_says_its_rows_and_interval():
    rows = [{"round": 1, "personal_accuracy": 0.5, "personal_examples": 30, "client_personal": {"0": {}, "1": {}},
             "bytes_up": {}, "bytes_down": {}, "time_client_s": 0, "time_aggregation_s": 0, "time_evaluation_s": 0,
             "time_overhead_s": 0, "wall_s": 1.0},
            {"round": 2, "personal_accuracy": 0.9, "personal_examples": 30, "client_personal": {"0": {}, "1": {}},
             "bytes_up": {}, "bytes_down": {}, "time_client_s": 0, "time_aggregation_s": 0, "time_evaluation_s": 0,
             "time_overhead_s": 0, "wall_s": 2.0}]
    summary = summarize(rows, metric="personal_accuracy", target=None)
    assert summary["final_rows"] == 30 and summary["final_clients"] == 2
    low, high = summary["final_interval"]
    assert (round(low, 3), round(high, 3)) == (0.744, 0.965)  # Wilson, 27 of 30
    line = end_of_run_line("run", {**summary, "total_bytes": 0})
    assert "0.9000 [on 30 held-out rows of 2 clients, 95% interval 0.74-0.97]" in line
    assert "final_rows" not in summarize(rows, metric="accuracy", target=None)  # a global score: the eval set
    assert accuracy_interval(1.0, 6)[0] < 0.65  # 6 of 6 right says little


def test_warnings_during_a_run_go_to_events_log(tmp_path, capsys):
    cfg = tiny_config()
    (tmp_path / "run").mkdir()
    before = warnings.showwarning
    writer = RunWriter(tmp_path / "run", cfg)
    try:
        assert warnings.showwarning == writer._warning_to_log
        warnings.warn("A single label was found in 'y_true' and 'y_pred'", UserWarning, stacklevel=1)
    finally:
        writer.close()
    assert warnings.showwarning is before
    assert "A single label was found" in (tmp_path / "run" / "events.log").read_text()
    assert "A single label" not in capsys.readouterr().err


def test_the_run_writer_raises_the_loggers_level_to_info_for_its_time(tmp_path, monkeypatch):
    logger = logging.getLogger("fedpeft")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    (tmp_path / "run").mkdir()
    writer = RunWriter(tmp_path / "run", tiny_config())
    try:
        assert logger.getEffectiveLevel() == logging.INFO
        logger.info("an informational line")
    finally:
        writer.close()
    assert logger.level == logging.NOTSET
    assert "an informational line" in (tmp_path / "run" / "events.log").read_text()


def test_local_trainer_tells_each_step(tmp_path):
    rt = EmbeddedRuntime(tiny_config("train.local_steps=3"), tmp_path / "run")
    seen: list[tuple[int, int]] = []
    rt.exp.trainer.on_step = lambda done, total: seen.append((done, total))
    try:
        rt.exp.trainer.train(rt.exp.tuned, rt.exp.client_data(0), np.random.default_rng(0))
    finally:
        rt.close()
    assert seen == [(1, 3), (2, 3), (3, 3)]
