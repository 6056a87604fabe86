"""Reading raw rows of one split, from local files or the Hugging Face Hub, in fedpeft's schema.

Files: ``<split>.jsonl`` / ``.jsonl.gz`` / ``.json`` (a list of objects) / ``.csv`` / ``.tsv`` / ``.parquet``,
read strictly by :mod:`fedpeft.data.files`. Rows are numbered from 1 in the file as read: the n-th object of a
JSON / JSON-lines file (blank lines skipped), the n-th data row of a CSV / TSV (after the header, blank lines
skipped) or parquet file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fedpeft.data.catalog import Row, dataset_entry
from fedpeft.data.files import FILE_SUFFIXES, DataError, read_file
from fedpeft.data.validate import Origin
from fedpeft.errors import first_line
from fedpeft.plugins import load_built_ins
from fedpeft.registry import DATASETS


def data_dirs(explicit: str | None = None) -> list[Path]:
    """Where catalog datasets are looked for, in order."""
    if explicit:
        return [Path(explicit)]
    out = []
    if os.environ.get("FEDPEFT_DATA_DIR"):
        out.append(Path(os.environ["FEDPEFT_DATA_DIR"]))
    out += [Path("data"), Path("..") / "shared" / "data"]
    return out


def _split_file(directory: Path, split: str) -> Path | None:
    for suffix in FILE_SUFFIXES:
        candidate = directory / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _supported(name: str) -> bool:
    return name.lower().endswith(FILE_SUFFIXES)


def _available_splits(directory: Path) -> list[str]:
    if _flat_image_folder(directory):
        return ["train"]
    out = []
    for p in sorted(directory.iterdir()):
        if _is_image_folder(p):
            out.append(p.name)
        for suffix in FILE_SUFFIXES:
            if p.is_file() and p.name.endswith(suffix):
                out.append(p.name[: -len(suffix)])
                break
    return out


SPLIT_FOLDER_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")


def _holds_images(folder: Path) -> bool:
    from fedpeft.data.images import IMAGE_SUFFIXES

    return any(p.is_file() and p.name.lower().endswith(IMAGE_SUFFIXES) for p in folder.iterdir())


def _flat_image_folder(path: Path) -> bool:
    """Whether ``path`` holds class folders of images directly (<dataset>/<class>/<image>): one split, 'train', as
    Hugging Face's imagefolder reads it. Not when a folder is named like a split (split folders of images without
    class folders: refused by :func:`_load_local_split`) or none holds an image (split folders of data files)."""
    if not _is_image_folder(path):
        return False
    children = list(path.iterdir())
    return (not any(_is_image_folder(p) for p in children) and not any(p.name in SPLIT_FOLDER_NAMES for p in children)
            and any(_holds_images(p) for p in children))


def _is_image_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of class folders (an ImageFolder split: <split>/<class>/<image>)."""
    if not path.is_dir() or path.name.startswith("."):
        return False
    inside = [p for p in path.iterdir() if not p.name.startswith(".")]
    return bool(inside) and all(p.is_dir() for p in inside)


def unsupported_files(directory: Path, split: str | None = None) -> list[str]:
    """Files of ``directory`` (of ``split``, when given) that fedpeft does not read."""
    return [p.name for p in sorted(directory.iterdir())
            if p.is_file() and not p.name.startswith(".") and not _supported(p.name)
            and (split is None or p.name.startswith(f"{split}."))]


def _looks_like_path(dataset: str) -> bool:
    return dataset.startswith((".", "/", "~")) or _supported(dataset)


def locate_local(dataset: str, data_dir: str | None = None) -> Path | None:
    """The local file or directory that holds ``dataset``, or None (then it is a Hub id)."""
    direct = Path(dataset).expanduser()
    if direct.exists() and (direct.is_file() or direct.is_dir()) and ("/" in dataset or direct.suffix):
        return direct
    if _looks_like_path(dataset):
        raise DataError(f"local path {dataset!r} does not exist (resolved to {direct.absolute()}); point "
                        "task.dataset at a data directory or file, or give a catalog name or a Hub id")
    for base in data_dirs(data_dir):
        candidate = base / dataset
        if candidate.is_dir():
            return candidate
    return None


