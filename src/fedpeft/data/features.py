"""Tokenising rows once into model inputs, per task type.

* classification: ``tokenizer(text, text_pair)`` truncated to max_length; label = class index.
* generation: causal LM: ``prompt + target + eos`` with the loss on the target only; seq2seq:
  encoder ``prompt``, decoder ``target``. Evaluation keeps the prompt alone plus all references.
* multiple choice (log-likelihood scoring, as lm-evaluation-harness): one sequence per
  (question, choice): ``context + " " + choice``, the loss/score on the choice tokens only. Training
  uses the gold choice; evaluation scores every choice.

The context is truncated from the left so that the target / choice tokens always fit. Rows come checked
(:mod:`fedpeft.data.validate`, called by :func:`fedpeft.data.prepare.prepare_task`): text fields are strings,
labels valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedpeft.data import validate as V
from fedpeft.data.batching import Encoded
from fedpeft.data.sources import DataError, Row, require_fields
from fedpeft.data.validate import Origin


@dataclass
class GenerationEval:
    prompts: Encoded  # prompt only (labels unused)
    references: list[list[str]]
    teacher_forced: Encoded  # prompt + first reference, for the eval loss


@dataclass
class ChoiceEval:
    sequences: Encoded  # one per (example, choice)
    example_index: np.ndarray  # which example each sequence belongs to
    choice_chars: np.ndarray  # length in characters of each choice (for acc_norm)
    gold: np.ndarray  # gold choice per example
    num_choices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _ids(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def _format(template: str, row: Row, where: str) -> str:
    try:
        return template.format(**row)
    except KeyError as exc:
        raise DataError(
            f"{where}: task.prompt_template uses field {exc.args[0]!r} that the rows do not have "
            f"(fields: {', '.join(sorted(row))})"
        ) from None


# --- classification ------------------------------------------------------------------------------


def class_labels(
    train_rows: list[Row], eval_rows: list[Row], train_origins: list[Origin], eval_origins: list[Origin], train_split: str,
) -> tuple[list[int], list[int], list[str]]:
    """Integer labels for both splits (all their rows, before any subsetting) and the label names.

    The rows are already checked (:mod:`fedpeft.data.validate`). String labels are class names, numbered by
    sorted name; integer labels are class ids, and the train split must use every id in 0..max. The train
    split must have at least 2 classes. Eval labels must be classes of the train split."""
    raw_train = [V.class_id(r["label"]) for r in train_rows]
    raw_eval = [V.class_id(r["label"]) for r in eval_rows]
    train_kind = type(raw_train[0])
    for value, row, origin in zip(raw_eval, eval_rows, eval_origins):
        if type(value) is not train_kind:
            kinds = "strings (class names)" if train_kind is str else "integers (class ids)"
            raise DataError(f"{V.at(origin)}: eval split has label {V.show(row['label'])} but the train split "
                            f"{train_split!r} has labels that are {kinds}; use one kind of label in both splits")
    files = ", ".join(sorted({o[0] for o in train_origins}))
    single = V.one_class(train_rows)
    if single is not None:
        raise DataError(f"{files}: train split {train_split!r} {single}; a classifier needs at least 2 classes to "
                        "learn (a 1-class model scores accuracy 1.0 on anything): train on a split with every class")
    if train_kind is str:
        names = sorted(set(map(str, raw_train)))
        index = {n: i for i, n in enumerate(names)}
        for value, origin in zip(raw_eval, eval_origins):
            if value not in index:
                raise DataError(f"{V.at(origin)}: eval split has label {value!r} that the train split {train_split!r} "
                                f"never uses{V.whitespace_hint(value, names)}; train labels: {V.show(names, 200)}")
        return [index[str(v)] for v in raw_train], [index[str(v)] for v in raw_eval], names
    train = [int(v) for v in raw_train]
    evals = [int(v) for v in raw_eval]
    first, count = V.missing_class_ids(train)
    if count:
        raise DataError(f"{files}: train split {train_split!r} {V.describe_missing(first, count, train)}")
    num_labels = max(train) + 1
    for value, origin in zip(evals, eval_origins):
        if value >= num_labels:
            raise DataError(f"{V.at(origin)}: eval split has label {value} but the train split {train_split!r} only "
                            f"has 0..{num_labels - 1}; renumber the classes the same way in both splits")
    names_by_id: dict[int, str] = {}
    for r, v in zip(train_rows, train):
        names_by_id.setdefault(v, str(r.get("label_text", v)))
    names = [names_by_id.get(i, str(i)) for i in range(num_labels)]
    return train, evals, names


def encode_classification(rows: list[Row], labels: list[int], tokenizer, max_length: int, where: str) -> Encoded:
    require_fields(rows, ("text",), where)
    texts = [r["text"] for r in rows]
    has_pair = any(r.get("text_pair") is not None for r in rows)
    pairs = [r.get("text_pair") or "" for r in rows] if has_pair else None
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_length)
    tti = enc.get("token_type_ids")
    return Encoded(
        input_ids=[_ids(x) for x in enc["input_ids"]],
        labels=list(labels),
        token_type_ids=[_ids(x) for x in tti] if tti is not None else None,
    )


# --- language-model helpers ------------------------------------------------------------------------


def leading_special_ids(tokenizer) -> list[int]:
    """The BOS-like id the tokenizer puts before a text (none for many decoders); trailing specials such as
    [SEP] or an eos are left out."""
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    ends = {tokenizer.eos_token_id, tokenizer.sep_token_id} - {None}
    return [t for t in prefix if t not in ends][:1]


def _special_ids(tokenizer) -> tuple[list[int], int]:
    """(prefix ids the tokenizer adds, eos id)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.sep_token_id
    if eos is None:
        raise DataError("the tokenizer has neither an eos nor a sep token; generation needs one")
    return leading_special_ids(tokenizer), int(eos)


