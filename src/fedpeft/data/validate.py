"""Checks of every row a run reads, before any subsetting: one pass over the row dicts, no tokenization.

A problem is one line that names the file (or Hub split), the split as written, the 1-based row in that
file and the fix. The rules ("Data checks" in docs/guide/data.md):

* Text fields (``text``, ``input``, ``target``, ``question``, every entry of ``choices``, each of
  ``references``) must be non-empty strings: null, numbers, lists and empty or blank strings are refused.
  ``text_pair`` may be null or empty (no second segment); ``context`` may be empty but must be a string.
  Every field the prompt template names must be present and not null.
* Classification labels are either all integers (class ids 0..K-1, -1 marks an unlabeled row) or all
  strings (class names, numbered by sorted name). A mix is refused, also ``"3"`` among integers. Booleans,
  null, other negative numbers and fractional floats are refused; whole-number floats (``1.0``) are read as
  integers, with a warning. Class names are taken as written: two that differ only by surrounding whitespace
  (``"positive"``, ``"positive "``) are refused; a padded name without such a twin is kept, with a warning.
  A train split must hold at least 2 classes (:func:`fedpeft.data.features.class_labels`).
* Multiple-choice labels are integer indexes into the row's ``choices`` (at least 2); -1 marks an
  unlabeled row.
* Instruction rows are a conversation, ``messages``: a list of ``{role, content}`` objects (roles system, user,
  assistant; an optional system message first, then user and assistant turns alternating, starting with the
  user and ending with the assistant; every content a non-empty string), or an instruction record:
  ``instruction`` (or ``task.instruction``), optional ``input`` (a string, may be empty or null) and ``output``
  (or ``target``); not both forms in one row. ``references`` is checked as for generation.
"""

from __future__ import annotations

import math
import string
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fedpeft.data.catalog import TASK_FIELDS, Row

Origin = tuple[str, str, int]  # (file or Hub split, split part as written, 1-based row in that file)
ROLES = ("system", "user", "assistant")
RECORD_FIELDS = ("instruction", "input", "output", "target")  # an instruction record's fields


def at(origin: Origin) -> str:
    source, part, row = origin
    return f"{source}: split {part!r} row {row}"


def show(value: Any, width: int = 40) -> str:
    """A value as it would be written in Python, on one line and at most ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def infer_task_type(rows: list[Row]) -> str | None:
    """The task type a split's fields fit (for ``fedpeft data`` on a dataset outside the catalog)."""
    fields = {k for r in rows[:100] for k in r}
    if "image" in fields:
        return "image_classification"
    if "messages" in fields or {"instruction", "output"} <= fields:
        return "instruction"
    if "choices" in fields:
        return "multiple_choice"
    if {"input", "target"} <= fields:
        return "generation"
    if "text" in fields:
        return "classification"
    return None


def template_fields(template: str | None) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template or "") if name]


# --- one value -------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", tuple: "a list", dict: "an object", str: "a string"}.get(type(value), f"a {type(value).__name__}")


def _text(field: str, value: Any, *, blank_ok: bool = False) -> str | None:
    if isinstance(value, str):
        if value.strip() or blank_ok:
            return None
        return f"{field!r} is empty; fill it in or drop the row"
    if value is None:
        return f"{field!r} is null; fill it in or drop the row"
    return f"{field!r} is {_kind(value)} ({show(value)}), not a string; write it as text (in quotes in JSON)"