def _load_local_split(location: Path, split: str, label_column: str) -> list[Row]:
    if location.is_file():
        return read_file(location, label_column)
    path = _split_file(location, split)
    if path is None and _is_image_folder(location / split):
        from fedpeft.data.images import read_image_folder

        # an ImageFolder split, <split>/<class>/<image>: nothing in it may lead out of the dataset's directory
        return read_image_folder(location / split, label_column, location)
    split_folder = location / split
    if path is None and split_folder.is_dir() and _holds_images(split_folder):
        raise DataError(f"{split_folder}: split folder {split!r} holds images but no class folders, so they have no "
                        f"labels; put each class's images in a folder of its own, {location}/{split}/<class>/<image>")
    if path is None and _flat_image_folder(location):
        if split == "train":
            from fedpeft.data.images import read_image_folder

            return read_image_folder(location, label_column)
        raise DataError(f"dataset {str(location)!r} holds class folders directly (<dataset>/<class>/<image>), which "
                        f"is one split, 'train', not {split!r}: carve the parts with slices, e.g. task.train_split "
                        "'train[:80%]' and task.eval_split 'train[80%:]' (with task.split_shuffle_seed), or put the "
                        "class folders under one folder per split (<dataset>/<split>/<class>/<image>)")
    if path is None:
        others = unsupported_files(location, split)
        if others:
            raise DataError(f"{location / others[0]}: split {split!r} is in a file type fedpeft does not read; "
                            f"convert it to one of {', '.join(FILE_SUFFIXES)}")
        raise DataError(
            f"dataset {str(location)!r} has no split {split!r}; available: {', '.join(_available_splits(location)) or 'none'}"
        )
    return read_file(path, label_column)


def local_catalog_names(data_dir: str | None = None) -> list[str]:
    """Catalog datasets that have a folder in the local data directories."""
    load_built_ins()
    return [name for name in DATASETS if any((base / name).is_dir() for base in data_dirs(data_dir))]


def _not_local(dataset: str, data_dir: str | None, why: str) -> DataError:
    offline = "HF_HUB_OFFLINE" in why
    return DataError(
        f"dataset {dataset!r}: not found locally (looked in {', '.join(map(str, data_dirs(data_dir)))}; catalog "
        f"datasets there: {', '.join(local_catalog_names(data_dir)) or 'none'}) and {why}. Set task.data_dir or "
        f"FEDPEFT_DATA_DIR to a folder holding {dataset}/<split>.jsonl, or give a catalog name listed"
        + (", or unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE to load it from the Hub" if offline else "")
    )


def check_available(dataset: str, data_dir: str | None = None, config: str | None = None) -> None:
    """Raise the DataError a run would get later when ``dataset`` is neither local nor loadable from the Hub
    (in milliseconds: nothing heavy is imported)."""
    from fedpeft.hub import hub_unavailable

    entry = dataset_entry(dataset)
    if locate_local(dataset, data_dir) is None and not (entry is not None and entry.loader is not None):
        why = hub_unavailable(_hub_target(dataset, config)[0], "dataset")
        if why is not None:
            raise _not_local(dataset, data_dir, why)


def _hub_target(dataset: str, config: str | None) -> tuple[str, str | None]:
    entry = dataset_entry(dataset)
    return (entry.hub_id or dataset, config or entry.hub_config) if entry is not None else (dataset, config)


def _load_code_split(dataset: str, split: str) -> list[Row]:
    """A split of a dataset registered with a loader: its rows, each a mapping (checked like a file's rows
    afterwards); a failing loader or one that returns something else is refused in one line."""
    entry = dataset_entry(dataset)
    assert entry is not None and entry.loader is not None
    if split not in entry.splits:
        raise DataError(f"dataset {dataset!r} has no split {split!r}; its loader serves {', '.join(entry.splits)}")
    where = f"dataset {dataset!r} split {split!r} (loader {getattr(entry.loader, 'path', entry.loader)})"
    try:
        rows = entry.row_loader()(split)  # type: ignore[misc]
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 (the user's code: whatever it raises becomes one line)
        raise DataError(f"{where}: the loader failed: {type(exc).__name__}: {first_line(exc, 200)}") from None
    if not isinstance(rows, list | tuple):
        raise DataError(f"{where}: the loader returned {type(rows).__name__}; return a list of rows (dicts)")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{where} row {number}: {type(row).__name__}, not a row; return dicts in fedpeft's "
                            "schema, e.g. {'text': ..., 'label': 0}")
    return [dict(row) for row in rows]


