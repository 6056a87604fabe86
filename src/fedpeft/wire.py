"""The wire format of every payload: named arrays + JSON metadata, serialized as safetensors bytes.

No pickle crosses the wire: safetensors is a flat header (JSON) plus raw little-endian buffers, so
decoding untrusted bytes cannot execute code. Communication figures are ``len(encode(payload))``:
the exact number of bytes a transport would carry (before any transport framing).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

META_KEY = "fedpeft"
Arrays = dict[str, np.ndarray]  # named arrays, the payload's tensors


class PayloadError(ValueError):
    """Bytes that are not a valid fedpeft payload."""


@dataclass
class Payload:
    """What travels between the halves: named arrays and JSON metadata (plain JSON values: numbers, strings,
    booleans, None, lists and objects of them)."""

    arrays: Arrays = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def encode(payload: Payload) -> bytes:
    try:
        meta = json.dumps(payload.meta, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"payload metadata is not plain finite JSON: {exc}") from None
    arrays = {k: np.ascontiguousarray(v) for k, v in payload.arrays.items()}
    return st_save(arrays, metadata={META_KEY: meta})


def _header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise PayloadError(f"payload header claims {n} bytes but only {len(data) - 8} follow")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, an integer of > 4300 digits, deep nesting
        raise PayloadError("payload header is not valid JSON") from None
    if not isinstance(header, dict):
        raise PayloadError("payload header is not a JSON object")
    return header


def decode(data: bytes, *, max_bytes: int | None = None) -> Payload:
    """Parse bytes from the wire; raises PayloadError (one line) on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    check_size(memoryview(data).nbytes, max_bytes)  # before any copy
    data = bytes(data)  # no copy when it is bytes already
    header = _header(data)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise PayloadError("payload header's __metadata__ is not a JSON object")
    raw_meta = metadata.get(META_KEY, "{}")
    try:
        meta = json.loads(raw_meta)
    except (TypeError, ValueError, RecursionError):  # as above, or not a string
        raise PayloadError("payload metadata is not valid JSON (or holds an integer of more than 4300 digits, or "
                           "nests too deeply)") from None
    if not isinstance(meta, dict):
        raise PayloadError("payload metadata is not a JSON object")
    try:
        arrays = st_load(data)
    except Exception as exc:  # safetensors raises its own error type for every malformed input  # noqa: BLE001 (any decoding failure is a PayloadError)
        raise PayloadError(f"payload tensors are malformed: {str(exc).splitlines()[0][:160]}") from None
    return Payload(arrays=dict(arrays), meta=meta)


def check_size(size: int, max_bytes: int | None) -> None:
    """PayloadError unless a payload of ``size`` bytes is within ``max_bytes`` (None: no limit)."""
    if max_bytes is not None and size > max_bytes:
        raise PayloadError(f"payload of {size} bytes exceeds the limit of {max_bytes} bytes (runtime.max_payload_mb)")


def clock_text(seconds: float) -> str:
    """A measured quantity for payload metadata (a duration, a FLOP estimate) as fixed-width text
    (``%.6e``, 12 characters): such values differ between otherwise identical runs (clock) or between
    runtimes (which steps were sampled), and the payload's byte count must not depend on them. Read it
    back with :func:`clock_seconds`."""
    return f"{seconds:.6e}"


def clock_seconds(meta: dict[str, Any], key: str) -> float | None:
    value = meta.get(key)
    return None if value is None else float(value)


def payload_size(payload: Payload) -> int:
    return len(encode(payload))


_DTYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2), "float64": ("F64", 8),
           "int32": ("I32", 4), "int64": ("I64", 8), "int8": ("I8", 1), "uint8": ("U8", 1), "bool": ("BOOL", 1)}
# safetensors writes tensors ordered by dtype (its enum order, descending), then by name
_DTYPE_ORDER = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]


def encoded_size(spec: dict[str, tuple[tuple[int, ...], str]], meta: dict[str, Any]) -> int:
    """``len(encode(Payload(arrays, meta)))`` for arrays of the given (shape, dtype), without allocating them
    (e.g. the full fine-tuning state of a 7B model): the safetensors layout, 8 bytes of header length, the
    JSON header padded with spaces to a multiple of 8, then the raw buffers. Equal to the encoded length
    (checked against :func:`encode` in the tests)."""
    entries = []
    for name, (shape, dtype) in spec.items():
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code here")
        code, width = _DTYPES[dtype]
        dims = [int(d) for d in shape] or [1]  # safetensors stores a 0-d array as shape [1]
        entries.append((name, code, dims, width * int(np.prod(dims, dtype=np.int64))))
    entries.sort(key=lambda e: (-_DTYPE_ORDER.index(e[1]), e[0]))
    header: dict[str, Any] = {"__metadata__": {META_KEY: json.dumps(meta, allow_nan=False, separators=(",", ":"))}}
    offset = 0
    for name, code, dims, nbytes in entries:
        header[name] = {"dtype": code, "shape": dims, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return 8 + len(text) + (-len(text)) % 8 + offset
