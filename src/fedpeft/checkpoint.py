"""Round checkpoints: everything a run needs to continue after its last completed round.

A checkpoint is one fedpeft wire payload (safetensors: raw arrays plus a JSON header, never pickle),
so loading a checkpoint cannot execute code. Any state tree made of dicts, lists, numbers, strings,
None and numpy arrays round-trips exactly (integer dict keys and non-finite floats included): arrays
go to the tensor section under their path, everything else to the JSON metadata.

The file is written to a temporary name, flushed to disk and renamed over the previous checkpoint
(``os.replace`` is atomic on POSIX and Windows), so a reader sees either the old checkpoint or the
new one, never a half-written file; a damaged file is refused with :class:`CheckpointError`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft import wire
from fedpeft.errors import UserError
from fedpeft.rundir import atomic_write

FILENAME = "checkpoint.safetensors"
FORMAT = 1


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


def save(run_dir: str | Path, rnd: int, state: dict[str, Any]) -> Path:
    """Write the state after round ``rnd`` atomically to RUN_DIR/checkpoint.safetensors."""
    path = Path(run_dir) / FILENAME
    arrays, tree = pack_state(state)
    data = wire.encode(wire.Payload(arrays, {"format": FORMAT, "round": int(rnd), "state": tree}))
    atomic_write(path, data)
    return path


def load(run_dir: str | Path) -> tuple[int, dict[str, Any]]:
    """(last completed round, state); CheckpointError if there is none or it cannot be read."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        raise CheckpointError(f"{str(run_dir)!r} has no {FILENAME}: the run saved no checkpoint yet "
                              "(runtime.checkpoint_every 0, or it stopped before its first round ended)")
    try:
        payload = wire.decode(path.read_bytes())
    except wire.PayloadError as exc:
        raise CheckpointError(f"{path} is damaged ({exc}); it cannot be resumed from") from None
    meta = payload.meta
    if meta.get("format") != FORMAT or not isinstance(meta.get("round"), int):
        raise CheckpointError(f"{path} is not a fedpeft checkpoint of format {FORMAT}")
    return meta["round"], unpack_state(payload.arrays, meta.get("state"))