def _load_hub_split(dataset: str, config: str | None, split: str, data_dir: str | None = None) -> list[Row]:
    from fedpeft.hub import hub_unavailable

    entry = dataset_entry(dataset)
    hub_id, hub_config = _hub_target(dataset, config)
    convert = entry.converter() if entry is not None else None
    if entry is not None:
        split = entry.hub_splits.get(split, split)
    why = hub_unavailable(hub_id, "dataset")
    if why is not None:  # at once, instead of 25 s of retries
        raise _not_local(dataset, data_dir, why)
    try:
        import datasets

        ds = datasets.load_dataset(hub_id, hub_config, split=split)
    except Exception as exc:  # network, unknown id, unknown split: all end here  # noqa: BLE001 (every Hub failure becomes one DataError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise DataError(
            f"dataset {dataset!r} split {split!r}: not found locally (looked in {', '.join(map(str, data_dirs(data_dir)))}) "
            f"and the Hub load of {hub_id!r} failed: {first[:200]}. Set task.data_dir or FEDPEFT_DATA_DIR to a "
            "folder holding <dataset>/<split>.jsonl"
        ) from None
    rows = _with_class_names([dict(r) for r in _undecoded_images(ds)], ds)
    return _convert_hub_rows(dataset, hub_id, split, rows, convert) if convert is not None else rows


def _undecoded_images(ds: Any) -> Any:
    """A Hub dataset with its image columns as stored (``{"bytes": ..., "path": ...}``), so that they are decoded
    strictly, row by row, like a parquet file's (fedpeft.data.images), not by ``datasets`` as PIL images."""
    import datasets

    features = getattr(ds, "features", None) or {}
    for name, feature in features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
    return ds


def _with_class_names(rows: list[Row], ds: Any) -> list[Row]:
    """Rows whose ``label`` column is a ``datasets.ClassLabel`` get its class name as ``label_text`` (what
    predictions and reports name the class by, e.g. CIFAR-10's 'airplane'), unless they carry one."""
    import datasets

    feature = (getattr(ds, "features", None) or {}).get("label")
    if not isinstance(feature, datasets.ClassLabel) or not rows or "label_text" in rows[0]:
        return rows
    names = feature.names
    for row in rows:
        label = row.get("label")
        if isinstance(label, int) and 0 <= label < len(names):
            row["label_text"] = names[label]
    return rows


def _convert_hub_rows(dataset: str, hub_id: str, split: str, rows: list[Row], convert: Callable[[Row], Row],
                      ) -> list[Row]:
    """Hub rows in fedpeft's schema, by the catalog entry's ``convert``; a row it cannot convert (the Hub copy's
    fields changed) is refused with its number, not a traceback."""
    out = []
    for number, row in enumerate(rows, 1):
        try:
            out.append(convert(row))
        except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
            raise DataError(
                f"hub:{hub_id} split {split!r} row {number}: catalog dataset {dataset!r} cannot convert it to "
                f"fedpeft's schema ({type(exc).__name__}: {first_line(exc, 100)}; fields: {', '.join(sorted(map(str, row)))}); "
                "the Hub copy differs from what the catalog expects: use a local copy in fedpeft's schema "
                "(task.data_dir), or give the Hub id itself with task.columns"
            ) from None
    return out


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
        pos = round(abs(pct) * n / 100)  # nearest row, as datasets' "closest" rounding
        return n - pos if pct < 0 else pos
    value = int(spec)
    return max(0, n + value) if value < 0 else min(value, n)


def _slice_positions(n: int, start: str | None, end: str | None, shuffle_seed: int | None,
                     split: str) -> tuple[list[int], tuple[int, int]]:
    """Which of a split's ``n`` rows ``split[start:end]`` takes, and their [lo, hi) span; with ``shuffle_seed``
    a sliced split is first put in a seeded random order (the same for every slice of it, so complementary
    slices are disjoint)."""
    if start is None and end is None:
        return list(range(n)), (0, n)
    order = list(range(n))
    if shuffle_seed is not None:
        import numpy as np

        order = np.random.default_rng([shuffle_seed, n]).permutation(n).tolist()
    lo, hi = _bound(start, n, 0), _bound(end, n, n)
    if lo >= hi:
        raise DataError(f"split {split!r} selects no rows ({n} rows, slice [{lo}:{hi}]); widen the slice")
    return order[lo:hi], (lo, hi)


