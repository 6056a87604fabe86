"""Issue 23: no silent data mistakes, and fast failure offline.

Every row of the splits a run reads is checked before any subsetting; a problem is one line naming the file,
the split, the 1-based row in that file and the fix. ``fedpeft data`` lists the same problems."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
from huggingface_hub import constants

from fedpeft import hub
from fedpeft.cli import main
from fedpeft.config.schema import TaskConfig
from fedpeft.data.prepare import prepare_task
from fedpeft.data.sources import DataError, load_rows
from fedpeft.models import registry

FAST_S = 5.0  # generous for a noisy CI machine; the checks take milliseconds


@pytest.fixture(scope="module")
def tok():
    return registry.load_tokenizer("tiny-bert")


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(tmp_path, train, validation, name="trec"):
    d = tmp_path / name
    _jsonl(d / "train.jsonl", train)
    _jsonl(d / "validation.jsonl", validation)
    return d


def _prepare(tok, dataset, **task):
    return prepare_task(TaskConfig(dataset=str(dataset), **task), tok, encoder_decoder=False, seed=0,
                        eval_max_examples=None)


def _refusal(tok, dataset, **task) -> str:
    with pytest.raises(DataError) as err:
        _prepare(tok, dataset, **task)
    message = str(err.value)
    assert "\n" not in message
    return message


def _cli(capsys, *argv):
    code = main(["data", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _texts(labels):
    return [{"text": f"t{i}", "label": v} for i, v in enumerate(labels)]


# 1. a stray string label among integers -----------------------------------------------------------


def test_a_stray_string_label_among_integers_is_refused(tmp_path, tok, capsys):
    d = _dataset(tmp_path, _texts([0, 1, 2, "HUM", 3, 4, 5]), _texts([0, 1]))
    message = _refusal(tok, d)  # old code: an extra class 'HUM', 7 classes in all
    assert f"{d / 'train.jsonl'}: split 'train' row 4: label 'HUM' is a string" in message
    assert "6 other labels of the split are integers" in message and "use one kind" in message
    code, out, _ = _cli(capsys, str(d))
    assert code == 2 and "problem:" in out and "row 4: label 'HUM'" in out


def test_an_integer_written_as_a_string_among_integers_is_refused(tmp_path, tok):
    d = _dataset(tmp_path, _texts([0, 1, "3", 2, 3]), _texts([0, 1]))
    assert "row 3: label '3' is a string" in _refusal(tok, d) and "write it as the number 3" in _refusal(tok, d)


def test_labels_of_one_kind_stay_accepted(tmp_path, tok):
    names = _prepare(tok, _dataset(tmp_path, _texts(["pos", "neg", "mid"]), _texts(["neg"]), "s"))
    assert names.label_names == ["mid", "neg", "pos"] and names.eval.labels == [1]
    ints = _prepare(tok, _dataset(tmp_path, _texts([2, 0, 1]), _texts([1]), "i"))
    assert ints.num_labels == 3 and ints.train.labels == [2, 0, 1]


# 2. class ids that the train split never uses ------------------------------------------------------


def test_one_based_labels_are_refused(tmp_path, tok, capsys):
    d = _dataset(tmp_path, _texts([1, 2, 3, 4, 5, 6]), _texts([1, 6]))
    message = _refusal(tok, d)  # old code: 7 classes, class 0 never seen
    assert f"{d / 'train.jsonl'}: train split 'train' never uses class id 0 (labels 1..6)" in message
    assert "subtract 1 from every label" in message
    code, out, _ = _cli(capsys, str(d), "--split", "train")  # fine to show; noted
    assert code == 0 and "note:" in out and "never uses class id 0" in out


def test_a_gap_in_the_class_ids_is_refused(tmp_path, tok):
    message = _refusal(tok, _dataset(tmp_path, _texts([0, 1, 3, 4]), _texts([0])))
    assert "never uses class id 2 (labels 0..4)" in message and "renumber the classes 0..K-1" in message


def test_classes_are_counted_over_the_whole_train_split_not_the_subset(tmp_path, tok):
    d = _dataset(tmp_path, _texts([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]), _texts([2, 1]))
    for seed in range(5):  # old code: num_labels from the seeded subset; eval label 2 refused for some seeds
        data = prepare_task(TaskConfig(dataset=str(d), max_train_examples=2), tok, encoder_decoder=False,
                            seed=seed, eval_max_examples=None)
        assert data.num_labels == 3 and data.eval.labels == [2, 1]


# 3. float and boolean labels ----------------------------------------------------------------------


def test_fractional_float_labels_are_refused(tmp_path, tok):
    message = _refusal(tok, _dataset(tmp_path, _texts([0, 1, 1.9, 0]), _texts([0])))  # old code: 1.9 -> 1
    assert "split 'train' row 3: label 1.9 is not a whole number" in message


def test_boolean_labels_are_refused(tmp_path, tok):
    message = _refusal(tok, _dataset(tmp_path, _texts([True, False]), _texts([True])))  # old code: 1 and 0
    assert "row 1: label True is a boolean; write the class as an integer" in message


def test_whole_number_float_labels_are_read_as_integers_with_a_warning(tmp_path, tok, caplog):
    d = _dataset(tmp_path, _texts([0.0, 1.0, 2.0]), _texts([1]))
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        data = _prepare(tok, d)
    assert data.num_labels == 3 and data.train.labels == [0, 1, 2]
    assert "row 1: label 0.0 and 2 more whole-number float labels are read as integer class ids" in caplog.text


# 4. null and non-string text ----------------------------------------------------------------------


@pytest.mark.parametrize("text, said", [(None, "'text' is null"), (7, "'text' is a number (7), not a string"),
                                        (["a"], "'text' is a list"), ("  ", "'text' is empty")])
def test_null_or_non_string_text_is_refused(tmp_path, tok, text, said):
    rows = [{"text": "fine", "label": 0}, {"text": "ok", "label": 1}, {"text": text, "label": 0}]
    message = _refusal(tok, _dataset(tmp_path, rows, _texts([0])))  # old code: str(None) = "None", str(7)
    assert f"split 'train' row 3: {said}" in message


def test_text_pair_may_be_null_but_not_a_number(tmp_path, tok):
    rows = [{"text": "a", "text_pair": None, "label": 0}, {"text": "b", "text_pair": "c", "label": 1}]
    assert len(_prepare(tok, _dataset(tmp_path, rows, _texts([0]), "ok")).train) == 2
    rows[0]["text_pair"] = 3
    assert "row 1: 'text_pair' is a number (3)" in _refusal(tok, _dataset(tmp_path, rows, _texts([0]), "bad"))


@pytest.mark.parametrize("bad, said", [({"target": None}, "'target' is null"),
                                       ({"input": 12}, "'input' is a number"),
                                       ({"references": "one"}, "'references' is a string")])
def test_generation_rows_are_checked(tmp_path, tok, bad, said):
    rows = [{"input": f"i{i}", "target": f"o{i}"} for i in range(4)]
    rows[2].update(bad)
    d = _dataset(tmp_path, rows, [{"input": "x", "target": "y"}])
    assert f"row 3: {said}" in _refusal(tok, d, type="generation")


@pytest.mark.parametrize("bad, said", [({"choices": ["a", 2]}, "'choice 1' is a number"),
                                       ({"question": None}, "'question' is null"),
                                       ({"label": "B"}, "label 'B' is a string; give the index of the gold choice"),
                                       ({"label": 4}, "label 4 is not an index into its 2 choices")])
def test_multiple_choice_rows_are_checked(tmp_path, tok, bad, said):
    rows = [{"question": f"q{i}", "choices": ["a", "b"], "label": i % 2} for i in range(4)]
    rows[1].update(bad)
    d = _dataset(tmp_path, rows, [{"question": "q", "choices": ["a", "b"], "label": 0}])
    assert f"split 'train' row 2: {said}" in _refusal(tok, d, type="multiple_choice")


# 5. every row, whatever the seed ------------------------------------------------------------------


def test_a_broken_row_outside_the_subset_is_refused_for_every_seed(tmp_path, tok):
    rows = _texts([i % 2 for i in range(50)])
    rows[36]["text"] = None
    d = _dataset(tmp_path, rows, _texts([0, 1]))
    for seed in range(6):  # old code: refused or not depending on whether the subset held row 37
        with pytest.raises(DataError, match=r"train\.jsonl: split 'train' row 37: 'text' is null"):
            prepare_task(TaskConfig(dataset=str(d), max_train_examples=5), tok, encoder_decoder=False, seed=seed,
                         eval_max_examples=None)


def test_slices_and_joins_name_the_part_and_the_row_in_its_file(tmp_path, tok):
    d = tmp_path / "ds"
    _jsonl(d / "a.jsonl", _texts([0, 1, 0, 1]))
    bad = _texts([0, 1, 0, 1, 0])
    bad[3]["text"] = 5
    _jsonl(d / "b.jsonl", bad)
    message = _refusal(tok, d, train_split="a[1:]+b[2:]", eval_split="a[:1]")
    assert message.startswith(f"{d / 'b.jsonl'}: split 'b[2:]' row 4: 'text' is a number")
    shuffled = _refusal(tok, d, train_split="b[1:]", eval_split="b[:1]", split_shuffle_seed=3)
    assert "split 'b[1:]' row 4:" in shuffled or "split 'b[:1]' row 4:" in shuffled  # the file's row, not the slice's


# 6. the split that is wrong, and the real label -----------------------------------------------------


def test_eval_split_problems_name_the_eval_split_and_the_real_label(tmp_path, tok):
    d = _dataset(tmp_path, _texts([0, 1, 0]), _texts([0, -3]))
    message = _refusal(tok, d)  # old code: "split 'train'" and "label -1"
    assert f"{d / 'validation.jsonl'}: split 'validation' row 2: label -3 is negative" in message
    d2 = _dataset(tmp_path, _texts([0, 1, 0]), _texts(["neg", "pos"]), "d2")
    message = _refusal(tok, d2)
    assert "validation.jsonl: split 'validation' row 1: eval split has label 'neg'" in message
    assert "train split 'train' has labels that are integers" in message


def test_unlabeled_rows_are_refused_for_a_run_with_their_row(tmp_path, tok):
    d = _dataset(tmp_path, _texts([0, 1, 0]), _texts([0, 1, -1, -1]))
    message = _refusal(tok, d)
    assert "validation.jsonl: split 'validation' row 3: label -1 marks an unlabeled row" in message
    assert "(2 of 4, this is the first)" in message and "choose a labeled split" in message


# 7. fedpeft data ----------------------------------------------------------------------------------


def test_fedpeft_data_lists_problems_instead_of_a_traceback(tmp_path, capsys):
    rows = [{"text": "a", "label": 0}, {"label": 1}, {"text": "c", "label": [1, 2]}, {"text": None, "label": 1}]
    d = _dataset(tmp_path, rows, _texts([0, 1]))
    code, out, err = _cli(capsys, str(d))  # old code: TypeError (unhashable list) / KeyError ('text')
    assert code == 2 and err.startswith("error: 3 problems in dataset")
    assert f"problem: {d / 'train.jsonl'}: split 'train' row 2: has no field 'text'" in out
    assert "row 3: label is a list ([1, 2])" in out and "row 4: 'text' is null" in out
    assert "validation: 2 rows" in out and "labels: 0: 1, 1: 1" in out


@pytest.mark.needs_data
def test_fedpeft_data_shows_unlabeled_splits_without_refusing_them(capsys):
    code, out, _ = _cli(capsys, "rte", "--split", "test_unlabeled")
    assert code == 0 and "note: unlabeled split (label -1 on all 3000 rows)" in out and "problem" not in out


@pytest.mark.needs_data
def test_fedpeft_data_orders_numeric_labels_by_value(capsys):
    code, out, _ = _cli(capsys, "20newsgroups", "--split", "test")
    assert code == 0 and "9=rec.sport.baseball: 397, 10=rec.sport.hockey: 399" in out


# 8. TSV and CSV files, unsupported file types ------------------------------------------------------


def test_tsv_files_are_read_with_text_kept_as_text(tmp_path, tok, capsys):
    d = tmp_path / "tsvdata"
    d.mkdir()
    (d / "train.tsv").write_text('text\tlabel\n"quoted start\t0\n42\t1\nplain\t2\n')
    (d / "validation.tsv").write_text("text\tlabel\nx\t1\n")
    rows = load_rows(str(d), "train")  # old code: "has no split 'train'"
    assert rows == [{"text": '"quoted start', "label": 0}, {"text": "42", "label": 1}, {"text": "plain", "label": 2}]
    assert _prepare(tok, d).num_labels == 3
    code, out, _ = _cli(capsys, str(d))
    assert code == 0 and "train: 3 rows" in out and "validation: 1 rows" in out


def test_csv_text_of_digits_stays_text_and_a_stray_label_is_refused(tmp_path, tok):
    d = tmp_path / "csvdata"
    d.mkdir()
    (d / "train.csv").write_text("text,label\n123,0\nhello,1\nworld,HUM\nagain,1\n")
    (d / "validation.csv").write_text("text,label\nx,0\n")
    assert load_rows(str(d), "train")[0] == {"text": "123", "label": 0}  # old code: {"text": 123, ...}
    assert f"{d / 'train.csv'}: split 'train' row 3: label 'HUM' is a string" in _refusal(tok, d)
    (d / "train.csv").write_text("text,label\na,0\nb,\n")
    assert "row 2: label is null" in _refusal(tok, d)


def test_unsupported_file_types_are_refused_with_the_supported_ones(tmp_path, capsys):
    d = tmp_path / "xl"
    d.mkdir()
    (d / "train.txt").write_text("a\t0\n")
    (d / "train.xlsx").write_bytes(b"PK")
    code, _, err = _cli(capsys, str(d))  # old code: exit 0, no splits
    assert code == 2 and "no data files (found train.txt, train.xlsx)" in err and ".jsonl" in err and ".tsv" in err
    with pytest.raises(DataError, match=r"train\.txt: split 'train' is in a file type fedpeft does not read; "
                                        r"convert it to one of \.jsonl"):
        load_rows(str(d), "train")  # old code: "has no split 'train'"


# 9. a local path that does not exist --------------------------------------------------------------


@pytest.mark.parametrize("name", ["./mydata", "/no/such/dir", "~/no_such_fedpeft_data", "rows.jsonl"])
def test_a_missing_local_path_is_not_tried_as_a_hub_id(name, capsys):
    with pytest.raises(DataError, match=f"local path {name!r} does not exist"):
        load_rows(name, "train")  # old code: "not found locally ... the Hub load failed"
    code, _, err = _cli(capsys, name)  # old code: exit 0, "source: hub:..."
    assert code == 2 and "does not exist" in err


# 10. fast failure offline -------------------------------------------------------------------------


@pytest.fixture
def hub_offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def hub_unreachable(monkeypatch):
    """HF_HUB_OFFLINE unset and the Hub endpoint a closed local port: no real network involved."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")


