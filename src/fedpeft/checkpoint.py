"""Round checkpoints: everything a run needs to continue after its last completed round.

A checkpoint is one fedpeft wire payload (safetensors: raw arrays plus a JSON header, never pickle),
so loading a checkpoint cannot execute code. Any state tree made of dicts, lists, numbers, strings,
None and numpy arrays round-trips exactly (integer dict keys and non-finite floats included): arrays
go to the tensor section under their path, everything else to the JSON metadata.

The file is written to a temporary name, flushed to disk and renamed over the previous checkpoint
(``os.replace`` is atomic on POSIX and Windows), so a reader sees either the old checkpoint or the
new one, never a half-written file. It is sealed with its SHA-256 (:mod:`fedpeft.integrity`, in the
metadata), so a damaged file (a flipped bit in a tensor or in the header) is refused with
:class:`CheckpointError` rather than trained on, as is a NaN or infinite value in an array that did not
hold one when it was saved (those the state legitimately holds are listed in the metadata, ``nonfinite``).
Checkpoints of format 1 (before the seal, or stripped of it) load only when the reader opts in
(``allow_unsealed``), with a warning, and as long as their arrays are finite.
"""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft import wire
from fedpeft.durable import atomic_write
from fedpeft.errors import UserError
from fedpeft.integrity import PLACEHOLDER, seal, seal_matches, unsealed_refusal