def _causal_pair(prefix: list[int], ctx: list[int], tgt: list[int], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    budget = max_length - len(prefix) - len(tgt)
    if budget < 0:
        tgt = tgt[: max_length - len(prefix)]
        budget = 0
    ctx = ctx[-budget:] if budget > 0 else []
    ids = prefix + ctx + tgt
    labels = [-100] * (len(prefix) + len(ctx)) + tgt
    return _ids(ids), np.asarray(labels, dtype=np.int64)


def _texts(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


# --- generation ------------------------------------------------------------------------------------


def encode_generation(
    rows: list[Row], tokenizer, *, encoder_decoder: bool, template: str, max_length: int,
    max_target_length: int, where: str,
) -> Encoded:
    require_fields(rows, ("input", "target"), where)
    prompts = [_format(template, r, where) for r in rows]
    targets = [r["target"] for r in rows]
    if encoder_decoder:
        enc = tokenizer(prompts, truncation=True, max_length=max_length)
        tgt = tokenizer(text_target=targets, truncation=True, max_length=max_target_length)
        return Encoded([_ids(x) for x in enc["input_ids"]], [np.asarray(t, dtype=np.int64) for t in tgt["input_ids"]])
    prefix, eos = _special_ids(tokenizer)
    ctx = _texts(tokenizer, prompts)
    tgt = [t[: max_target_length - 1] + [eos] for t in _texts(tokenizer, targets)]
    pairs = [_causal_pair(prefix, c, t, max_length) for c, t in zip(ctx, tgt)]
    return Encoded([p[0] for p in pairs], [p[1] for p in pairs])


def encode_generation_eval(
    rows: list[Row], tokenizer, *, encoder_decoder: bool, template: str, max_length: int,
    max_target_length: int, where: str,
) -> GenerationEval:
    require_fields(rows, ("input", "target"), where)
    refs = [list(r.get("references") or [r["target"]]) for r in rows]
    teacher = encode_generation(
        rows, tokenizer, encoder_decoder=encoder_decoder, template=template, max_length=max_length,
        max_target_length=max_target_length, where=where,
    )
    prompts = [_format(template, r, where) for r in rows]
    if encoder_decoder:
        enc = tokenizer(prompts, truncation=True, max_length=max_length)
        prompt_ids = [_ids(x) for x in enc["input_ids"]]
    else:
        prefix, _ = _special_ids(tokenizer)
        prompt_ids = [_ids(prefix + c[-(max_length - len(prefix)) :]) for c in _texts(tokenizer, prompts)]
    return GenerationEval(Encoded(prompt_ids, [0] * len(prompt_ids)), refs, teacher)


# --- multiple choice -------------------------------------------------------------------------------


def _choice_sequences(
    rows: list[Row], tokenizer, encoder_decoder: bool, template: str, max_length: int, where: str,
    gold_only: bool,
) -> tuple[Encoded, list[int], list[int]]:
    contexts = [_format(template, r, where) for r in rows]
    example_index, chars, conts, ctx_of = [], [], [], []
    for i, r in enumerate(rows):
        choices = [r["choices"][int(r["label"])]] if gold_only else list(r["choices"])
        for c in choices:
            conts.append(" " + c)
            chars.append(len(" " + c))
            example_index.append(i)
            ctx_of.append(i)
    if encoder_decoder:
        enc = tokenizer(contexts, truncation=True, max_length=max_length)["input_ids"]
        tgt = tokenizer(text_target=[c.strip() for c in conts], truncation=True, max_length=max_length)["input_ids"]
        data = Encoded([_ids(enc[j]) for j in ctx_of], [np.asarray(t, dtype=np.int64) for t in tgt])
        return data, example_index, chars
    prefix, _ = _special_ids(tokenizer)
    ctx_ids = _texts(tokenizer, contexts)
    cont_ids = _texts(tokenizer, conts)
    pairs = [_causal_pair(prefix, ctx_ids[j], t, max_length) for j, t in zip(ctx_of, cont_ids)]
    return Encoded([p[0] for p in pairs], [p[1] for p in pairs]), example_index, chars


def encode_choice_train(
    rows: list[Row], tokenizer, *, encoder_decoder: bool, template: str, max_length: int, where: str
) -> Encoded:
    require_fields(rows, ("question", "choices", "label"), where)
    data, _, _ = _choice_sequences(rows, tokenizer, encoder_decoder, template, max_length, where, gold_only=True)
    return data


def encode_choice_eval(
    rows: list[Row], tokenizer, *, encoder_decoder: bool, template: str, max_length: int, where: str
) -> ChoiceEval:
    require_fields(rows, ("question", "choices", "label"), where)
    data, example_index, chars = _choice_sequences(
        rows, tokenizer, encoder_decoder, template, max_length, where, gold_only=False
    )
    return ChoiceEval(
        sequences=data,
        example_index=np.asarray(example_index, dtype=np.int64),
        choice_chars=np.asarray(chars, dtype=np.int64),
        gold=np.asarray([int(r["label"]) for r in rows], dtype=np.int64),
        num_choices=np.asarray([len(r["choices"]) for r in rows], dtype=np.int64),
    )
