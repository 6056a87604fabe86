"""What a run holds in a tokenizer's place for a vision transformer (``task.type: image_classification``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageProcessing:
    """A vision transformer's image processor (resize, normalise), its input channels and its tokens per image
    (patches and class token). It pads nothing and has no special tokens: the ``*_token_id`` a tokenizer has
    are None."""

    processor: Any
    channels: int
    tokens: int
    pad_token_id: None = None
    eos_token_id: None = None
    sep_token_id: None = None
