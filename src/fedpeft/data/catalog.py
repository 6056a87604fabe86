"""Named datasets: the same short name resolves to local files offline and to a Hub id online. Each is
registered with :func:`register_dataset` (``fedpeft.register_dataset``), the built-in ones below included,
in :data:`fedpeft.registry.DATASETS`.

Local files follow one schema (see docs/guide/data.md):

* classification: ``{"text", ["text_pair"], "label": int, ["label_text"]}`` (label -1 = unlabeled)
* generation: ``{"input", "target", ["references": [str]]}``
* multiple choice: ``{"question", "choices": [str], "label": int, ["context"]}``

A Hub row is converted to that schema by the entry's ``convert`` function.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from fedpeft import registry
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, code_ref, resolve

Row = dict[str, Any]
Loader = Callable[[str], list[Row]]  # a split name -> its rows in fedpeft's schema
# the fields every row of a task has
TASK_FIELDS = {
    "classification": ("text", "label"),
    "generation": ("input", "target"),
    "multiple_choice": ("question", "choices", "label"),
    "instruction": ("messages",),  # or an instruction record: instruction (or task.instruction), input, output
    "image_classification": ("image", "label"),  # image: {bytes, path} (the Hub's image schema), bytes or a path
}


@functools.cache  # one function per pair of fields: registering the built-ins again registers equal entries
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


TaskType = Literal["classification", "generation", "multiple_choice", "instruction", "image_classification"]
Convert = Callable[[Row], Row]


@dataclass(frozen=True)
class DatasetEntry:
    """A named dataset (``task.dataset``): how its rows are read (a local copy in fedpeft's schema, found as
    ``<data dir>/<name>/<split>.jsonl``, else its ``loader`` function, else the Hub dataset ``hub_id``
    converted row by row), its task, default metric and schema. Registered with :func:`register_dataset`."""

    name: str
    task: TaskType
    hub_id: str | None
    fields: tuple[str, ...]  # the fields its rows have in fedpeft's schema (see the module docstring)
    hub_config: str | None = None
    hub_splits: dict[str, str] = field(default_factory=dict)  # our split -> Hub split
    convert: Convert | CodeRef | None = None
    default_metric: str | None = None
    prompt_template: str | None = None
    note: str = ""
    # fields computed from a row in fedpeft's schema, usable as federation.partition.column (a row's own
    # field of the same name wins); ``derived_names`` lists them for messages
    derive_fields: Convert | CodeRef | None = None
    derived_names: tuple[str, ...] = ()
    # split name -> the rows of that split in fedpeft's schema, for a dataset read by code of its own
    loader: Loader | CodeRef | None = None
    splits: tuple[str, ...] = ()  # the splits ``loader`` serves (what `fedpeft data NAME` lists)

    def row_loader(self) -> Loader | None:
        """The function that reads a split's rows (None: local files or the Hub)."""
        return None if self.loader is None else resolve(self.loader)

    def converter(self) -> Convert | None:
        """The function that turns a Hub row into fedpeft's schema (None: the Hub rows already are)."""
        return None if self.convert is None else resolve(self.convert)

    def deriver(self) -> Convert | None:
        """The function that computes the derived fields of a row (None: the dataset derives none)."""
        return None if self.derive_fields is None else resolve(self.derive_fields)


# the registry of fedpeft.registry, typed with its full entries (the same object)
DATASETS = cast("registry.Registry[DatasetEntry]", registry.DATASETS)


