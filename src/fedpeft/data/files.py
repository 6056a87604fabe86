"""Reading one data file strictly: its rows as written, or one line naming the file, the row (and line, or
byte offset) where the problem is, the problem and the fix.

Files: ``.jsonl`` / ``.jsonl.gz`` (one JSON object per line, blank lines skipped), ``.json`` (one JSON list
of objects), ``.csv`` / ``.tsv`` (a header row, then one row per line; blank lines skipped) and ``.parquet``.
Rows are numbered from 1 in the file as read. CSV and TSV cells are read as text, except the label column:
an integer (``3``) or a decimal number (``1.5``) becomes a number, an empty cell is null, any other text is a
class name. TSV has no quoting.

Nothing is silently reinterpreted:

* text must be UTF-8 (a JSON-lines, JSON, CSV or TSV file);
* a key given twice in one JSON object is refused (a JSON parser keeps the last value);
* a CSV or TSV row has one cell per header column and lies on one line: a quoted CSV cell may hold commas
  and doubled quotes but not a line break, so a quote left open cannot swallow the rows after it; a header
  that names a column twice is refused;
* damaged ``.jsonl.gz`` data (truncated, failed CRC, not gzip) and damaged parquet files are refused.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from fedpeft.data.catalog import Row
from fedpeft.data.validate import show
from fedpeft.errors import UserError

FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".csv", ".tsv", ".parquet")
_CSV_FIELD_LIMIT = 2**31 - 1  # csv's default (128 KiB) is below a long document's length; pandas had no limit
_UTF8_FIX = "save the file as UTF-8 (e.g. iconv -f <its encoding> -t utf-8), or correct that byte"
_RECOPY_FIX = "copy or download it again (gzip -t FILE checks a gzip file)"


class DataError(UserError, ValueError):
    """A problem with the data: missing file, column or label. One line, naming the fix."""


def read_file(path: Path, label_column: str = "label") -> list[Row]:
    """Rows of a jsonl / jsonl.gz / json / csv / tsv / parquet file."""
    name = path.name.lower()
    try:
        if name.endswith((".jsonl", ".jsonl.gz")):
            return _read_jsonl(path)
        if name.endswith(".json"):
            return _read_json(path)
        if name.endswith((".csv", ".tsv")):
            return _read_table(path, label_column)
        if name.endswith(".parquet"):
            return _read_parquet(path)
    except OSError as exc:  # unreadable file (permissions, a directory, I/O error); gzip's own errors are handled
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc}); check the path and its permissions") from None
    raise DataError(f"{path}: unsupported file type; use one of {', '.join(FILE_SUFFIXES)}")


# --- text ------------------------------------------------------------------------------------------


def _decode(path: Path, data: bytes, *, bom: bool = False) -> str:
    """``data`` as UTF-8 text (``bom``: a leading byte-order mark dropped), or the line and byte that are not."""
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _not_utf8(path, line, exc.start, data[exc.start]) from None


def _not_utf8(path: Path, line: int, offset: int, byte: int, compressed: bool = False) -> DataError:
    where = f"offset {offset}{' of the uncompressed data' if compressed else ''}"
    return DataError(f"{path}: line {line}: not UTF-8 text (byte 0x{byte:02x} at {where}); {_UTF8_FIX}")


def _find_not_utf8(path: Path, compressed: bool) -> DataError:
    """The first line of a JSON-lines file that is not UTF-8, read again as bytes (only after a failure)."""
    offset, lineno = 0, 0
    try:
        with (gzip.open if compressed else open)(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return _not_utf8(path, lineno, offset + exc.start, raw[exc.start], compressed)
                offset += len(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        return _gzip_problem(path, lineno, exc)
    return DataError(f"{path}: not UTF-8 text; {_UTF8_FIX}")  # not found again: the file changed meanwhile


def _gzip_problem(path: Path, after_line: int, exc: Exception) -> DataError:
    """A truncated, damaged or not-gzip ``.jsonl.gz`` file."""
    if isinstance(exc, EOFError):
        return DataError(f"{path}: the compressed data ends early, after line {after_line}: the file is truncated; "
                         f"{_RECOPY_FIX}")
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in text:
        return DataError(f"{path}: not gzip-compressed data ({text}); if it is plain JSON lines name it .jsonl, "
                         "else compress it with gzip")
    return DataError(f"{path}: damaged gzip data after line {after_line} ({text}); {_RECOPY_FIX}")


# --- JSON ------------------------------------------------------------------------------------------


class _KeyTwice(dict):
    """A JSON object that gives ``key`` more than once; ``values``: each value it gives ``key``, in order."""

    key: str = ""
    values: tuple[Any, ...] = ()


class _JsonObjects:
    """``object_pairs_hook`` for :func:`json.loads`: dicts as the default, except that an object giving a key
    twice becomes a :class:`_KeyTwice` (and ``found`` is set), to be refused with its row."""

    def __init__(self) -> None:
        self.found = False

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        counts = Counter(k for k, _ in pairs)
        twice = _KeyTwice(obj)
        twice.key = next(k for k, _ in pairs if counts[k] > 1)
        twice.values = tuple(v for k, v in pairs if k == twice.key)
        self.found = True
        return twice


def _key_twice(value: Any, where: str = "") -> str | None:
    """The first object inside ``value`` (a row) that gives a key twice, described ("key 'label' is given twice
    in the row (0, then 1)"), or None. ``where``: the path to ``value`` inside the row ('' for the row itself)."""
    if isinstance(value, _KeyTwice):
        values = ", then ".join(show(v) for v in value.values)
        return f"key {value.key!r} is given twice in {where or 'the row'} ({values})"
    if isinstance(value, dict):
        children = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        children = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for path, child in children if (found := _key_twice(child, path))), None)