def load_rows(
    dataset: str,
    split: str,
    *,
    dataset_config: str | None = None,
    data_dir: str | None = None,
    columns: dict[str, str] | None = None,
    shuffle_seed: int | None = None,
    spans: dict[str, list[tuple[int, int]]] | None = None,
    origins: list[Origin] | None = None,
) -> list[Row]:
    """All rows of ``split`` in fedpeft's schema, with column renames applied. 'a+b' joins splits; each part
    may be sliced as Hugging Face datasets does ('test[:80%]', 'train[100:200]'), after a seeded shuffle of
    that split when ``shuffle_seed`` is given. ``spans``, when given, receives source -> [lo, hi) row ranges
    taken (to check that two selections are disjoint; a source is a file, or a Hub split). ``origins``, when
    given, receives for each row returned its (source, split part, 1-based row in the source), for messages."""
    rows: list[Row] = []
    location = locate_local(dataset, data_dir)
    taken_spans: dict[str, list[tuple[int, int]]] = {}
    label_column = (columns or {}).get("label", "label")
    entry = dataset_entry(dataset)
    for part in split.split("+"):
        name, start, end = parse_split(part)
        if location is not None:
            loaded = _load_local_split(location, name, label_column)
        elif entry is not None and entry.loader is not None:
            loaded = _load_code_split(dataset, name)
        else:
            loaded = _load_hub_split(dataset, dataset_config, name, data_dir)
        positions, span = _slice_positions(len(loaded), start, end, shuffle_seed, part.strip())
        source = _source_key(dataset, dataset_config, location, name)
        if shared_rows(taken_spans, {source: [span]}) is not None:
            raise DataError(f"split {split!r} takes some rows of {name!r} twice; make its parts disjoint")
        taken_spans.setdefault(source, []).append(span)
        rows += [loaded[i] for i in positions]
        if origins is not None:
            origins.extend((source, part.strip(), i + 1) for i in positions)
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
    entry = dataset_entry(dataset)
    if entry is not None and entry.loader is not None:
        return f"loader:{dataset}:{name}"
    if entry is not None:
        dataset, config, name = entry.hub_id or dataset, config or entry.hub_config, entry.hub_splits.get(name, name)
    return f"hub:{dataset}" + (f":{config}" if config else "") + f":{name}"  # the split: two splits, two sources


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


def describe_splits(dataset: str, data_dir: str | None = None, config: str | None = None) -> dict[str, Any]:
    """Where ``dataset`` is, its splits, and notes on files in its folder that are not read (``config``: a Hub
    dataset's configuration, task.dataset_config)."""
    location = locate_local(dataset, data_dir)
    entry = dataset_entry(dataset)
    if location is None and entry is not None and entry.loader is not None:
        return {"dataset": dataset, "source": f"loader {getattr(entry.loader, 'path', entry.loader)}",
                "splits": list(entry.splits), "notes": []}
    if location is None:
        return _describe_hub(dataset, data_dir, config)
    if location.is_file():
        return {"dataset": dataset, "source": str(location), "splits": [location.name], "notes": []}
    splits, ignored = _available_splits(location), unsupported_files(location)
    if not splits:
        found = f"found {', '.join(ignored)}" if ignored else "it holds no files"
        raise DataError(f"{location}: no data files ({found}); fedpeft reads <split> files ending in "
                        f"{', '.join(FILE_SUFFIXES)}")
    notes = [f"not read (unsupported file types): {', '.join(ignored)}; fedpeft reads {', '.join(FILE_SUFFIXES)}"
             ] if ignored else []
    return {"dataset": dataset, "source": str(location), "splits": splits, "notes": notes}


def _describe_hub(dataset: str, data_dir: str | None, config: str | None = None) -> dict[str, Any]:
    from fedpeft.hub import hub_unavailable

    hub_id, hub_config = _hub_target(dataset, config)
    why = hub_unavailable(hub_id, "dataset")
    if why is not None:
        raise _not_local(dataset, data_dir, why)
    try:
        import datasets

        splits = datasets.get_dataset_split_names(hub_id, hub_config)
    except Exception as exc:  # noqa: BLE001 (every Hub failure becomes one DataError)
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
        raise _not_local(dataset, data_dir, f"the Hub has no dataset {hub_id!r} ({first})") from None
    return {"dataset": dataset, "source": f"hub:{hub_id}", "splits": list(splits), "notes": []}


def require_fields(rows: Iterable[Row], fields: tuple[str, ...], where: str) -> None:
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(
                f"{where}: row {i} has no field {missing[0]!r} (fields: {', '.join(sorted(row))}); "
                f"map yours with task.columns, e.g. --set task.columns.{missing[0]}=<your column>"
            )