def _timed_failure(error, call):
    start = time.perf_counter()
    with pytest.raises(error) as err:
        call()
    return str(err.value), time.perf_counter() - start


@pytest.mark.parametrize("mode", ["hub_offline", "hub_unreachable"])
@pytest.mark.parametrize("loader", ["load_config", "load_tokenizer"])
def test_an_unknown_model_fails_fast(mode, loader, request):
    request.getfixturevalue(mode)
    message, seconds = _timed_failure(registry.ModelError,
                                      lambda: getattr(registry, loader)("no-such-org/no-such-model"))
    assert seconds < FAST_S  # old code: 25-48 s of retries with HF_HUB_OFFLINE unset
    assert "tiny-bert" in message and "minilm-l6" in message and "set model.name to a bundled alias" in message
    if mode == "hub_offline":
        assert "HF_HUB_OFFLINE is set" in message and "unset HF_HUB_OFFLINE" in message
    else:
        assert "the Hub (http://127.0.0.1:9) cannot be reached" in message


@pytest.mark.parametrize("mode", ["hub_offline", "hub_unreachable"])
@pytest.mark.needs_data
def test_an_unknown_dataset_fails_fast(mode, request, capsys):
    request.getfixturevalue(mode)
    message, seconds = _timed_failure(DataError, lambda: load_rows("some-org/no-such-dataset", "train"))
    assert seconds < FAST_S  # old code: 24 s of retries with HF_HUB_OFFLINE unset
    assert "not found locally" in message and "FEDPEFT_DATA_DIR" in message
    assert "catalog datasets there: 20newsgroups, arc_challenge, arc_easy, boolq, cola" in message  # alphabetical
    assert ("HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set" if mode == "hub_offline" else "cannot be reached") in message
    code, _, err = _cli(capsys, "some-org/no-such-dataset")  # old code: exit 0 and no splits
    assert code == 2 and "not found locally" in err


