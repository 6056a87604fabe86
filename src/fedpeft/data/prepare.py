"""From a task config to tokenised train / eval data (tokenised once per run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from fedpeft.config.schema import TaskConfig
from fedpeft.data import features as F
from fedpeft.data.batching import Encoded
from fedpeft.data.catalog import CATALOG
from fedpeft.data.sources import DataError, load_rows, shared_rows

EvalSet = Union[Encoded, F.GenerationEval, F.ChoiceEval]


@dataclass
class TaskData:
    task_type: str
    train: Encoded
    eval: EvalSet
    train_labels: np.ndarray | None  # class labels (classification only), for label-skew partitions
    num_labels: int | None
    label_names: list[str] | None
    num_eval_examples: int
    template: str | None


def _seeded_subset(n: int, k: int | None, seed: int) -> np.ndarray:
    if k is None or k >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:k])


def prepare_task(
    task: TaskConfig,
    tokenizer,
    *,
    encoder_decoder: bool,
    seed: int,
    eval_max_examples: int | None,
) -> TaskData:
    kw = dict(dataset_config=task.dataset_config, data_dir=task.data_dir, columns=task.columns,
              shuffle_seed=task.split_shuffle_seed)
    train_spans: dict[str, list[tuple[int, int]]] = {}
    eval_spans: dict[str, list[tuple[int, int]]] = {}
    train_rows = load_rows(task.dataset, task.train_split, spans=train_spans, **kw)
    eval_rows = load_rows(task.dataset, task.eval_split, spans=eval_spans, **kw)
    shared = shared_rows(train_spans, eval_spans)
    if shared is not None:
        raise DataError(
            f"task.train_split {task.train_split!r} and task.eval_split {task.eval_split!r} share rows (of "
            f"{shared}); carve disjoint parts of one split, e.g. 'test[:80%]' and 'test[80%:]'"
        )
    where_train = f"dataset {task.dataset!r} split {task.train_split!r}"
    where_eval = f"dataset {task.dataset!r} split {task.eval_split!r}"
    if not train_rows:
        raise DataError(f"{where_train}: no rows")
    if not eval_rows:
        raise DataError(f"{where_eval}: no rows")
    pick = _seeded_subset(len(train_rows), task.max_train_examples, seed)
    train_rows = [train_rows[i] for i in pick]
    eval_pick = _seeded_subset(len(eval_rows), eval_max_examples, seed + 1)
    eval_rows = [eval_rows[i] for i in eval_pick]
    entry = CATALOG.get(task.dataset)

    if task.type == "classification":
        F.require_fields(train_rows, ("text", "label"), where_train)
        F.require_fields(eval_rows, ("text", "label"), where_eval)
        y_train, y_eval, names = F.class_labels(train_rows, eval_rows, where_train)
        return TaskData(
            "classification",
            F.encode_classification(train_rows, y_train, tokenizer, task.max_length, where_train),
            F.encode_classification(eval_rows, y_eval, tokenizer, task.max_length, where_eval),
            np.asarray(y_train, dtype=np.int64),
            len(names),
            names,
            len(eval_rows),
            None,
        )
    if task.type == "generation":
        template = task.prompt_template or (entry.prompt_template if entry else None) or F.DEFAULT_GENERATION_TEMPLATE
        kw2 = dict(
            encoder_decoder=encoder_decoder, template=template, max_length=task.max_length,
            max_target_length=task.max_target_length,
        )
        return TaskData(
            "generation",
            F.encode_generation(train_rows, tokenizer, where=where_train, **kw2),
            F.encode_generation_eval(eval_rows, tokenizer, where=where_eval, **kw2),
            None, None, None, len(eval_rows), template,
        )
    if task.type == "multiple_choice":
        template = F.choice_template(train_rows, task.prompt_template or (entry.prompt_template if entry else None))
        kw3 = dict(encoder_decoder=encoder_decoder, template=template, max_length=task.max_length)
        return TaskData(
            "multiple_choice",
            F.encode_choice_train(train_rows, tokenizer, where=where_train, **kw3),
            F.encode_choice_eval(eval_rows, tokenizer, where=where_eval, **kw3),
            None, None, None, len(eval_rows), template,
        )
    raise DataError(f"task.type {task.type!r} is not supported")