def class_id(value: Any) -> int | str | None:
    """A valid classification label as an int (whole-number floats included) or a str; None if invalid."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value if value >= -1 else None
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() and value >= -1 else None
    if isinstance(value, str):
        return value if value.strip() else None
    return None


def _label(value: Any) -> str | None:
    if class_id(value) is not None:
        return None
    if value is None:
        return "label is null; give every row its class (or -1 for an unlabeled row)"
    if isinstance(value, bool):
        return f"label {value} is a boolean; write the class as an integer (1 for true, 0 for false) or a name"
    if isinstance(value, (int, float)) and (not isinstance(value, float) or value.is_integer()):
        return f"label {show(value)} is negative; class ids are 0..K-1 (-1 marks an unlabeled row)"
    if isinstance(value, float):
        return f"label {show(value)} is not a whole number; class ids are integers 0..K-1 (or use class names)"
    if isinstance(value, str):
        return "label is an empty string; give every row its class"
    return f"label is {_kind(value)} ({show(value)}); give one class per row, an integer id or a name"


def _choice_label(value: Any, n: int) -> str | None:
    index = class_id(value)
    if isinstance(index, int) and (index == -1 or 0 <= index < n):
        return None
    fix = f"give the index of the gold choice, 0..{n - 1} (-1 marks an unlabeled row)"
    whole = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    if whole:
        return f"label {show(value)} is not an index into its {n} choices; {fix}"
    return f"label {show(value)} is {_kind(value)}; {fix}"


# --- one row ---------------------------------------------------------------------------------------


def _classification_row(row: Row) -> str | None:
    pair = row.get("text_pair")
    return (_text("text", row["text"]) or _label(row["label"])
            or (None if pair is None else _text("text_pair", pair, blank_ok=True)))


def _is_pil_image(value: Any) -> bool:
    image_module = sys.modules.get("PIL.Image")  # a PIL image exists only if PIL was imported
    return image_module is not None and isinstance(value, image_module.Image)


def _image_row(row: Row) -> str | None:
    """The image's form (it is decoded, strictly, when the split is encoded) and the label."""
    image = row["image"]
    if isinstance(image, dict):
        if image.get("bytes") is None and not image.get("path"):
            return "image has neither bytes nor a path; give each row its image"
    elif not (isinstance(image, (bytes, str)) and image) and not _is_pil_image(image):
        return (f"image is {_kind(image)} ({show(image)}); give the image's bytes, its path, a PIL image or the "
                "Hub's image form {'bytes': ..., 'path': ...}")
    return _label(row["label"])


def _generation_row(row: Row) -> str | None:
    refs = row.get("references")
    if refs is not None and not isinstance(refs, (list, tuple)):
        return f"'references' is {_kind(refs)} ({show(refs)}); give a list of strings (or null to use 'target')"
    return (_text("input", row["input"]) or _text("target", row["target"])
            or next((p for p in (_text("references entry", r) for r in refs or ()) if p), None))


def _choice_row(row: Row) -> str | None:
    choices = row["choices"]
    if not isinstance(choices, (list, tuple)) or len(choices) < 2:
        return f"'choices' is {show(choices)}; give a list of at least 2 strings"
    if "context" in row and not isinstance(row["context"], str):
        return _text("context", row["context"], blank_ok=True)
    return (_text("question", row["question"])
            or next((p for p in (_text(f"choice {i}", c) for i, c in enumerate(choices)) if p), None)
            or _choice_label(row["label"], len(choices)))


def _references(row: Row) -> str | None:
    refs = row.get("references")
    if refs is not None and not isinstance(refs, (list, tuple)):
        return f"'references' is {_kind(refs)} ({show(refs)}); give a list of strings (or null to use the response)"
    return next((p for p in (_text("references entry", r) for r in refs or ()) if p), None)


def _messages(messages: Any) -> str | None:
    if not isinstance(messages, (list, tuple)) or not messages:
        return (f"'messages' is {show(messages) if isinstance(messages, (list, tuple)) else _kind(messages)}; give a "
                "list of {\"role\": ..., \"content\": ...} objects (roles system, user, assistant)")
    expected = "user"
    for i, message in enumerate(messages):
        key = f"messages[{i}]"
        if not isinstance(message, dict):
            return f"{key} is {_kind(message)} ({show(message)}); give an object {{\"role\": ..., \"content\": ...}}"
        if "role" not in message or "content" not in message:
            missing = "role" if "role" not in message else "content"
            return (f"{key} has no {missing!r} (keys: {', '.join(sorted(map(str, message))) or 'none'}); give every "
                    "message a role (system, user or assistant) and a content")
        extra = sorted(map(str, set(message) - {"role", "content"}))
        if extra:
            return (f"{key} has {', '.join(repr(k) for k in extra)} besides role and content; fedpeft formats a "
                    "message from its role and content only and trains every assistant turn: remove the other keys")
        role = message["role"]
        if role not in ROLES:
            return (f"{key}.role is {show(role)}, not one of {', '.join(ROLES)}; rename the roles (e.g. human -> user, "
                    "gpt or bot -> assistant)")
        problem = _text(f"{key}.content", message["content"])
        if problem:
            return problem
        if role == "system":
            if i:
                return f"{key} is a system message after the first turn; put one system message first"
            continue
        if role != expected:
            return (f"{key}.role is {role!r} where {expected!r} was expected; alternate user and assistant turns, "
                    "starting with the user (merge consecutive turns of one role)")
        expected = "assistant" if role == "user" else "user"
    last = messages[-1]["role"]
    if last == "system":
        return "'messages' has no assistant message; a conversation needs the assistant's reply to train on"
    if last != "assistant":
        return (f"'messages' ends with a {last!r} message (messages[{len(messages) - 1}]); end every conversation "
                "with the assistant's reply (drop the turns after it)")
    return None