def test_the_hub_probe_tells_an_open_port_from_a_closed_one(hub_unreachable, monkeypatch):
    assert not hub.hub_reachable()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub.hub_reachable()


def test_an_unreachable_hub_loads_a_cached_model_from_the_cache(hub_unreachable, monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "models--some-org--cached-model").mkdir()
    source = registry.resolve("some-org/cached-model")
    assert registry._hub_options(source) == {"local_files_only": True}


# 11. issue 35: labels that differ only by whitespace, one class, a huge class id ------------------------


def test_labels_that_differ_only_by_surrounding_whitespace_are_refused(tmp_path, tok, capsys):
    d = _dataset(tmp_path, _texts(["positive", "negative", "negative", "positive ", "positive"]),
                 _texts(["positive"]))
    message = _refusal(tok, d)  # old code: a third class 'positive '
    assert message == (f"{d / 'train.jsonl'}: split 'train' row 4: label 'positive ' differs from label 'positive' "
                       "(row 1) only by surrounding whitespace: they would be two classes; write each class name "
                       "one way (strip the whitespace around the labels)")
    code, out, _ = _cli(capsys, str(d))
    assert code == 2 and "problem: " in out and "row 4: label 'positive ' differs from label 'positive'" in out


def test_whitespace_twins_in_two_files_of_a_join_name_both_files(tmp_path, tok):
    d = tmp_path / "joined"
    _jsonl(d / "a.jsonl", _texts(["pos", "neg"]))
    _jsonl(d / "b.jsonl", _texts(["neg", "\tpos"]))
    _jsonl(d / "validation.jsonl", _texts(["pos"]))
    message = _refusal(tok, d, train_split="a+b", eval_split="validation")
    assert message.startswith(f"{d / 'b.jsonl'}: split 'b' row 2: label '\\tpos' differs from label 'pos' "
                              f"({d / 'a.jsonl'}: split 'a' row 1) only by surrounding whitespace")


