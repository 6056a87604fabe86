"""Batches: length-grouped order and dynamic padding.

Length grouping (as in Hugging Face's LengthGroupedSampler): shuffle, cut the order into mega-batches
of ``group_factor`` batches, sort each mega-batch by length, cut into batches and shuffle the batches.
Batches then hold examples of similar length, so dynamic padding wastes little compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Encoded:
    """Tokenised examples of one split.

    ``labels`` is an int per example (classification) or a token-id array per example (language
    modelling: aligned with ``input_ids`` for causal LMs, decoder targets for seq2seq; -100 = ignored).
    """

    input_ids: list[np.ndarray]
    labels: list
    token_type_ids: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.input_ids), dtype=np.int64, count=len(self.input_ids))

    def subset(self, idx: np.ndarray) -> Encoded:
        idx = [int(i) for i in idx]
        return Encoded(
            input_ids=[self.input_ids[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            token_type_ids=None if self.token_type_ids is None else [self.token_type_ids[i] for i in idx],
        )


@dataclass
class ImageEncoded:
    """Images of one split, resized to the model's input: ``pixels`` (N, channels, height, width) uint8, and a class
    id per image. A batch is normalised when it is formed, ``(pixels x scale - mean) / std`` per channel (the
    image processor's rescale and normalisation; 4x less memory than holding float32). Every image is ``tokens``
    tokens long (its patches and class token), so batches need no padding and the token counts are exact."""

    pixels: np.ndarray
    labels: list
    tokens: int
    scale: float = 1.0 / 255
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def pixel_values(self, idx: np.ndarray) -> torch.Tensor:
        """The images ``idx`` as the model takes them: float32, rescaled and normalised."""
        x = torch.from_numpy(self.pixels[np.asarray(idx, dtype=np.int64)]).to(torch.float32) * self.scale
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        return (x - mean) / std

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        return np.full(len(self.labels), self.tokens, dtype=np.int64)

    def subset(self, idx: np.ndarray) -> ImageEncoded:
        idx = np.asarray(idx, dtype=np.int64)
        return ImageEncoded(self.pixels[idx], [self.labels[int(i)] for i in idx], self.tokens, self.scale,
                            self.mean, self.std)


def length_grouped_batches(
    lengths: np.ndarray, batch_size: int, rng: np.random.Generator, group_factor: int = 50
) -> list[np.ndarray]:
    perm = rng.permutation(len(lengths))
    mega = batch_size * group_factor
    batches: list[np.ndarray] = []
    for start in range(0, len(perm), mega):
        chunk = perm[start : start + mega]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def shuffled_batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(n)
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]


def sequential_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Evaluation order: sorted by length (less padding), deterministic."""
    order = np.argsort(-lengths, kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _pad(seqs: list[np.ndarray], value: int, side: str) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = np.full((len(seqs), width), value, dtype=np.int64)
    for row, s in enumerate(seqs):
        if side == "left":
            out[row, width - len(s) :] = s
        else:
            out[row, : len(s)] = s
    return torch.from_numpy(out)


def collate(data: Encoded | ImageEncoded, idx: np.ndarray, pad_id: int | None,
            padding_side: str = "right") -> dict[str, torch.Tensor]:
    """Pad one batch to its own longest sequence (images: the batch's pixel values, all of one size)."""
    if isinstance(data, ImageEncoded):
        return {"pixel_values": data.pixel_values(idx),
                "labels": torch.tensor([data.labels[int(i)] for i in idx], dtype=torch.long)}
    if pad_id is None:
        raise ValueError("a text batch needs the tokenizer's pad id")
    ids = [data.input_ids[i] for i in idx]
    batch = {
        "input_ids": _pad(ids, pad_id, padding_side),
        "attention_mask": _pad([np.ones(len(s), dtype=np.int64) for s in ids], 0, padding_side),
    }
    if data.token_type_ids is not None:
        batch["token_type_ids"] = _pad([data.token_type_ids[i] for i in idx], 0, padding_side)
    labels = [data.labels[i] for i in idx]
    if labels and isinstance(labels[0], np.ndarray):
        batch["labels"] = _pad(labels, -100, padding_side)
    else:
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
    return batch
