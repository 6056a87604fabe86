"""Known datasets: the same short name resolves to local files offline and to a Hub id online.

Local files follow one schema (see docs/guide/data.md):

* classification: ``{"text", ["text_pair"], "label": int, ["label_text"]}`` (label -1 = unlabeled)
* generation: ``{"input", "target", ["references": [str]]}``
* multiple choice: ``{"question", "choices": [str], "label": int, ["context"]}``

A Hub row is converted to that schema by the entry's ``convert`` function.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]


def _pair(a: str, b: str | None = None) -> Callable[[Row], Row]:
    def convert(row: Row) -> Row:
        out = {"text": row[a], "label": int(row["label"])}
        if b is not None:
            out["text_pair"] = row[b]
        return out

    return convert


def _letter_or_digit_index(key: str, labels: list[str]) -> int:
    return labels.index(key)


def _arc(row: Row) -> Row:
    labels = list(row["choices"]["label"])
    return {
        "question": row["question"],
        "choices": list(row["choices"]["text"]),
        "label": _letter_or_digit_index(row["answerKey"], labels),
    }


def _openbookqa(row: Row) -> Row:
    labels = list(row["choices"]["label"])
    return {
        "question": row["question_stem"],
        "choices": list(row["choices"]["text"]),
        "label": _letter_or_digit_index(row["answerKey"], labels),
    }


def _piqa(row: Row) -> Row:
    return {"question": row["goal"], "choices": [row["sol1"], row["sol2"]], "label": int(row["label"])}


def _hellaswag(row: Row) -> Row:
    label = row["label"]
    return {
        "question": f"{row['activity_label']}: {row['ctx']}",
        "choices": list(row["endings"]),
        "label": int(label) if str(label).strip() != "" else -1,
    }


def _race(row: Row) -> Row:
    return {
        "context": row["article"],
        "question": row["question"],
        "choices": list(row["options"]),
        "label": "ABCD".index(row["answer"]),
    }


def _boolq(row: Row) -> Row:
    return {"text": row["question"], "text_pair": row["passage"], "label": int(bool(row["answer"]))}


def _e2e(row: Row) -> Row:
    return {"input": row["meaning_representation"], "target": row["human_reference"]}


E2E_ATTRIBUTES = ("name", "eat_type", "food", "price_range", "customer_rating", "area", "family_friendly", "near")
_MR_SLOT = re.compile(r"\s*([^,\[\]]+?)\s*\[([^\]]*)\]\s*(?:,|$)")


def mr_fields(mr: str) -> Row:
    """The attributes of an E2E meaning representation as fields named in snake case:
    ``"name[The Vaults], eatType[pub], customer rating[5 out of 5]"`` ->
    ``{"name": "The Vaults", "eat_type": "pub", "customer_rating": "5 out of 5"}``."""
    out: Row = {}
    for m in _MR_SLOT.finditer(mr):
        key = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", m[1].strip()).lower().replace(" ", "_")
        out[key] = m[2].strip()
    return out


def _e2e_fields(row: Row) -> Row:
    return mr_fields(row["input"]) if isinstance(row.get("input"), str) else {}


@dataclass(frozen=True)
class CatalogEntry:
    task: str
    hub_id: str
    hub_config: str | None = None
    hub_splits: dict[str, str] = field(default_factory=dict)  # our split -> Hub split
    convert: Callable[[Row], Row] | None = None
    default_metric: str | None = None
    prompt_template: str | None = None
    note: str = ""
    # fields computed from a row in fedpeft's schema, usable as federation.partition.column (a row's own
    # field of the same name wins); ``derived_names`` lists them for messages
    derive_fields: Callable[[Row], Row] | None = None
    derived_names: tuple[str, ...] = ()


CATALOG: dict[str, CatalogEntry] = {
    "sst2": CatalogEntry("classification", "nyu-mll/glue", "sst2", convert=_pair("sentence")),
    "cola": CatalogEntry(
        "classification",
        "nyu-mll/glue",
        "cola",
        hub_splits={"validation_in_domain+validation_out_of_domain": "validation"},
        convert=_pair("sentence"),
        default_metric="mcc",
    ),
    "rte": CatalogEntry("classification", "nyu-mll/glue", "rte", convert=_pair("sentence1", "sentence2")),
    "mrpc": CatalogEntry("classification", "nyu-mll/glue", "mrpc", convert=_pair("sentence1", "sentence2")),
    "qnli": CatalogEntry("classification", "nyu-mll/glue", "qnli", convert=_pair("question", "sentence")),
    "mnli": CatalogEntry(
        "classification",
        "nyu-mll/glue",
        "mnli",
        hub_splits={"heldout_subset": "validation_matched", "train_subset": "train"},
        convert=_pair("premise", "hypothesis"),
        note="Offline copy: train_subset / heldout_subset are a 10k sample of GLUE MNLI train.",
    ),
    "boolq": CatalogEntry("classification", "google/boolq", convert=_boolq),
    "20newsgroups": CatalogEntry("classification", "SetFit/20_newsgroups", convert=_pair("text")),
    "mr": CatalogEntry("classification", "cornell-movie-review-data/rotten_tomatoes", convert=_pair("text")),
    "subj": CatalogEntry("classification", "SetFit/subj", convert=_pair("text")),
    "e2e_nlg": CatalogEntry(
        "generation",
        "tuetschek/e2e_nlg",
        hub_splits={"validation_pairs": "validation", "test_pairs": "test"},
        convert=_e2e,
        prompt_template="{input}\n",
        derive_fields=_e2e_fields,
        derived_names=E2E_ATTRIBUTES,
    ),
    "arc_easy": CatalogEntry("multiple_choice", "allenai/ai2_arc", "ARC-Easy", convert=_arc),
    "arc_challenge": CatalogEntry("multiple_choice", "allenai/ai2_arc", "ARC-Challenge", convert=_arc),
    "openbookqa": CatalogEntry("multiple_choice", "allenai/openbookqa", "main", convert=_openbookqa),
    "piqa": CatalogEntry("multiple_choice", "ybisk/piqa", convert=_piqa),
    "hellaswag": CatalogEntry(
        "multiple_choice", "Rowan/hellaswag", convert=_hellaswag, prompt_template="{question}"
    ),
    "race": CatalogEntry("multiple_choice", "ehovy/race", "all", convert=_race),
}

DEFAULT_GENERATION_TEMPLATE = "{input}\n"
DEFAULT_CHOICE_TEMPLATE = "Question: {question}\nAnswer:"
DEFAULT_CHOICE_TEMPLATE_WITH_CONTEXT = "{context}\nQuestion: {question}\nAnswer:"


def prompt_template(task_type: str, dataset: str, train_rows: list[Row], given: str | None = None) -> str | None:
    """The prompt of a generation or multiple-choice task: ``given``, else the catalog entry's, else the
    default (for multiple choice, with the context when the first train row has one). None for classification."""
    entry = CATALOG.get(dataset)
    given = given or (entry.prompt_template if entry else None)
    if task_type == "generation":
        return given or DEFAULT_GENERATION_TEMPLATE
    if task_type == "multiple_choice":
        if given:
            return given
        has_context = bool(train_rows) and "context" in train_rows[0]
        return DEFAULT_CHOICE_TEMPLATE_WITH_CONTEXT if has_context else DEFAULT_CHOICE_TEMPLATE
    return None
