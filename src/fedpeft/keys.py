"""Fingerprints of SuperNode public keys, as OpenSSH prints them (``ssh-keygen -lf key.pub``): how a partition is
pinned to a key (``runtime.flower.partition_keys``) and how the ServerApp recognises a SuperNode. Kept apart from
the Flower runtime, so that validating a config needs no Flower."""

from __future__ import annotations

import base64
import hashlib

from cryptography.hazmat.primitives import serialization

FINGERPRINT_PREFIX = "SHA256:"


def _fingerprint_of_blob(blob: bytes) -> str:
    return FINGERPRINT_PREFIX + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")


def _openssh_blob(key: object) -> bytes:
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)  # type: ignore[attr-defined]
    return base64.b64decode(line.split()[1])


def node_key_fingerprint(public_key: bytes) -> str:
    """The OpenSSH fingerprint of a SuperNode's public key as the SuperLink lists it (PEM), "" for none; a key
    that is not PEM is fingerprinted as it is."""
    if not public_key:
        return ""
    try:
        key = serialization.load_pem_public_key(public_key)
    except (ValueError, TypeError):
        return _fingerprint_of_blob(public_key)
    return _fingerprint_of_blob(_openssh_blob(key))


def pinned_key_fingerprint(value: str) -> str:
    """``value`` (an OpenSSH public key line, as in supernode-I.pub, or its ``SHA256:...`` fingerprint) as a
    fingerprint; ValueError (one line) for anything else."""
    text = value.strip()
    if text.startswith(FINGERPRINT_PREFIX):
        digest = text[len(FINGERPRINT_PREFIX):]
        try:
            raw = base64.b64decode(digest + "=" * (-len(digest) % 4), validate=True)
        except ValueError:
            raw = b""
        if len(raw) != hashlib.sha256().digest_size:
            raise ValueError(f"{text[:60]!r} is not a SHA256 fingerprint (SHA256: and 43 base64 characters)")
        return text
    try:
        key = serialization.load_ssh_public_key(text.encode("utf-8"))
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"{text[:60]!r} is neither an OpenSSH public key line (the contents of supernode-I.pub) "
                         "nor its SHA256:... fingerprint (ssh-keygen -lf supernode-I.pub)") from None
    return _fingerprint_of_blob(_openssh_blob(key))