def _instruction_row(row: Row, instruction: str | None = None) -> str | None:
    """A conversation (``messages``) or an instruction record; ``instruction`` is task.instruction."""
    record = [f for f in RECORD_FIELDS if f in row]
    if "messages" in row:
        if record:
            return (f"has both 'messages' and {record[0]!r}; give one form per row: a conversation ('messages') or "
                    "an instruction record ('instruction', 'input', 'output')")
        return _messages(row["messages"]) or _references(row)
    if "output" in row and "target" in row:
        return ("has both 'output' and 'target'; an instruction record's response is one of them: drop one, or map "
                "one to another name with task.columns")
    if "output" not in row and "target" not in row:
        return (f"has neither 'messages' nor 'output' (fields: {', '.join(sorted(row))}); give a conversation "
                "('messages': [{role, content}, ...]) or an instruction record ('instruction', optional 'input', "
                "'output'); map yours with task.columns, e.g. --set task.columns.output=<your column>")
    if "instruction" in row:
        problem = _text("instruction", row["instruction"])
    elif not instruction:
        problem = (f"has no field 'instruction' (fields: {', '.join(sorted(row))}); add it, map yours with "
                   "task.columns, or set task.instruction to the instruction of every row")
    else:
        problem = None
    extra = row.get("input")
    return (problem or (None if extra is None else _text("input", extra, blank_ok=True))
            or _text("output" if "output" in row else "target", row["output" if "output" in row else "target"])
            or _references(row))


_ROW_CHECKS: dict[str, Callable[[Row], str | None]] = {
    "classification": _classification_row,
    "generation": _generation_row,
    "multiple_choice": _choice_row,
    "instruction": _instruction_row,
    "image_classification": _image_row,
}


def row_problem(task_type: str, row: Row, template_names: Iterable[str] = (), instruction: str | None = None,
                ) -> str | None:
    """The first problem of one row, without its location; None when the row is fine. ``instruction``:
    task.instruction (instruction rows)."""
    if task_type == "instruction":
        return _instruction_row(row, instruction)
    missing = [f for f in TASK_FIELDS[task_type] if f not in row]
    if missing:
        return (f"has no field {missing[0]!r} (fields: {', '.join(sorted(row))}); map yours with task.columns, "
                f"e.g. --set task.columns.{missing[0]}=<your column>")
    problem = _ROW_CHECKS[task_type](row)
    if problem:
        return problem
    for name in template_names:
        if row.get(name) is None:
            return (f"field {name!r}, used by the prompt template, is {'null' if name in row else 'missing'}; "
                    "fill it in, or change task.prompt_template")
    return None


# --- one split -------------------------------------------------------------------------------------


def _mixed_labels(rows: list[Row], origins: list[Origin]) -> str | None:
    """Integer and string class labels in one split: the first row of the rarer kind."""
    kinds = [type(class_id(r.get("label"))) for r in rows]
    counts = Counter(k for k in kinds if k in (int, str))
    if len(counts) < 2:
        return None
    rare = str if counts[str] <= counts[int] else int
    i = kinds.index(rare)
    j = kinds.index(int if rare is str else str)
    value = rows[i]["label"]
    fix = (f"write it as the number {class_id(value)}" if rare is str and value.strip().lstrip("+-").isdigit()
           else "use one kind: integer class ids 0..K-1 in every row, or class names in every row")
    return (f"{at(origins[i])}: label {show(value)} is {'a string' if rare is str else 'an integer'} but "
            f"{counts[int if rare is str else str]} other labels of the split are "
            f"{'integers' if rare is str else 'strings'} (e.g. row {origins[j][2]}: {show(rows[j]['label'])}); {fix}")


def _row_of(origin: Origin, other: Origin) -> str:
    """'row 7' when ``origin`` is in the file of ``other``, else its whole place."""
    return f"row {origin[2]}" if origin[0] == other[0] and origin[1] == other[1] else at(origin)


def _whitespace_twins(rows: list[Row], origins: list[Origin]) -> str | None:
    """Two class names of a split that differ only by surrounding whitespace ('positive' and 'positive '),
    which would be two classes: the first such pair, with the first row of each."""
    first_row: dict[str, int] = {}  # each class name -> its first row
    by_stripped: dict[str, str] = {}  # a stripped name -> the first class name that strips to it
    for i, row in enumerate(rows):
        label = row.get("label")
        if not isinstance(label, str) or label in first_row:
            continue
        first_row[label] = i
        twin = by_stripped.setdefault(label.strip(), label)
        if twin != label:
            j = first_row[twin]
            return (f"{at(origins[i])}: label {show(label)} differs from label {show(twin)} "
                    f"({_row_of(origins[j], origins[i])}) only by surrounding whitespace: they would be two classes; "
                    "write each class name one way (strip the whitespace around the labels)")
    return None


