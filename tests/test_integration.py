"""A real pretrained model on real data: accuracy rises over 3 rounds, runs are reproducible, and the
saved adapter reloads with HF peft and scores the same."""

import numpy as np
import pytest
import torch
from helpers import without_timings

from fedpeft.config import load_config
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runtime.embedded import run

pytestmark = [pytest.mark.slow, pytest.mark.needs_data]  # every test here reads the real datasets

OVERRIDES = [
    "model.name=minilm-l6", "task.dataset=sst2", "task.max_train_examples=480", "task.max_length=64",
    "federation.num_clients=4", "federation.clients_per_round=2", "federation.rounds=3",
    "train.batch_size=16", "train.lr=0.002", "train.local_epochs=2", "eval.max_examples=200",
    "runtime.progress=false", "name=sst2-minilm",
]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "a"
    run(load_config(None, OVERRIDES), out)
    return out


def test_accuracy_rises_over_three_rounds(first_run):
    rows = read_metrics(first_run)
    acc = [r["eval_accuracy"] for r in rows]
    assert len(acc) == 4
    assert acc[0] < 0.6, "an untrained classifier head is near chance on SST-2"
    assert acc[-1] >= acc[0] + 0.15, f"accuracy did not rise: {acc}"
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]
    summary = read_summary(first_run)
    assert summary["trainable_parameters"] < 0.02 * summary["total_parameters"]


def test_rerun_with_same_seed_is_identical(first_run, tmp_path):
    run(load_config(None, OVERRIDES), tmp_path / "b")
    assert without_timings(read_metrics(first_run)) == without_timings(read_metrics(tmp_path / "b"))


def test_saved_adapter_reloads_with_peft_and_scores_the_same(first_run):
    from peft import PeftModel

    from fedpeft.data.prepare import prepare_task
    from fedpeft.models import registry
    from fedpeft.training.evaluate import evaluate

    cfg = load_config(None, OVERRIDES)
    tok = registry.load_tokenizer("minilm-l6")
    data = prepare_task(cfg.task, tok, encoder_decoder=False, seed=cfg.seed, eval_max_examples=cfg.eval.max_examples)
    base = registry.load_model("minilm-l6", "classification", num_labels=2, tokenizer=tok, seed=12345)
    model = PeftModel.from_pretrained(base, str(first_run / "adapter"))
    result = evaluate(model, data, tokenizer=tok, device=torch.device("cpu"), batch_size=64, encoder_decoder=False,
                      max_new_tokens=1, precision="fp32")
    last = read_metrics(first_run)[-1]
    assert result["accuracy"] == last["eval_accuracy"]
    assert np.isclose(result["eval_loss"], last["eval_loss"], rtol=1e-4)
