"""Reading raw rows of one split, from local files or the Hugging Face Hub, in fedpeft's schema."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from fedpeft.data.catalog import CATALOG, Row

FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".csv", ".parquet")


class DataError(ValueError):
    """A problem with the data: missing file, column or label. One line, naming the fix."""


def data_dirs(explicit: str | None = None) -> list[Path]:
    """Where catalog datasets are looked for, in order."""
    if explicit:
        return [Path(explicit)]
    out = []
    if os.environ.get("FEDPEFT_DATA_DIR"):
        out.append(Path(os.environ["FEDPEFT_DATA_DIR"]))
    out += [Path("data"), Path("..") / "shared" / "data"]
    return out


def read_file(path: Path) -> list[Row]:
    """Rows of a jsonl / jsonl.gz / json / csv / parquet file."""
    name = path.name.lower()
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        rows = []
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        return rows
    if name.endswith(".json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of rows")
        return data
    import pandas as pd  # heavy import, only when needed

    if name.endswith(".csv"):
        frame = pd.read_csv(path, keep_default_na=False)
    elif name.endswith(".parquet"):
        frame = pd.read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type; use one of {', '.join(FILE_SUFFIXES)}")
    rows = frame.to_dict(orient="records")
    for row in rows:  # parquet lists come back as numpy arrays
        for k, v in row.items():
            if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
                row[k] = v.tolist()
    return rows


def _split_file(directory: Path, split: str) -> Path | None:
    for suffix in FILE_SUFFIXES:
        candidate = directory / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _available_splits(directory: Path) -> list[str]:
    out = []
    for p in sorted(directory.iterdir()):
        for suffix in FILE_SUFFIXES:
            if p.is_file() and p.name.endswith(suffix):
                out.append(p.name[: -len(suffix)])
                break
    return out


def locate_local(dataset: str, data_dir: str | None = None) -> Path | None:
    """The local file or directory that holds ``dataset``, or None."""
    direct = Path(dataset).expanduser()
    if direct.exists() and (direct.is_file() or direct.is_dir()) and ("/" in dataset or direct.suffix):
        return direct
    for base in data_dirs(data_dir):
        candidate = base / dataset
        if candidate.is_dir():
            return candidate
    return None


def _load_local_split(location: Path, split: str) -> list[Row]:
    if location.is_file():
        return read_file(location)
    path = _split_file(location, split)
    if path is None:
        raise DataError(
            f"dataset {str(location)!r} has no split {split!r}; available: {', '.join(_available_splits(location)) or 'none'}"
        )
    return read_file(path)


def _load_hub_split(dataset: str, config: str | None, split: str) -> list[Row]:
    entry = CATALOG.get(dataset)
    hub_id, hub_config, convert = dataset, config, None
    if entry is not None:
        hub_id, hub_config, convert = entry.hub_id, config or entry.hub_config, entry.convert
        split = entry.hub_splits.get(split, split)
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, hub_config, split=split)
    except Exception as exc:  # network, unknown id, unknown split: all end here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise DataError(
            f"dataset {dataset!r} split {split!r}: not found locally (looked in {', '.join(map(str, data_dirs()))}) "
            f"and the Hub load of {hub_id!r} failed: {first[:200]}. Set task.data_dir or FEDPEFT_DATA_DIR to a "
            "folder holding <dataset>/<split>.jsonl"
        ) from None
    rows = [dict(r) for r in ds]
    return [convert(r) for r in rows] if convert is not None else rows


_SLICE = re.compile(r"^(?P<name>[^\[\]]+?)\s*(?:\[\s*(?P<start>-?\d+%?)?\s*:\s*(?P<end>-?\d+%?)?\s*\])?$")


def parse_split(part: str) -> tuple[str, str | None, str | None]:
    """'test[:80%]' -> ('test', None, '80%'); 'train' -> ('train', None, None). The slice syntax of Hugging
    Face datasets: integers count rows (negative from the end), 'N%' is a share of the split's rows."""
    m = _SLICE.match(part.strip())
    if m is None:
        raise DataError(f"split {part!r}: write a split name, optionally sliced as name[start:end] with rows or "
                        "percentages, e.g. 'test[:80%]' or 'train[1000:]'")
    return m["name"].strip(), m["start"], m["end"]


def _bound(spec: str | None, n: int, default: int) -> int:
    if spec is None:
        return default
    if spec.endswith("%"):
        pct = int(spec[:-1])
        if not -100 <= pct <= 100:
            raise DataError(f"split slice {spec!r}: a percentage must lie in [-100%, 100%]")
        pos = int(round(abs(pct) * n / 100))  # nearest row, as datasets' "closest" rounding
        return n - pos if pct < 0 else pos
    value = int(spec)
    return max(0, n + value) if value < 0 else min(value, n)


