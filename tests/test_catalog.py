"""Catalog converters: Hub rows (as the Hub datasets ship them) -> fedpeft's schema.

The Hub is unreachable here, so each converter is checked on a row shaped like its Hub dataset."""

import pytest

from fedpeft.data.catalog import prompt_template  # noqa: F401 (importing it registers the built-in datasets)
from fedpeft.registry import DATASETS


def test_glue_pairs():
    row = DATASETS.get("rte").convert({"sentence1": "A", "sentence2": "B", "label": 1, "idx": 0})
    assert row == {"text": "A", "text_pair": "B", "label": 1}
    assert DATASETS.get("sst2").convert({"sentence": "fun", "label": 1, "idx": 3}) == {"text": "fun", "label": 1}
    assert DATASETS.get("mnli").convert({"premise": "p", "hypothesis": "h", "label": 2})["text_pair"] == "h"


def test_multiple_choice_converters():
    arc = DATASETS.get("arc_easy").convert({"question": "Q?", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
                                       "answerKey": "C"})
    assert arc == {"question": "Q?", "choices": ["a", "b", "c"], "label": 2}
    arc_digits = DATASETS.get("arc_challenge").convert({"question": "Q", "choices": {"text": ["x", "y"], "label": ["1", "2"]},
                                                   "answerKey": "2"})
    assert arc_digits["label"] == 1
    obqa = DATASETS.get("openbookqa").convert({"question_stem": "S", "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                                          "answerKey": "B"})
    assert obqa == {"question": "S", "choices": ["a", "b"], "label": 1}
    piqa = DATASETS.get("piqa").convert({"goal": "g", "sol1": "s1", "sol2": "s2", "label": 0})
    assert piqa == {"question": "g", "choices": ["s1", "s2"], "label": 0}
    hs = DATASETS.get("hellaswag").convert({"activity_label": "Cooking", "ctx": "He", "endings": ["a", "b", "c", "d"], "label": "3"})
    assert hs == {"question": "Cooking: He", "choices": ["a", "b", "c", "d"], "label": 3}
    race = DATASETS.get("race").convert({"article": "Art", "question": "Q", "options": ["a", "b", "c", "d"], "answer": "B"})
    assert race == {"context": "Art", "question": "Q", "choices": ["a", "b", "c", "d"], "label": 1}


def test_other_converters_and_split_aliases():
    assert DATASETS.get("boolq").convert({"question": "q", "passage": "p", "answer": True}) == {"text": "q", "text_pair": "p", "label": 1}
    assert DATASETS.get("e2e_nlg").convert({"meaning_representation": "name[X]", "human_reference": "X."}) == {
        "input": "name[X]", "target": "X."}
    assert DATASETS.get("mnli").hub_splits["heldout_subset"] == "validation_matched"
    assert DATASETS.get("cola").default_metric == "mcc"
    assert {e.task for e in DATASETS.values()} == {"classification", "generation", "multiple_choice"}


@pytest.mark.needs_data
def test_a_catalog_dataset_reports_its_own_metric_unless_the_user_names_one(tmp_path):
    from helpers import tiny_config

    from fedpeft.rundir import read_summary
    from fedpeft.runtime.embedded import run

    assert tiny_config("task.dataset=cola").primary_metric() == "mcc"
    assert tiny_config("task.dataset=cola", "task.metric=accuracy").primary_metric() == "accuracy"
    assert tiny_config("task.dataset=sst2").primary_metric() == "accuracy"
    run(tiny_config("task.dataset=cola", "task.eval_split=validation_in_domain", "federation.rounds=1"), tmp_path / "cola")
    summary = read_summary(tmp_path / "cola")
    assert summary["primary_metric"] == "mcc" and -1.0 <= summary["final"] <= 1.0