def _loads(text: str, objects: _JsonObjects) -> Any:
    """``json.loads`` with ``objects`` as the object hook; JSONDecodeError passes, other failures (an integer
    of more than 4300 digits, nesting too deep) become JSONDecodeError at the start."""
    try:
        return json.loads(text, object_pairs_hook=objects)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise json.JSONDecodeError(why, text, 0) from None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"JSON {json.dumps(value)}"
    return {dict: "a JSON object", list: "a JSON list", str: "a JSON string"}.get(type(value), "a JSON number")


_DUPLICATE_FIX = "a JSON parser keeps only the last value: keep one of them"


def _jsonl_row(path: Path, line: str, lineno: int, row: int, objects: _JsonObjects) -> Row:
    place = f"{path}: row {row} (line {lineno})"
    try:
        value = _loads(line, objects)
    except json.JSONDecodeError as exc:
        raise DataError(f"{place}: not valid JSON ({exc.msg}, column {exc.colno}); a JSON-lines file holds one "
                        "JSON object per line: fix that line") from None
    if not isinstance(value, dict):
        raise DataError(f"{place}: a row must be a JSON object {{\"field\": value, ...}}, not {_json_kind(value)}")
    if objects.found:
        raise DataError(f"{place}: {_key_twice(value)}; {_DUPLICATE_FIX}")
    return value


def _read_jsonl(path: Path) -> list[Row]:
    compressed = path.name.lower().endswith(".gz")
    rows: list[Row] = []
    lineno = 0
    objects = _JsonObjects()  # the first key given twice is refused at once: one hook serves the whole file
    try:
        with (gzip.open if compressed else open)(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_jsonl_row(path, line, lineno, len(rows) + 1, objects))
    except UnicodeDecodeError:  # the line and byte are found in a second pass, only then
        problem = _find_not_utf8(path, compressed)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        problem = _gzip_problem(path, lineno, exc)
    else:
        return rows
    raise problem


def _read_json(path: Path) -> list[Row]:
    text = _decode(path, path.read_bytes())
    if not text.strip():
        raise DataError(f"{path}: the file is empty; a .json file holds one JSON list of rows [{{...}}, ...]")
    objects = _JsonObjects()
    try:
        data = _loads(text, objects)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg}); fix it there "
                        "(a .json file holds one JSON list of row objects; a file of one object per line is JSON "
                        "lines: name it .jsonl)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: holds {_json_kind(data)}, not a list of rows; give a list "
                        "[{\"field\": value, ...}, ...], or one object per line in a .jsonl file")
    for row, value in enumerate(data, 1):
        if not isinstance(value, dict):
            raise DataError(f"{path}: row {row} must be a JSON object {{\"field\": value, ...}}, not "
                            f"{_json_kind(value)}")
        if objects.found and (twice := _key_twice(value)):
            raise DataError(f"{path}: row {row}: {twice}; {_DUPLICATE_FIX}")
    return data


# --- CSV and TSV -----------------------------------------------------------------------------------


_INTEGER = re.compile(r"^[+-]?\d+$")
_DECIMAL = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def _cell_label(cell: str) -> int | float | str | None:
    """A CSV / TSV label cell: an integer, a decimal number, null (empty) or a class name."""
    text = cell.strip()
    if not text:
        return None
    if _INTEGER.match(text):
        try:
            return int(text)
        except ValueError:  # more than 4300 digits: kept as written, a class name
            return cell
    return float(text) if _DECIMAL.match(text) else cell


