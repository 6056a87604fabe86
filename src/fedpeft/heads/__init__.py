"""Attention-head machinery of paper 000: head layout of trainable parameters, head importance,
pruning and the sparse per-head wire format."""

from fedpeft.heads.importance import Importance, head_importance
from fedpeft.heads.layout import HeadLayout, HeadParam, HeadUnit, LayoutError, build_layout
from fedpeft.heads.sparse import (
    ALPHA_KEY,
    KEPT_KEY,
    keep_count,
    kept_at_random,
    kept_by_importance,
    pack,
    unpack_into,
)

__all__ = [
    "ALPHA_KEY",
    "KEPT_KEY",
    "HeadLayout",
    "HeadParam",
    "HeadUnit",
    "Importance",
    "LayoutError",
    "build_layout",
    "head_importance",
    "keep_count",
    "kept_at_random",
    "kept_by_importance",
    "pack",
    "unpack_into",
]
