"""A run's adapters outside the run: `fedpeft eval` repeats the run's own figures for the best and the last
round, and the loading samples of docs/guide/adapters.md (bottleneck adapters through fedpeft, BitFit through
plain transformers) run as written, on real MiniLM runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO
from docs_samples import docs_sample

from fedpeft.adapters import load_adapter
from fedpeft.cli import main
from fedpeft.rundir import read_metrics, read_summary

pytestmark = pytest.mark.needs_data  # every test here reads the real datasets

SMALL = ["--set", "model.name=minilm-l6", "--set", "task.max_train_examples=96", "--set", "eval.max_examples=64",
         "--set", "federation.num_clients=3", "--set", "federation.clients_per_round=2", "--set", "federation.rounds=2",
         "--set", "task.max_length=48", "--set", "train.lr=0.003", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for method in ("houlsby", "bitfit"):
        assert main(["run", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(root / "runs" / method),
                     "--set", f"peft={{method: {method}}}", *SMALL]) == 0
    return root


def scores_by_eval(run_dir: Path, *args: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--max-examples", "64", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("method", ["houlsby", "bitfit"])
def test_fedpeft_eval_repeats_the_runs_best_and_last_figures(runs, method, capsys):
    run_dir = runs / "runs" / method
    summary, rows = read_summary(run_dir), {r["round"]: r for r in read_metrics(run_dir)}
    best = scores_by_eval(run_dir, capsys=capsys)
    assert best["adapter"] == "best_adapter" and best["round"] == summary["best_round"]
    assert best["eval_accuracy"] == summary["best"]
    assert best["eval_loss"] == pytest.approx(rows[summary["best_round"]]["eval_loss"], rel=1e-5)
    last = scores_by_eval(run_dir, "--adapter", "last", capsys=capsys)
    assert last["round"] == 2 and last["eval_accuracy"] == rows[2]["eval_accuracy"]
    assert last["eval_loss"] == pytest.approx(rows[2]["eval_loss"], rel=1e-5)
    lines = [json.loads(x) for x in Path(last["predictions"]).read_text().splitlines()]
    assert len(lines) == 64 and all(x["prediction"] in ("negative", "positive") for x in lines)
    source_rows = Path(lines[0]["source"]).read_text().splitlines()
    assert json.loads(source_rows[lines[0]["row"] - 1])["text"] == lines[0]["text"]
    accuracy = sum(x["prediction_id"] == x["label"] for x in lines) / len(lines)
    assert accuracy == last["eval_accuracy"]


def test_any_split_can_be_scored_including_train(runs, capsys):
    out = scores_by_eval(runs / "runs" / "houlsby", "--split", "train[:40]", capsys=capsys)
    assert out["split"] == "train[:40]" and out["examples"] == 40


def test_the_docs_loading_samples_run_as_written(runs, monkeypatch, capsys):
    monkeypatch.chdir(runs)
    bottleneck, bitfit = docs_sample("adapter-bottleneck"), docs_sample("adapter-bitfit")
    exec(compile(bottleneck, "docs bottleneck sample", "exec"), {})  # noqa: S102 (runs the docs' sample)
    assert capsys.readouterr().out.strip() in ("negative", "positive")
    namespace: dict = {}
    exec(compile(bitfit, "docs BitFit sample", "exec"), namespace)  # noqa: S102 (runs the docs' sample)
    plain = namespace["model"]
    ours = load_adapter("runs/bitfit/adapter").model
    batch = load_adapter("runs/bitfit/adapter").tokenizer(["a gripping film", "dull"], return_tensors="pt",
                                                        padding=True)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, ours(**batch).logits)
