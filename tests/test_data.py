import json

import numpy as np
import pandas as pd
import pytest

from fedpeft.config.schema import TaskConfig
from fedpeft.data import features as F
from fedpeft.data.batching import Encoded, collate, length_grouped_batches, sequential_batches
from fedpeft.data.prepare import prepare_task
from fedpeft.data.sources import DataError, load_rows
from fedpeft.models import registry


@pytest.fixture(scope="module")
def tok():
    return registry.load_tokenizer("minilm-l6")


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_length_grouped_batches_cover_each_index_once():
    lengths = np.random.default_rng(0).integers(1, 100, size=1000)
    batches = length_grouped_batches(lengths, 16, np.random.default_rng(1), group_factor=4)
    allidx = np.concatenate(batches)
    assert sorted(allidx.tolist()) == list(range(1000))
    # inside a batch lengths are close: mean spread far below the spread of random batches
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in batches])
    assert spread < 30


def test_collate_pads_dynamically():
    data = Encoded([np.array([5, 6, 7]), np.array([8])], [np.array([-100, 6, 7]), np.array([8])])
    b = collate(data, np.array([0, 1]), pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    left = collate(data, np.array([0, 1]), pad_id=0, padding_side="left")
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert [len(x) for x in sequential_batches(np.array([1, 5, 3]), 2)] == [2, 1]


def test_causal_pair_truncates_context_from_the_left():
    ids, labels = F._causal_pair([1], [10, 11, 12, 13], [20, 21], max_length=5)
    assert ids.tolist() == [1, 12, 13, 20, 21]
    assert labels.tolist() == [-100, -100, -100, 20, 21]


def test_local_files_in_every_format(tmp_path):
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}]
    d = tmp_path / "mydata"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", rows)
    pd.DataFrame(rows).to_csv(d / "validation.csv", index=False)
    pd.DataFrame(rows).to_parquet(d / "test.parquet")
    assert load_rows(str(d), "train") == rows
    assert load_rows(str(d), "validation")[0]["text"] == "good"
    assert load_rows(str(d), "test")[1]["label"] == 0
    assert len(load_rows(str(d), "train+test")) == 4
    with pytest.raises(DataError, match="has no split 'dev'; available: test, train, validation"):
        load_rows(str(d), "dev")


@pytest.mark.needs_data
def test_catalog_names_resolve_to_the_shared_data():
    rows = load_rows("rte", "validation")
    assert len(rows) == 277 and {"text", "text_pair", "label"} <= set(rows[0])
    both = load_rows("cola", "validation_in_domain+validation_out_of_domain")
    assert len(both) == 1043