def slice_rows(rows: list[Row], start: str | None, end: str | None, shuffle_seed: int | None,
               split: str) -> tuple[list[Row], tuple[int, int]]:
    """The rows of ``split[start:end]`` and their [lo, hi) positions; with ``shuffle_seed`` a sliced split is
    first put in a seeded random order (the same for every slice of it, so complementary slices are disjoint)."""
    n = len(rows)
    if start is None and end is None:
        return rows, (0, n)
    if shuffle_seed is not None:
        import numpy as np

        order = np.random.default_rng([shuffle_seed, n]).permutation(n)
        rows = [rows[i] for i in order]
    lo, hi = _bound(start, n, 0), _bound(end, n, n)
    if lo >= hi:
        raise DataError(f"split {split!r} selects no rows ({n} rows, slice [{lo}:{hi}]); widen the slice")
    return rows[lo:hi], (lo, hi)


def load_rows(
    dataset: str,
    split: str,
    *,
    dataset_config: str | None = None,
    data_dir: str | None = None,
    columns: dict[str, str] | None = None,
    shuffle_seed: int | None = None,
    spans: dict[str, list[tuple[int, int]]] | None = None,
) -> list[Row]:
    """All rows of ``split`` in fedpeft's schema, with column renames applied. 'a+b' joins splits; each part
    may be sliced as Hugging Face datasets does ('test[:80%]', 'train[100:200]'), after a seeded shuffle of
    that split when ``shuffle_seed`` is given. ``spans``, when given, receives source -> [lo, hi) row ranges
    taken (to check that two selections are disjoint; a source is a file, or a Hub split)."""
    rows: list[Row] = []
    location = locate_local(dataset, data_dir)
    taken_spans: dict[str, list[tuple[int, int]]] = {}
    for part in split.split("+"):
        name, start, end = parse_split(part)
        if location is not None:
            loaded = _load_local_split(location, name)
        else:
            loaded = _load_hub_split(dataset, dataset_config, name)
        taken, span = slice_rows(loaded, start, end, shuffle_seed, part.strip())
        source = _source_key(dataset, dataset_config, location, name)
        if shared_rows(taken_spans, {source: [span]}) is not None:
            raise DataError(f"split {split!r} takes some rows of {name!r} twice; make its parts disjoint")
        taken_spans.setdefault(source, []).append(span)
        rows += taken
    if spans is not None:
        for source, ranges in taken_spans.items():
            spans.setdefault(source, []).extend(ranges)
    if columns:
        rows = [_rename(r, columns) for r in rows]
    return rows


def _source_key(dataset: str, config: str | None, location: Path | None, name: str) -> str:
    """Where the rows of split ``name`` come from: two names with the same key read the same rows."""
    if location is not None:
        return str(location if location.is_file() else _split_file(location, name) or location / name)
    entry = CATALOG.get(dataset)
    if entry is not None:
        return f"hub:{entry.hub_id}:{config or entry.hub_config}:{entry.hub_splits.get(name, name)}"
    return f"hub:{dataset}:{config}:{name}"


def shared_rows(a: dict[str, list[tuple[int, int]]], b: dict[str, list[tuple[int, int]]]) -> str | None:
    """The first source whose row ranges in ``a`` and ``b`` (from :func:`load_rows`' spans) overlap, or None."""
    for name in sorted(set(a) & set(b)):
        if any(lo1 < hi2 and lo2 < hi1 for lo1, hi1 in a[name] for lo2, hi2 in b[name]):
            return name
    return None


def _rename(row: Row, columns: dict[str, str]) -> Row:
    out = dict(row)
    for ours, theirs in columns.items():
        if theirs in row:
            out[ours] = row[theirs]
    return out


def describe_splits(dataset: str, data_dir: str | None = None) -> dict[str, Any]:
    location = locate_local(dataset, data_dir)
    if location is None:
        entry = CATALOG.get(dataset)
        return {"dataset": dataset, "source": f"hub:{entry.hub_id if entry else dataset}", "splits": []}
    if location.is_file():
        return {"dataset": dataset, "source": str(location), "splits": [location.name]}
    return {"dataset": dataset, "source": str(location), "splits": _available_splits(location)}


def require_fields(rows: Iterable[Row], fields: tuple[str, ...], where: str) -> None:
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(
                f"{where}: row {i} has no field {missing[0]!r} (fields: {', '.join(sorted(row))}); "
                f"map yours with task.columns, e.g. --set task.columns.{missing[0]}=<your column>"
            )