def register_dataset(
    name: str,
    *,
    task: TaskType,
    hub_id: str | None = None,
    loader: Loader | CodeRef | str | None = None,
    splits: Sequence[str] = (),
    fields: Sequence[str] | None = None,
    hub_config: str | None = None,
    hub_splits: Mapping[str, str] | None = None,
    convert: Convert | CodeRef | str | None = None,
    default_metric: str | None = None,
    prompt_template: str | None = None,
    note: str = "",
    derive_fields: Convert | CodeRef | str | None = None,
    derived_names: Sequence[str] = (),
) -> DatasetEntry:
    """Make ``name`` a named dataset of ``task.dataset`` in every config from now on; returns its entry.

    Its rows are read from a local copy in fedpeft's schema when a data directory holds ``name/`` (see
    ``task.data_dir``), else by ``loader`` (code of the dataset's own: a private database, an API, generated
    rows), else from the Hugging Face Hub dataset ``hub_id`` (``hub_config``; ``hub_splits`` maps a split name
    of ours to the Hub's), each Hub row turned into fedpeft's schema by ``convert``. Give ``loader`` or
    ``hub_id``.

    Args:
        name: the name a config gives as ``task.dataset``.
        task: classification, generation, multiple_choice or instruction.
        hub_id: the Hub dataset read when no local copy exists.
        loader: a split name -> that split's rows in fedpeft's schema (a list of dicts); a function or
            ``"package.module:function"`` (imported when first used). Each row is checked as a file's rows are.
        splits: the split names ``loader`` serves.
        fields: the fields its rows have (default: the fields every row of ``task`` needs, e.g. text and
            label); they must include those.
        convert: a Hub row -> a row in fedpeft's schema; a function or ``"package.module:function"``
            (imported when first used).
        default_metric: the primary metric of a run that sets no ``task.metric`` (default: the task's).
        prompt_template: the prompt of a generation or multiple-choice task that sets no ``task.prompt_template``.
        note: a remark shown with the dataset (e.g. how the offline copy was made).
        derive_fields: a row -> extra fields usable as ``federation.partition.column`` (named in
            ``derived_names``); a function or ``"package.module:function"``.

    Registering the same entry again is a no-op; another dataset under a taken name is refused.
    """
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    if task not in TASK_FIELDS:
        raise ValueError(f"dataset {name!r}: task {task!r} is not one of {', '.join(TASK_FIELDS)}")
    if loader is None and (not isinstance(hub_id, str) or not hub_id):
        raise ValueError(f"dataset {name!r}: give the Hub dataset its rows come from as hub_id, e.g. 'nyu-mll/glue', "
                         "or a loader function (split -> rows)")
    if loader is not None and hub_id is not None:
        raise ValueError(f"dataset {name!r}: give a loader or a hub_id, not both")
    if loader is not None and not splits:
        raise ValueError(f"dataset {name!r}: name the splits its loader serves, e.g. splits=('train', 'validation')")
    schema = tuple(fields) if fields is not None else TASK_FIELDS[task]
    missing = [f for f in TASK_FIELDS[task] if f not in schema]
    if missing:
        raise ValueError(f"dataset {name!r}: fields lacks {', '.join(missing)}, which every {task} row has")
    entry = DatasetEntry(
        name, task, hub_id, schema, hub_config=hub_config, hub_splits=dict(hub_splits or {}),
        convert=None if convert is None else code_ref(convert), default_metric=default_metric,
        prompt_template=prompt_template, note=note,
        derive_fields=None if derive_fields is None else code_ref(derive_fields), derived_names=tuple(derived_names),
        loader=None if loader is None else code_ref(loader), splits=tuple(splits),
    )
    DATASETS.add(name, entry)
    return entry


def dataset_entry(name: str) -> DatasetEntry | None:
    """The registered dataset ``name`` (None: a local path or a Hub id, not a registered name; fedpeft's
    built-ins registered first)."""
    load_built_ins()
    return DATASETS.get(name) if name in DATASETS else None


# --- the built-in datasets, registered like a plugin's --------------------------------------------

_PAIR = ("text", "text_pair", "label")