def _header(path: Path, cells: list[str], line: int) -> list[str]:
    """Column names; an empty one is named 'Unnamed: <i>' (as pandas did: a DataFrame's index written by
    to_csv). A name given twice is refused."""
    names = [cell or f"Unnamed: {i}" for i, cell in enumerate(cells)]
    seen: dict[str, int] = {}
    for i, name in enumerate(names, 1):
        if name in seen:
            raise DataError(f"{path}: line {line}: the header names column {name!r} twice (columns {seen[name]} and "
                            f"{i}); rename or drop one")
        seen[name] = i
    return names


_ONE_LINE_RULE = ("a row is one line: a quoted cell may hold commas and doubled quotes (\"\"), not line breaks "
                  "(replace them with spaces, or convert the file to JSON lines, which keeps them)")


def _quote_problem(path: Path, row: int | None, first: int, last: int, why: str | None) -> DataError:
    """A CSV record (the header when ``row`` is None) that spans lines ``first``..``last`` (a quote left open),
    or one ``why`` csv refused."""
    place = f"{path}: {'the header' if row is None else f'row {row}'} (line {first})"
    if why is not None and "end of data" in why:  # the quote runs to the end of the file
        return DataError(f"{place}: a quote opened on this line is never closed (the {last - first + 1} lines to "
                         f"the end of the file would be one cell); close it on its line: {_ONE_LINE_RULE}")
    if last > first:
        return DataError(f"{place}: a quoted cell runs past the end of its line, to line {last} (a quote left "
                         f"open swallows the rows after it); close it on its line: {_ONE_LINE_RULE}")
    return DataError(f"{place}: malformed CSV quoting ({why}); quote a whole cell, doubling the quotes inside it "
                     "(\"say \"\"hi\"\"\")")


def _read_table(path: Path, label_column: str) -> list[Row]:
    tsv = path.name.lower().endswith(".tsv")
    text = _decode(path, path.read_bytes(), bom=True)
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if tsv else ",", strict=True,
                        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
    rows: list[Row] = []
    header: list[str] | None = None
    last = 0  # the last line read
    try:
        for cells in reader:
            first, last = last + 1, reader.line_num
            if not cells or (len(cells) == 1 and not cells[0].strip()):  # a blank line (as pandas skipped)
                continue
            if last > first:
                raise _quote_problem(path, None if header is None else len(rows) + 1, first, last, None)
            if header is None:
                header = _header(path, cells, first)
                continue
            if len(cells) != len(header):
                raise DataError(
                    f"{path}: row {len(rows) + 1} (line {first}): {len(cells)} cell{'s' * (len(cells) != 1)} where "
                    f"the header has {len(header)} ({show(header, 80)}); give every row one cell per column "
                    + ("(a tab inside a cell splits it: TSV has no quoting)" if tsv else "(quote a cell that holds a comma)"))
            rows.append(dict(zip(header, cells)))
    except csv.Error as exc:
        raise _quote_problem(path, None if header is None else len(rows) + 1, last + 1, reader.line_num,
                             str(exc)) from None
    if header is None:
        raise DataError(f"{path}: the file is empty; a {'TSV' if tsv else 'CSV'} file starts with a header row of "
                        "column names")
    if label_column in header:
        for row in rows:
            row[label_column] = _cell_label(row[label_column])
    return rows


# --- parquet ---------------------------------------------------------------------------------------


def _damaged_parquet(path: Path, exc: Exception) -> DataError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return DataError(f"{path}: not a readable parquet file ({first}); the file is damaged or not parquet: write it "
                     "again (e.g. pandas DataFrame.to_parquet), or convert it to .jsonl")


def _read_parquet(path: Path) -> list[Row]:
    import pandas as pd  # heavy imports, only when needed
    import pyarrow
    import pyarrow.parquet as pq

    failures = (pyarrow.ArrowException, OSError, ValueError)
    try:
        names = pq.read_schema(path).names
    except failures as exc:
        raise _damaged_parquet(path, exc) from None
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise DataError(f"{path}: column {twice!r} appears twice; rename or drop one")
    try:
        frame = pd.read_parquet(path)
    except failures as exc:
        raise _damaged_parquet(path, exc) from None
    rows = frame.to_dict(orient="records")
    for row in rows:  # parquet lists come back as numpy arrays
        for k, v in row.items():
            if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
                row[k] = v.tolist()
    return rows