def test_a_padded_label_without_a_twin_is_kept_as_written_and_logged(tmp_path, tok, caplog, capsys):
    d = _dataset(tmp_path, _texts(["yes ", "no", "yes ", "no"]), _texts(["no", "yes "]))
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        data = _prepare(tok, d)
    assert data.label_names == ["no", "yes "] and data.eval.labels == [0, 1]  # not reinterpreted
    assert ("train.jsonl: split 'train' row 1: label 'yes ' has surrounding whitespace, kept as part of the class "
            "name (2 rows, 1 class name)") in caplog.text
    code, out, _ = _cli(capsys, str(d), "--split", "train")
    assert code == 0 and "note: " in out and "label 'yes ' has surrounding whitespace" in out


def test_an_eval_label_that_matches_a_class_only_after_stripping_names_it(tmp_path, tok):
    d = _dataset(tmp_path, _texts(["yes", "no"]), _texts(["no", "yes  "]))
    message = _refusal(tok, d)
    assert "validation.jsonl: split 'validation' row 2: eval split has label 'yes  ' that the train split 'train' " \
           "never uses (the classes have 'yes': write the label the same way)" in message


def test_a_one_class_train_split_is_refused(tmp_path, tok, capsys):
    d = _dataset(tmp_path, _texts(["positive"] * 4), _texts(["positive"]))
    message = _refusal(tok, d)  # old code: a 1-label model, accuracy 1.0
    assert message == (f"{d / 'train.jsonl'}: train split 'train' has one class ('positive', all 4 labeled rows); a "
                       "classifier needs at least 2 classes to learn (a 1-class model scores accuracy 1.0 on anything): "
                       "train on a split with every class")
    ints = _dataset(tmp_path, _texts([0, 0, 0]), _texts([0]), "ints")
    assert "train split 'train' has one class (0, all 3 labeled rows)" in _refusal(tok, ints)
    code, out, _ = _cli(capsys, str(d), "--split", "train")  # fine to show, noted
    assert code == 0 and "split 'train' has one class ('positive', all 4 labeled rows) (refused as a train split)" in out