def register_built_in_datasets() -> None:
    """Register the built-in datasets (fedpeft.builtins.register calls this)."""
    register_dataset("sst2", task="classification", hub_id="nyu-mll/glue", hub_config="sst2", convert=_pair("sentence"))
    register_dataset("cola", task="classification", hub_id="nyu-mll/glue", hub_config="cola",
                     hub_splits={"validation_in_domain+validation_out_of_domain": "validation"},
                     convert=_pair("sentence"), default_metric="mcc")
    register_dataset("rte", task="classification", hub_id="nyu-mll/glue", hub_config="rte", fields=_PAIR,
                     convert=_pair("sentence1", "sentence2"))
    register_dataset("mrpc", task="classification", hub_id="nyu-mll/glue", hub_config="mrpc", fields=_PAIR,
                     convert=_pair("sentence1", "sentence2"))
    register_dataset("qnli", task="classification", hub_id="nyu-mll/glue", hub_config="qnli", fields=_PAIR,
                     convert=_pair("question", "sentence"))
    register_dataset("mnli", task="classification", hub_id="nyu-mll/glue", hub_config="mnli", fields=_PAIR,
                     hub_splits={"heldout_subset": "validation_matched", "train_subset": "train"},
                     convert=_pair("premise", "hypothesis"),
                     note="Offline copy: train_subset / heldout_subset are a 10k sample of GLUE MNLI train.")
    register_dataset("boolq", task="classification", hub_id="google/boolq", fields=_PAIR, convert=_boolq)
    register_dataset("20newsgroups", task="classification", hub_id="SetFit/20_newsgroups", convert=_pair("text"))
    register_dataset("mr", task="classification", hub_id="cornell-movie-review-data/rotten_tomatoes",
                     convert=_pair("text"))
    register_dataset("subj", task="classification", hub_id="SetFit/subj", convert=_pair("text"))
    register_dataset("e2e_nlg", task="generation", hub_id="tuetschek/e2e_nlg",
                     hub_splits={"validation_pairs": "validation", "test_pairs": "test"}, convert=_e2e,
                     prompt_template="{input}\n", derive_fields=_e2e_fields, derived_names=E2E_ATTRIBUTES)
    register_dataset("arc_easy", task="multiple_choice", hub_id="allenai/ai2_arc", hub_config="ARC-Easy", convert=_arc)
    register_dataset("arc_challenge", task="multiple_choice", hub_id="allenai/ai2_arc", hub_config="ARC-Challenge",
                     convert=_arc)
    register_dataset("openbookqa", task="multiple_choice", hub_id="allenai/openbookqa", hub_config="main",
                     convert=_openbookqa)
    register_dataset("piqa", task="multiple_choice", hub_id="ybisk/piqa", convert=_piqa)
    register_dataset("hellaswag", task="multiple_choice", hub_id="Rowan/hellaswag", convert=_hellaswag,
                     prompt_template="{question}")
    register_dataset("race", task="multiple_choice", hub_id="ehovy/race", hub_config="all",
                     fields=("context", "question", "choices", "label"), convert=_race)


DEFAULT_GENERATION_TEMPLATE = "{input}\n"
DEFAULT_CHOICE_TEMPLATE = "Question: {question}\nAnswer:"
DEFAULT_CHOICE_TEMPLATE_WITH_CONTEXT = "{context}\nQuestion: {question}\nAnswer:"


def prompt_template(task_type: str, dataset: str, train_rows: list[Row], given: str | None = None) -> str | None:
    """The prompt of a generation or multiple-choice task: ``given``, else the registered dataset's, else the
    default (for multiple choice, with the context when the first train row has one). None for classification."""
    entry = dataset_entry(dataset)
    given = given or (entry.prompt_template if entry else None)
    if task_type == "generation":
        return given or DEFAULT_GENERATION_TEMPLATE
    if task_type == "multiple_choice":
        if given:
            return given
        has_context = bool(train_rows) and "context" in train_rows[0]
        return DEFAULT_CHOICE_TEMPLATE_WITH_CONTEXT if has_context else DEFAULT_CHOICE_TEMPLATE
    return None
