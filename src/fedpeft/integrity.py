"""Checksums of the files a run leaves: SHA-256 digests a reader verifies before it trusts a file.

A file that records its own digest (a checkpoint's metadata, ``fedpeft_adapter.json``, ``config.yaml``'s first
line) is *sealed*: it is written with :data:`PLACEHOLDER` (64 zeros) where the digest goes, the SHA-256 of those
exact bytes is computed and written over the placeholder. To verify, the digest is zeroed again and the bytes
hashed: any changed bit of the file, its digest included, gives another hash.

A seal proves that a file is unchanged since it was sealed: not cut short, not damaged on disk or on the way,
not edited by accident. It proves nothing about who sealed it: anyone can edit a file and compute its seal again.
Seals are not optional: a file that must carry one and does not (written before seals, or stripped of its
seal) is refused unless the reader opts in (``allow_unsealed``, ``--allow-unsealed``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

PLACEHOLDER = "0" * 64
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def seal(data: bytes, start: int = 0, end: int | None = None) -> bytes:
    """``data`` with the first :data:`PLACEHOLDER` in ``data[start:end]`` replaced by the SHA-256 of ``data``."""
    at = data.find(PLACEHOLDER.encode(), start, len(data) if end is None else end)
    if at < 0:
        raise ValueError("nothing to seal: the data holds no digest placeholder")
    digest = hashlib.sha256(data).hexdigest().encode()
    return data[:at] + digest + data[at + len(digest):]


def seal_matches(data: bytes, digest: str, start: int = 0, end: int | None = None) -> bool:
    """Whether ``data``, whose first occurrence of ``digest`` in ``data[start:end]`` is its seal, is unchanged."""
    if not isinstance(digest, str) or not HEX_DIGEST.fullmatch(digest):
        return False
    at = data.find(digest.encode(), start, len(data) if end is None else end)
    if at < 0:
        return False
    blank = data[:at] + PLACEHOLDER.encode() + data[at + len(digest):]
    return hashlib.sha256(blank).hexdigest() == digest


# how a user loads a file without its seal: the command-line flag and the Python keyword
ALLOW_UNSEALED = "--allow-unsealed (allow_unsealed=True in Python)"


def unsealed_refusal(path: Path, what: str) -> str:
    """The one-line refusal of ``path``, a file that carries no seal (``what``: what is missing) where fedpeft
    always writes one."""
    return (f"{path} carries no SHA-256 seal ({what}), which fedpeft writes into every such file: it was written by "
            f"a fedpeft from before seals or by hand, or its seal was removed; if you know where it came from, load "
            f"it with {ALLOW_UNSEALED}")