def test_one_class_is_judged_on_the_train_split_as_written_not_the_subset_nor_the_eval_split(tmp_path, tok):
    d = _dataset(tmp_path, _texts([0, 0, 0, 1]), _texts([0, 0]))
    data = prepare_task(TaskConfig(dataset=str(d), max_train_examples=1), tok, encoder_decoder=False, seed=0,
                        eval_max_examples=None)  # one example, one class: fine, the split has two
    assert data.num_labels == 2 and data.eval.labels == [0, 0]  # an eval split of one class is fine
    message = _refusal(tok, d, train_split="train[:3]", eval_split="validation")  # the slice has one class
    assert "train split 'train[:3]' has one class (0, all 3 labeled rows)" in message


def test_a_huge_class_id_is_refused_fast_and_in_little_memory(tmp_path, tok, capsys):
    import tracemalloc

    d = _dataset(tmp_path, _texts([0, 1, 10**30, 1]), _texts([0]))
    tracemalloc.start()
    start = time.perf_counter()
    message = _refusal(tok, d)  # old code: set(range(10**30 + 1)), until memory ran out
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < FAST_S and peak < 20 * 2**20
    assert (f"{d / 'train.jsonl'}: train split 'train' never uses class ids 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 and "
            f"{10**30 - 12} more (labels 0..{10**30}); renumber the classes 0..K-1") in message
    code, out, _ = _cli(capsys, str(d), "--split", "train")
    assert code == 0 and "never uses class ids 2, 3" in out and f"{10**30}: 1" in out


def test_fedpeft_data_shows_a_label_beyond_float_range(tmp_path, capsys):
    d = _dataset(tmp_path, _texts([0, 10**400]), _texts([0]))
    code, out, _ = _cli(capsys, str(d), "--split", "train")  # old code: OverflowError sorting the histogram
    assert code == 0 and f"labels: 0: 1, {10**400}: 1" in out
