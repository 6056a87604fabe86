"""How many bytes a payload may have: the server's guard against an oversized update, a client's against an
oversized server payload (``runtime.max_payload_mb``; checked before a payload is copied or decoded)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpeft import wire
from fedpeft.config import RunConfig

# an update may carry a second state as large as the trainable one (SCAFFOLD's control variate), and metadata
UPDATE_STATES = 2
METADATA_ALLOWANCE = 2**20
# a server payload may be several times the trainable state (FLoRA / FedEx-LoRA send the stacks of past rounds)
DOWNLOAD_LIMIT_MB = 4096.0


def upload_limit(cfg: RunConfig, trainable: Mapping[str, np.ndarray]) -> int:
    """The most bytes an update may have: runtime.max_payload_mb, or by default twice the encoded size of the
    model's trainable state (float32, as updates travel) plus 1 MiB."""
    if cfg.runtime.max_payload_mb is not None:
        return int(cfg.runtime.max_payload_mb * 2**20)
    spec = {name: (tuple(array.shape), "float32") for name, array in trainable.items()}
    return UPDATE_STATES * wire.encoded_size(spec, {}) + METADATA_ALLOWANCE


def download_limit(cfg: RunConfig) -> int:
    """The most bytes a server payload may have on a client: runtime.max_payload_mb, or 4096 MiB."""
    mb = cfg.runtime.max_payload_mb if cfg.runtime.max_payload_mb is not None else DOWNLOAD_LIMIT_MB
    return int(mb * 2**20)