FILENAME = "checkpoint.safetensors"
FORMAT = 1  # of a state tree (encode_tree, and checkpoints before their seal)
SEALED_FORMAT = 2  # of a checkpoint: format 1 plus its SHA-256 and the list of its non-finite arrays
log = logging.getLogger("fedpeft")


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, damaged or belongs to another run."""


def pack_state(tree: Any) -> tuple[dict[str, np.ndarray], Any]:
    """(arrays by path, JSON-safe tree with array references) for any nested state."""
    arrays: dict[str, np.ndarray] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, np.ndarray):
            arrays[path] = obj
            return {"__array__": path}
        if isinstance(obj, dict):
            return {"__dict__": [[int(k) if isinstance(k, np.integer) else k if isinstance(k, (int, str)) else str(k), walk(v, f"{path}/{i}")]
                                 for i, (k, v) in enumerate(obj.items())]}
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, (bool, np.bool_)):
            return bool(obj)
        if isinstance(obj, (int, np.integer)):
            return int(obj)
        if isinstance(obj, (float, np.floating)):
            x = float(obj)
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if obj is None or isinstance(obj, str):
            return obj
        raise CheckpointError(f"cannot checkpoint a value of type {type(obj).__name__} at {path or '/'}")

    return arrays, walk(tree, "")


def unpack_state(arrays: dict[str, np.ndarray], tree: Any) -> Any:
    def walk(obj: Any) -> Any:
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, dict):
            if "__array__" in obj:
                try:
                    return arrays[obj["__array__"]]
                except KeyError:
                    raise CheckpointError(f"checkpoint lacks the array {obj['__array__']!r}") from None
            if "__float__" in obj:
                return float(obj["__float__"])
            if "__dict__" in obj:
                return {k: walk(v) for k, v in obj["__dict__"]}
        return obj

    return walk(tree)


def encode_tree(tree: Any) -> bytes:
    """A state tree as wire bytes (used for client state kept by a Flower SuperNode)."""
    arrays, meta = pack_state(tree)
    return wire.encode(wire.Payload(arrays, {"format": FORMAT, "state": meta}))


def decode_tree(data: bytes) -> Any:
    payload = wire.decode(data)
    return unpack_state(payload.arrays, payload.meta.get("state"))


def nonfinite_arrays(arrays: dict[str, np.ndarray]) -> list[str]:
    """The paths of the floating-point arrays that hold a NaN or an infinite value."""
    return sorted(p for p, a in arrays.items() if a.dtype.kind in "fc" and not np.all(np.isfinite(a)))


def readable_paths(tree: Any) -> dict[str, str]:
    """Array path (as pack_state names it, by position) -> the path by dict keys, for messages."""
    out: dict[str, str] = {}

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{where}/{i}")
        elif isinstance(obj, dict) and "__array__" in obj:
            out[obj["__array__"]] = where or "/"
        elif isinstance(obj, dict) and "__dict__" in obj:
            for k, v in obj["__dict__"]:
                walk(v, f"{where}/{k}")

    walk(tree, "")
    return out


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def save(run_dir: str | Path, rnd: int, state: dict[str, Any]) -> Path:
    """Write the state after round ``rnd`` atomically to RUN_DIR/checkpoint.safetensors, sealed with its
    SHA-256. A disk that refuses it raises fedpeft.durable.RunFileError; the previous checkpoint stays."""
    path = Path(run_dir) / FILENAME
    arrays, tree = pack_state(state)
    nonfinite = nonfinite_arrays(arrays)
    if nonfinite:
        names = readable_paths(tree)
        log.warning("checkpoint of round %d: %d array(s) of the state hold NaN or infinite values (%s); kept as "
                    "they are", rnd, len(nonfinite), ", ".join(names.get(p, p) for p in nonfinite[:3]))
    meta = {"sha256": PLACEHOLDER, "format": SEALED_FORMAT, "round": int(rnd), "nonfinite": nonfinite, "state": tree}
    data = wire.encode(wire.Payload(arrays, meta))
    atomic_write(path, seal(data, 8, _header_end(data)), then=f"continue with: fedpeft run --resume {run_dir}")
    return path


def _refuse(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path} {problem}; it cannot be resumed from: restore the file from a copy, or start the "
                           "run again in a new directory")


def load(run_dir: str | Path, *, allow_unsealed: bool = False) -> tuple[int, dict[str, Any]]:
    """(last completed round, state); CheckpointError if there is none, it cannot be read, its checksum does
    not match, it carries none (format 1) and ``allow_unsealed`` is off, or an array holds NaN / infinite values
    it did not hold when saved."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        raise CheckpointError(f"{str(run_dir)!r} has no {FILENAME}: the run saved no checkpoint yet "
                              "(runtime.checkpoint_every 0, or it stopped before its first round ended)")
    data = path.read_bytes()
    try:
        payload = wire.decode(data)
    except wire.PayloadError as exc:
        raise _refuse(path, f"is damaged ({exc})") from None
    meta = payload.meta
    if meta.get("format") not in (FORMAT, SEALED_FORMAT) or not isinstance(meta.get("round"), int):
        raise CheckpointError(f"{path} is not a fedpeft checkpoint of format {FORMAT} or {SEALED_FORMAT}")
    declared: set[str] = set()
    if meta["format"] == SEALED_FORMAT:
        if not seal_matches(data, meta.get("sha256"), 8, _header_end(data)):
            raise _refuse(path, "is damaged: its SHA-256 does not match its contents (a changed bit)")
        declared = set(meta.get("nonfinite") or [])
    elif not allow_unsealed:
        raise CheckpointError(unsealed_refusal(path, f"a checkpoint of format {FORMAT}"))
    else:
        log.warning("%s carries no checksum (allowed by allow_unsealed): a damaged one cannot be told from a good "
                    "one (NaN / infinite values are still refused)", path)
    bad = [p for p in nonfinite_arrays(payload.arrays) if p not in declared]
    if bad:
        name = readable_paths(meta.get("state")).get(bad[0], bad[0])
        raise _refuse(path, f"holds NaN or infinite values in {name!r} ({len(bad)} array(s)), which it did not "
                            "hold when it was saved")
    return meta["round"], unpack_state(payload.arrays, meta.get("state"))


def seal_older(run_dir: str | Path) -> bool:
    """Write an unsealed checkpoint (format 1) of RUN_DIR again, sealed, with the same round and state (after
    the checks of :func:`load` with ``allow_unsealed``); False if there is none or it was sealed already."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return False
    data = path.read_bytes()
    try:
        sealed = wire.decode(data).meta.get("format") == SEALED_FORMAT
    except wire.PayloadError:
        sealed = False  # load says what is wrong
    if sealed:
        return False
    rnd, state = load(run_dir, allow_unsealed=True)
    save(run_dir, rnd, state)
    return True