def test_column_mapping_and_missing_column_error(tmp_path, tok):
    d = tmp_path / "reviews"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", [{"sentence": "fine", "y": "pos"}, {"sentence": "awful", "y": "neg"}])
    _write_jsonl(d / "validation.jsonl", [{"sentence": "ok", "y": "pos"}])
    task = TaskConfig(dataset=str(d), columns={"text": "sentence", "label": "y"})
    data = prepare_task(task, tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    assert data.label_names == ["neg", "pos"] and data.train.labels == [1, 0] and data.eval.labels == [1]
    with pytest.raises(DataError, match="has no field 'text'.*task.columns"):
        prepare_task(TaskConfig(dataset=str(d)), tok, encoder_decoder=False, seed=0, eval_max_examples=None)


@pytest.mark.needs_data
def test_unknown_eval_label_and_unlabeled_train_are_errors(tmp_path, tok):
    d = tmp_path / "ds"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1}])
    _write_jsonl(d / "validation.jsonl", [{"text": "c", "label": 5}])
    with pytest.raises(DataError, match="eval split has label 5"):
        prepare_task(TaskConfig(dataset=str(d)), tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    with pytest.raises(DataError, match="unlabeled rows"):
        prepare_task(TaskConfig(dataset="rte", train_split="test_unlabeled"), tok, encoder_decoder=False, seed=0,
                     eval_max_examples=None)


def test_missing_dataset_offline_is_a_one_line_error(tok):
    with pytest.raises(DataError) as err:
        load_rows("no_such_dataset_xyz", "train")
    assert "not found locally" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.needs_data
def test_classification_pairs_keep_token_types(tok):
    data = prepare_task(TaskConfig(dataset="rte", max_train_examples=50), tok, encoder_decoder=False, seed=0,
                        eval_max_examples=20)
    assert len(data.train) == 50 and len(data.eval) == 20 and data.num_labels == 2
    assert data.train.token_type_ids is not None and data.train.token_type_ids[0].max() == 1
    assert all(len(x) <= 128 for x in data.train.input_ids)


@pytest.mark.needs_data
def test_generation_and_choice_encoding_on_real_data(tok):
    gen = prepare_task(TaskConfig(type="generation", dataset="e2e_nlg", train_split="validation_pairs",
                                  eval_split="test", max_train_examples=30), tok, encoder_decoder=False, seed=0,
                       eval_max_examples=10)
    ids, labels = gen.train.input_ids[0], gen.train.labels[0]
    assert len(ids) == len(labels) and labels[0] == -100 and labels[-1] == tok.sep_token_id
    assert len(gen.eval.references[0]) >= 1 and len(gen.eval.prompts) == 10
    mc = prepare_task(TaskConfig(type="multiple_choice", dataset="arc_easy", train_split="test[:80%]", eval_split="test[80%:]",
                                 max_train_examples=20), tok, encoder_decoder=False, seed=0, eval_max_examples=10)
    assert len(mc.train) == 20  # gold choice only
    assert len(mc.eval.sequences) == int(mc.eval.num_choices.sum()) and len(mc.eval.gold) == 10
    assert "question :" in tok.decode(mc.train.input_ids[0])


def test_split_slices_are_disjoint_and_cover_the_split(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(7)]
    (d / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    head, tail = load_rows(str(d), "test[:50%]"), load_rows(str(d), "test[50%:]")
    assert [r["text"] for r in head] == ["t0", "t1", "t2", "t3"]  # round(3.5) = 4, as datasets rounds
    assert [r["text"] for r in tail] == ["t4", "t5", "t6"]
    assert [r["text"] for r in load_rows(str(d), "test[-2:]")] == ["t5", "t6"]
    assert [r["text"] for r in load_rows(str(d), "test[1:3]+test[6:]")] == ["t1", "t2", "t6"]
    a = load_rows(str(d), "test[:3]", shuffle_seed=4)
    b = load_rows(str(d), "test[3:]", shuffle_seed=4)
    assert sorted(r["text"] for r in a + b) == [f"t{i}" for i in range(7)]
    assert [r["text"] for r in a] != ["t0", "t1", "t2"] or [r["text"] for r in b] != ["t3", "t4", "t5", "t6"]
    assert load_rows(str(d), "test[:3]", shuffle_seed=4) == a  # the same order every time
    with pytest.raises(DataError, match="selects no rows"):
        load_rows(str(d), "test[5:2]")
    with pytest.raises(DataError, match=r"name\[start:end\]"):
        load_rows(str(d), "test[a:b]")
    with pytest.raises(DataError, match="twice"):
        load_rows(str(d), "test[:5]+test[4:]")


@pytest.mark.needs_data
def test_train_and_eval_sharing_rows_is_an_error(tok):
    task = TaskConfig(type="multiple_choice", dataset="arc_easy", train_split="test[:60%]", eval_split="test[50%:]")
    with pytest.raises(DataError, match="share rows"):
        prepare_task(task, tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    with pytest.raises(DataError, match="share rows"):
        prepare_task(TaskConfig(dataset="rte", train_split="train", eval_split="train[:10]"), tok,
                     encoder_decoder=False, seed=0, eval_max_examples=None)


def test_one_file_datasets_cannot_train_and_evaluate_on_the_same_rows(tmp_path, tok):
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"t{i}", "label": i % 2}) for i in range(10)))
    with pytest.raises(DataError, match="share rows"):  # every split name reads the whole file
        prepare_task(TaskConfig(dataset=str(f)), tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    data = prepare_task(TaskConfig(dataset=str(f), train_split="all[:70%]", eval_split="all[70%:]", split_shuffle_seed=1),
                        tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    assert len(data.train) == 7