def whitespace_hint(label: Any, classes: Iterable[str]) -> str:
    """The words to add to a refusal when ``label`` matches a class name only once surrounding whitespace is
    stripped (from either of them): " (the classes have 'positive': write the label the same way)"; else ''."""
    if not isinstance(label, str):
        return ""
    twin = next((c for c in classes if isinstance(c, str) and c != label and c.strip() == label.strip()), None)
    return "" if twin is None else f" (the classes have {show(twin)}: write the label the same way)"


def padded_labels(rows: list[Row], origins: list[Origin]) -> str | None:
    """Where class names have surrounding whitespace but no twin without it (accepted as written, logged)."""
    marks = [i for i, r in enumerate(rows) if isinstance(r.get("label"), str) and r["label"] != r["label"].strip()]
    if not marks:
        return None
    names = {rows[i]["label"] for i in marks}
    return (f"{at(origins[marks[0]])}: label {show(rows[marks[0]]['label'])} has surrounding whitespace, kept as part "
            f"of the class name ({len(marks)} rows, {len(names)} class name{'s' * (len(names) != 1)}); an eval split "
            "must write them the same way")


def problems(task_type: str, rows: list[Row], origins: list[Origin], template: str | None = None, *,
             instruction: str | None = None) -> Iterator[str]:
    """Every problem of a split that a run refuses whatever role the split plays: one per bad row, then a
    mix of integer and string class labels, then two class names that differ only by surrounding whitespace.
    ``instruction``: task.instruction (instruction rows)."""
    absent = next((f for f in TASK_FIELDS[task_type] if rows and not any(f in r for r in rows)), None)
    if task_type == "instruction":
        absent = None if any(f in r for r in rows for f in ("messages", "output", "target")) else "messages"
    if absent is not None and task_type == "instruction":
        yield (f"{at(origins[0])}: has neither 'messages' nor 'output', nor has any other row of the split (fields: "
               f"{', '.join(sorted(rows[0]))}); give conversations ('messages') or instruction records ('instruction', "
               "'input', 'output'): map yours with task.columns, e.g. --set task.columns.output=<your column>")
        return
    if absent is not None:  # one line, not one per row
        yield (f"{at(origins[0])}: has no field {absent!r}, nor has any other row of the split (fields: "
               f"{', '.join(sorted(rows[0]))}); map yours with task.columns, e.g. --set task.columns.{absent}=<your column>")
        return
    names = template_fields(template)
    for row, origin in zip(rows, origins):
        problem = row_problem(task_type, row, names, instruction)
        if problem:
            yield f"{at(origin)}: {problem}"
    if task_type == "classification":
        yield from (p for p in (_mixed_labels(rows, origins), _whitespace_twins(rows, origins)) if p)
    elif task_type == "image_classification":
        yield from (p for p in (_mixed_labels(rows, origins),) if p)


def unlabeled(task_type: str, rows: list[Row], origins: list[Origin]) -> str | None:
    """Where a split has rows with label -1 (unlabeled): fine to show, refused for training and evaluation."""
    if task_type in ("generation", "instruction"):
        return None
    marks = [i for i, r in enumerate(rows) if class_id(r.get("label")) == -1]
    if not marks:
        return None
    return (f"{at(origins[marks[0]])}: label -1 marks an unlabeled row; the split has unlabeled rows "
            f"({len(marks)} of {len(rows)}, this is the first)")


def float_labels(rows: list[Row], origins: list[Origin]) -> str | None:
    """Where whole-number float labels (1.0) are read as integer class ids (an accepted, logged rule)."""
    marks = [i for i, r in enumerate(rows) if isinstance(r.get("label"), float) and class_id(r["label"]) is not None]
    if not marks:
        return None
    return (f"{at(origins[marks[0]])}: label {show(rows[marks[0]]['label'])} and {len(marks) - 1} more whole-number "
            "float labels are read as integer class ids")


def missing_class_ids(ids: Iterable[int], shown: int = 10) -> tuple[list[int], int]:
    """The smallest ``shown`` class ids in 0..max that no row uses (-1, unlabeled, left out) and how many are
    missing in all. Memory and time follow the number of distinct ids, not their values (a label 10**30 is
    one id, not 10**30)."""
    used = {i for i in ids if i >= 0}
    if not used:
        return [], 0
    count = max(used) + 1 - len(used)
    first: list[int] = []
    candidate = 0
    while len(first) < min(shown, count):  # the first gaps lie below len(used) + shown
        if candidate not in used:
            first.append(candidate)
        candidate += 1
    return first, count


