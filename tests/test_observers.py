"""RunObserver: watching a run in its own process through the public API (what the benchmarks use instead of
patching the runtime): what the server sends, what clients report, and each round's metrics row."""

from __future__ import annotations

from typing import Any

import pytest

import fedpeft
from fedpeft.config import load_config

TINY = ["model.name=tiny-bert", "task.max_train_examples=64", "task.max_length=32", "federation.num_clients=4",
        "federation.clients_per_round=2", "federation.rounds=2", "train.batch_size=8", "eval.max_examples=16",
        "runtime.progress=false"]


class Recorder(fedpeft.RunObserver):
    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = {}
        self.reports: list[tuple[int, int, str, Any]] = []
        self.rows: list[dict[str, Any]] = []

    def on_configure(self, rnd, payloads):
        self.sent[rnd] = sorted(payloads)

    def on_client_report(self, rnd, client_id, name, value):
        self.reports.append((rnd, client_id, name, value))

    def on_round_end(self, rnd, row):
        self.rows.append(dict(row))


@pytest.mark.needs_data
def test_observers_see_payloads_client_reports_and_rows(tmp_path):
    recorder = Recorder()
    cfg = load_config(None, [*TINY, "algorithm={name: headprune, sparsity: 0.5}"])
    fedpeft.run(cfg, tmp_path / "run", observers=[recorder])
    rows = [r for r in fedpeft.read_metrics(tmp_path / "run") if r["round"] > 0]
    assert [r["round"] for r in recorder.rows] == [0, 1, 2]  # round 0: the initial evaluation
    assert all(recorder.sent[r["round"]] == sorted(r["clients"]) for r in rows)
    assert recorder.rows == fedpeft.read_metrics(tmp_path / "run")  # the rows as written
    # headprune reports each client's full importance scores (4 heads x 2 layers of tiny-bert), unpruned
    assert sorted((rnd, cid) for rnd, cid, _, _ in recorder.reports) == sorted(
        (r["round"], c) for r in rows for c in r["clients"])
    assert all(name == "importance" and len(alpha) == 8 and (alpha > 0).sum() > 4
               for _, _, name, alpha in recorder.reports)


def test_observers_need_the_embedded_runtime(tmp_path):
    cfg = load_config(None, [*TINY, "runtime.name=flower"])
    with pytest.raises(ValueError, match="observers watch a run in this process"):
        fedpeft.run(cfg, tmp_path / "run", observers=[Recorder()])
