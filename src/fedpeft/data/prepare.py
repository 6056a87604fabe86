"""From a task config to tokenised train / eval data (tokenised once per run)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from fedpeft.config.schema import TaskConfig
from fedpeft.data import chat as C
from fedpeft.data import features as F
from fedpeft.data import validate as V
from fedpeft.data.batching import Encoded, ImageEncoded
from fedpeft.data.catalog import prompt_template
from fedpeft.data.sources import DataError, load_rows, shared_rows

log = logging.getLogger("fedpeft")
EvalSet = Encoded | ImageEncoded | F.GenerationEval | F.ChoiceEval | C.InstructionEval


@dataclass
class TaskData:
    task_type: str
    train: Encoded | ImageEncoded
    eval: EvalSet
    train_labels: np.ndarray | None  # class labels (classification only), for label-skew partitions
    num_labels: int | None
    label_names: list[str] | None
    num_eval_examples: int
    template: str | None
    label_kind: str | None = None  # classification: "names" (string labels) or "ids" (integer labels)
    chat_template_source: str | None = None  # instruction: "config", "tokenizer" or "builtin" (data.chat.SOURCES)
    # the training examples encoded for evaluation, aligned with ``train`` (prepare_task(train_eval=True)), from
    # which each client's held-out slice is scored under eval.personalized
    train_eval: EvalSet | None = None


def subset_eval(data: EvalSet, idx: np.ndarray) -> EvalSet:
    """The examples ``idx`` (positions) of an evaluation set, of whichever kind."""
    idx = np.asarray(idx, dtype=np.int64)
    if isinstance(data, (Encoded, ImageEncoded)):
        return data.subset(idx)
    if isinstance(data, F.ChoiceEval):
        where = {int(e): i for i, e in enumerate(idx)}
        rows = [j for j, e in enumerate(data.example_index) if int(e) in where]
        return F.ChoiceEval(data.sequences.subset(np.asarray(rows, dtype=np.int64)),
                            np.asarray([where[int(data.example_index[j])] for j in rows], dtype=np.int64),
                            data.choice_chars[rows], data.gold[idx],
                            data.num_choices[idx] if len(data.num_choices) else data.num_choices)
    refs = [data.references[int(i)] for i in idx]
    return replace(data, prompts=data.prompts.subset(idx), references=refs,
                               teacher_forced=data.teacher_forced.subset(idx))


def _seeded_subset(n: int, k: int | None, seed: int) -> np.ndarray:
    if k is None or k >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).permutation(n)[:k])


def _check_split(task_type: str, rows: list, origins: list[V.Origin], template: str | None, where: str,
                 instruction: str | None = None) -> None:
    """Every row of a split a run reads, before any subsetting (so the answer does not depend on the seed)."""
    if not rows:
        raise DataError(f"{where}: no rows")
    problem = next(V.problems(task_type, rows, origins, template, instruction=instruction), None)
    if problem is not None:
        raise DataError(problem)
    unlabeled = V.unlabeled(task_type, rows, origins)
    if unlabeled is not None:
        raise DataError(f"{unlabeled}; a run trains and evaluates on labeled rows only: choose a labeled split, "
                        "or drop those rows")
    floats = V.float_labels(rows, origins) if task_type != "generation" else None
    if floats is not None:
        log.warning(floats)
    padded = V.padded_labels(rows, origins) if task_type == "classification" else None
    if padded is not None:
        log.warning(padded)


def prepare_task(
    task: TaskConfig,
    tokenizer,
    *,
    encoder_decoder: bool,
    seed: int,
    eval_max_examples: int | None,
    train_eval: bool = False,
) -> TaskData:
    """Reads the train and eval splits, checks every row of both (:mod:`fedpeft.data.validate`), then takes
    the seeded subsets and tokenises them. Class labels are numbered over the whole train split. With
    ``train_eval`` the training examples are also encoded for evaluation (``TaskData.train_eval``)."""
    if task.type not in V.TASK_FIELDS:
        raise DataError(f"task.type {task.type!r} is not supported")
    _check_causal(task, encoder_decoder)
    kw = {"dataset_config": task.dataset_config, "data_dir": task.data_dir, "columns": task.columns,
              "shuffle_seed": task.split_shuffle_seed}
    train_spans: dict[str, list[tuple[int, int]]] = {}
    eval_spans: dict[str, list[tuple[int, int]]] = {}
    train_origins: list[V.Origin] = []
    eval_origins: list[V.Origin] = []
    train_rows = load_rows(task.dataset, task.train_split, spans=train_spans, origins=train_origins, **kw)
    eval_rows = load_rows(task.dataset, task.eval_split, spans=eval_spans, origins=eval_origins, **kw)
    shared = shared_rows(train_spans, eval_spans)
    if shared is not None:
        raise DataError(
            f"task.train_split {task.train_split!r} and task.eval_split {task.eval_split!r} share rows (of "
            f"{shared}); carve disjoint parts of one split, e.g. 'test[:80%]' and 'test[80%:]'"
        )
    where_train = f"dataset {task.dataset!r} split {task.train_split!r}"
    where_eval = f"dataset {task.dataset!r} split {task.eval_split!r}"
    template = prompt_template(task.type, task.dataset, train_rows, task.prompt_template)
    _check_split(task.type, train_rows, train_origins, template, where_train, task.instruction)
    _check_split(task.type, eval_rows, eval_origins, template, where_eval, task.instruction)
    if task.type in ("classification", "image_classification"):
        y_train, y_eval, names = F.class_labels(train_rows, eval_rows, train_origins, eval_origins, task.train_split)
    pick = _seeded_subset(len(train_rows), task.max_train_examples, seed)
    train_rows = [train_rows[i] for i in pick]
    eval_pick = _seeded_subset(len(eval_rows), eval_max_examples, seed + 1)
    eval_rows = [eval_rows[i] for i in eval_pick]
    if task.type == "instruction":
        origins = [train_origins[i] for i in pick]
        data = _instruction_task(task, tokenizer, train_rows, origins, eval_rows,
                                 [eval_origins[i] for i in eval_pick], where_train, where_eval)
        if train_eval:
            fmt = C.chat_format(tokenizer, task.chat_template)
            data.train_eval = C.encode_instruction_eval(train_rows, origins, tokenizer, fmt, where=where_train,
                                                        max_length=task.max_length, instruction=task.instruction)
        return data
    if task.type == "image_classification":
        from fedpeft.data.images import encode_images

        y_train = [y_train[i] for i in pick]
        y_eval = [y_eval[i] for i in eval_pick]
        images = encode_images(train_rows, y_train, [V.at(train_origins[i]) for i in pick], tokenizer,
                               max_pixels=task.max_image_pixels)
        return TaskData(
            "image_classification", images,
            encode_images(eval_rows, y_eval, [V.at(eval_origins[i]) for i in eval_pick], tokenizer,
                          max_pixels=task.max_image_pixels),
            np.asarray(y_train, dtype=np.int64), len(names), names, len(eval_rows), None,
            "names" if isinstance(V.class_id(train_rows[0]["label"]), str) else "ids",
            train_eval=images if train_eval else None,
        )
    if task.type == "classification":
        y_train = [y_train[i] for i in pick]
        y_eval = [y_eval[i] for i in eval_pick]
        encoded = F.encode_classification(train_rows, y_train, tokenizer, task.max_length, where_train)
        return TaskData(
            "classification",
            encoded,
            F.encode_classification(eval_rows, y_eval, tokenizer, task.max_length, where_eval),
            np.asarray(y_train, dtype=np.int64),
            len(names),
            names,
            len(eval_rows),
            None,
            "names" if isinstance(V.class_id(train_rows[0]["label"]), str) else "ids",
            train_eval=encoded if train_eval else None,
        )
    if task.type == "generation":
        kw2 = {
            "encoder_decoder": encoder_decoder, "template": template, "max_length": task.max_length,
            "max_target_length": task.max_target_length,
        }
        return TaskData(
            "generation",
            F.encode_generation(train_rows, tokenizer, where=where_train, **kw2),
            F.encode_generation_eval(eval_rows, tokenizer, where=where_eval, **kw2),
            None, None, None, len(eval_rows), template,
            train_eval=F.encode_generation_eval(train_rows, tokenizer, where=where_train, **kw2) if train_eval else None,
        )
    kw3 = {"encoder_decoder": encoder_decoder, "template": template, "max_length": task.max_length}
    return TaskData(
        "multiple_choice",
        F.encode_choice_train(train_rows, tokenizer, where=where_train, **kw3),
        F.encode_choice_eval(eval_rows, tokenizer, where=where_eval, **kw3),
        None, None, None, len(eval_rows), template,
        train_eval=F.encode_choice_eval(train_rows, tokenizer, where=where_train, **kw3) if train_eval else None,
    )


def _check_causal(task: TaskConfig, encoder_decoder: bool) -> None:
    if task.type == "instruction" and encoder_decoder:
        raise DataError("task.type instruction trains a decoder-only (causal) language model on chat-formatted "
                        "conversations; set model.name to a causal LM (smollm2-135m, tiny-llama, tiny-gpt2)")


def _instruction_task(task: TaskConfig, tokenizer, train_rows: list, train_origins: list[V.Origin], eval_rows: list,
                      eval_origins: list[V.Origin], where_train: str, where_eval: str) -> TaskData:
    """Instruction data: the chat template chosen once (:func:`fedpeft.data.chat.chat_format`) and recorded as the
    run's template; training sequences and the eval conversations, loss on the assistant's tokens only."""
    fmt = C.chat_format(tokenizer, task.chat_template)
    C.announce(fmt)
    kw = {"max_length": task.max_length, "instruction": task.instruction}
    return TaskData(
        "instruction",
        C.encode_instruction(train_rows, train_origins, tokenizer, fmt, where=where_train, **kw),
        C.encode_instruction_eval(eval_rows, eval_origins, tokenizer, fmt, where=where_eval, **kw),
        None, None, None, len(eval_rows), fmt.template, chat_template_source=fmt.source,
    )


@dataclass
class EvalData:
    """One split tokenised for evaluation outside a run (``fedpeft eval``); ``rows`` and ``origins`` are the
    evaluated rows as read and where each comes from (file, split part, 1-based row)."""

    task_type: str
    eval: EvalSet
    rows: list
    origins: list[V.Origin]
    label_names: list[str] | None


def eval_class_ids(rows: list, origins: list[V.Origin], label_names: list[str], label_kind: str | None) -> list[int]:
    """The class ids of a split's labels for a model trained with ``label_names``: a model trained on class
    names ("names") is scored on names, looked up among them; one trained on class ids ("ids") on ids below
    their number (None: either, from adapters saved before the kind was recorded)."""
    index = {n: i for i, n in enumerate(label_names)}
    out = []
    for row, origin in zip(rows, origins):
        value = V.class_id(row["label"])
        wanted = {"names": str, "ids": int}.get(label_kind or "")
        if value is not None and wanted is not None and not isinstance(value, wanted):
            what = "class names (strings)" if wanted is str else "class ids (integers)"
            raise DataError(f"{V.at(origin)}: label {V.show(row['label'])} is not of the kind the model was trained "
                            f"on, {what}; write the labels as the training data did")
        if isinstance(value, str):
            if value not in index:
                raise DataError(f"{V.at(origin)}: label {value!r} is not a class of the trained model "
                                f"({V.show(label_names, 200)}){V.whitespace_hint(value, label_names)}; evaluate on a "
                                "split with the same classes")
            out.append(index[value])
        elif value is not None and 0 <= value < len(label_names):
            out.append(int(value))
        else:
            raise DataError(f"{V.at(origin)}: label {V.show(row['label'])} is not a class id of the trained model "
                            f"(0..{len(label_names) - 1}); evaluate on a split with the same classes")
    return out


def prepare_eval(task: TaskConfig, split: str, tokenizer, *, encoder_decoder: bool, seed: int,
                 max_examples: int | None, label_names: list[str] | None, label_kind: str | None = None,
                 template: str | None = None) -> EvalData:
    """``split`` of ``task.dataset`` checked row by row as a run's eval split is, then (with ``max_examples``)
    the same seeded subset a run with that ``eval.max_examples`` evaluates, tokenised. Classification labels
    are mapped onto the trained model's ``label_names`` (of ``label_kind``); ``template`` is the prompt the
    run used (instruction: its chat template). Any split may be given, the train split included."""
    if task.type not in V.TASK_FIELDS:
        raise DataError(f"task.type {task.type!r} is not supported")
    _check_causal(task, encoder_decoder)
    origins: list[V.Origin] = []
    rows = load_rows(task.dataset, split, dataset_config=task.dataset_config, data_dir=task.data_dir,
                     columns=task.columns, shuffle_seed=task.split_shuffle_seed, origins=origins)
    where = f"dataset {task.dataset!r} split {split!r}"
    template = template or prompt_template(task.type, task.dataset, rows, task.prompt_template)
    _check_split(task.type, rows, origins, None if task.type == "instruction" else template, where, task.instruction)
    pick = _seeded_subset(len(rows), max_examples, seed + 1)
    rows, origins = [rows[i] for i in pick], [origins[i] for i in pick]
    if task.type in ("classification", "image_classification"):
        if not label_names:
            raise DataError("the adapter names no classes (fedpeft_adapter.json has no label_names)")
        ids = eval_class_ids(rows, origins, label_names, label_kind)
        if task.type == "image_classification":
            from fedpeft.data.images import encode_images

            data: EvalSet = encode_images(rows, ids, [V.at(o) for o in origins], tokenizer,
                                          max_pixels=task.max_image_pixels)
        else:
            data = F.encode_classification(rows, ids, tokenizer, task.max_length, where)
    elif task.type == "instruction":
        fmt = C.chat_format(tokenizer, template or task.chat_template)
        data = C.encode_instruction_eval(rows, origins, tokenizer, fmt, max_length=task.max_length, where=where,
                                         instruction=task.instruction)
    elif task.type == "generation":
        data = F.encode_generation_eval(rows, tokenizer, where=where, encoder_decoder=encoder_decoder,
                                        template=template, max_length=task.max_length,
                                        max_target_length=task.max_target_length)
    else:
        data = F.encode_choice_eval(rows, tokenizer, where=where, encoder_decoder=encoder_decoder, template=template,
                                    max_length=task.max_length)
    return EvalData(task.type, data, rows, origins, label_names)


# --- the partition column (federation.partition.column) --------------------------------------------


def train_column(task: TaskConfig, column: str, seed: int) -> np.ndarray:
    """The value of ``column`` for each training example, as text, in the order of :func:`prepare_task`'s
    ``TaskData.train`` (the train split read the same way, then the same seeded ``max_train_examples``
    subset). ``column`` is a field of the rows (after ``task.columns``) or one the catalog entry derives
    (e2e_nlg: the MR attributes, e.g. ``eat_type``). Null, blank or absent values are the category
    :data:`~fedpeft.data.partition.MISSING`; a list or object is refused (file, split, row and fix), and so
    is a column that no row has."""
    from fedpeft.data.catalog import dataset_entry
    from fedpeft.data.partition import MISSING

    origins: list[V.Origin] = []
    rows = load_rows(task.dataset, task.train_split, dataset_config=task.dataset_config, data_dir=task.data_dir,
                     columns=task.columns, shuffle_seed=task.split_shuffle_seed, origins=origins)
    entry = dataset_entry(task.dataset)
    derive = entry.deriver() if entry is not None else None
    values: list[str] = []
    found = False
    for row, origin in zip(rows, origins):
        if column in row:
            value, found = row[column], True
        else:
            derived = derive(row) if derive is not None else {}
            value, found = derived.get(column), found or column in derived
        text = _category(value)
        if text is None:
            raise DataError(f"{V.at(origin)}: federation.partition.column {column!r} is {V.show(value)}; a "
                            "partition column holds one string or number per row: choose another column")
        if text == MISSING:
            raise DataError(f"{V.at(origin)}: federation.partition.column {column!r} is {MISSING!r}, the name "
                            "fedpeft gives rows without a value; rename that value in your data")
        values.append(text or MISSING)
    if not found:
        fields = sorted({k for r in rows[:100] for k in r} | set(entry.derived_names if entry else ()))
        raise DataError(f"dataset {task.dataset!r} split {task.train_split!r}: no row has the field {column!r} "
                        f"named by federation.partition.column; fields: {', '.join(fields)}")
    pick = _seeded_subset(len(rows), task.max_train_examples, seed)
    out = np.array([values[i] for i in pick], dtype=str)
    missing = int((out == MISSING).sum())
    if missing:
        logging.getLogger("fedpeft").warning(
            "federation.partition.column %r: %d of %d training rows have no value; they form the category %r",
            column, missing, len(out), MISSING)
    return out


def _category(value) -> str | None:
    """A partition column value as text: "" for null, blank or NaN (the missing category), None for a value
    that is not one string or number."""
    if isinstance(value, np.generic):  # parquet cells
        value = value.item()
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value.strip()
    return None