def describe_missing(first: list[int], count: int, ids: Iterable[int]) -> str:
    """'never uses class id 0 (labels 1..6); subtract 1 from every label ...': the missing ids (``first`` of
    ``count``, from :func:`missing_class_ids`) and the fix."""
    used = [i for i in ids if i >= 0]
    low, high = min(used), max(used)
    shown = ", ".join(map(str, first)) + (f" and {count - len(first)} more" if count > len(first) else "")
    fix = "subtract 1 from every label (class ids start at 0)" if count == 1 and first == [0] else \
        "renumber the classes 0..K-1"
    ids_word = "class id" if count == 1 else "class ids"
    return f"never uses {ids_word} {shown} (labels {low}..{high}); {fix}, or give class names instead"


def one_class(rows: list[Row]) -> str | None:
    """'has one class (0, all 12 labeled rows)' for a split whose labeled rows all have one class, else None."""
    classes = {class_id(r.get("label")) for r in rows} - {None, -1}
    if len(classes) != 1:
        return None
    labeled = sum(class_id(r.get("label")) not in (None, -1) for r in rows)
    return f"has one class ({show(next(iter(classes)))}, all {labeled} labeled rows)"


# --- fedpeft data ----------------------------------------------------------------------------------


def _key(value: Any) -> tuple[Any, str]:
    """A label as a dictionary key that keeps 1, 1.0 and True apart."""
    plain = value if value is None or isinstance(value, (bool, int, float, str)) else show(value)
    return plain, type(value).__name__


def _order(key: tuple[Any, str]) -> tuple[int, int | float, str]:
    value = key[0]  # an int is compared as it is: float() of 10**400 overflows
    if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and not math.isnan(value)):
        return 0, value, key[1]
    return (1 if isinstance(value, str) else 2), 0, str(value)


def label_histogram(rows: list[Row]) -> str | None:
    """'0=negative: 10, 1=positive: 12' (numbers in order, then names, then anything else), or None."""
    counts = Counter(_key(r["label"]) for r in rows if "label" in r)
    if not counts:
        return None
    names: dict[tuple[Any, str], str] = {}
    for r in rows:
        if "label" in r and r.get("label_text"):
            names.setdefault(_key(r["label"]), str(r["label_text"]))
    return ", ".join(
        f"{k[0] if k[1] == 'int' else show(k[0])}{'=' + names[k] if k in names else ''}: {counts[k]}"
        for k in sorted(counts, key=_order)
    )


def report(task_type: str | None, rows: list[Row], origins: list[Origin], template: str | None,
           split: str) -> tuple[list[str], list[str]]:
    """(problems, notes) of one split for ``fedpeft data``. Problems are refused whatever role the split plays
    in a run; notes are fine to show: unlabeled rows (refused for training and evaluation), whole-number
    float labels (read as integers), class names with surrounding whitespace (kept as written), and one
    class only or class ids a split never uses (both refused for a train split)."""
    if not rows:
        return [f"split {split!r} has no rows"], []
    if task_type is None:
        return [], [("no task type fits these fields: classification reads text + label, generation input + "
                    "target, multiple_choice question + choices + label, instruction messages (or instruction + "
                    "output); map yours with task.columns")]
    found = list(problems(task_type, rows, origins, template))
    notes = []
    blank = unlabeled(task_type, rows, origins)
    if blank and all(class_id(r.get("label")) == -1 for r in rows):
        notes.append(f"unlabeled split (label -1 on all {len(rows)} rows): fine to show; a run does not train or "
                     "evaluate on it")
    elif blank:
        notes.append(f"{blank}: a run refuses to train or evaluate on this split")
    floats = float_labels(rows, origins) if task_type != "generation" else None
    if floats:
        notes.append(floats)
    if task_type not in ("classification", "image_classification") or found:
        return found, notes
    padded = padded_labels(rows, origins)
    if padded:
        notes.append(padded)
    files = ", ".join(sorted({o[0] for o in origins}))
    single = one_class(rows)
    if single:
        notes.append(f"{files}: split {split!r} {single} (refused as a train split)")
    ids = [i for i in (class_id(r.get("label")) for r in rows) if isinstance(i, int)]
    first, count = missing_class_ids(ids) if len(ids) == len(rows) else ([], 0)
    if count:
        notes.append(f"{files}: split {split!r} {describe_missing(first, count, ids)} (refused as a train split)")
    return found, notes
