"""Each client's own loss out of one forward pass over a fused batch.

A Hugging Face model computes its training loss inside ``forward`` (a mean over the whole batch, with
``torch.nn.functional.cross_entropy``, ``mse_loss`` or ``binary_cross_entropy_with_logits``, written inline or
through ``model.loss_function``). During a fused forward those three functions are replaced by ones that split
their input at the clients' row boundaries and record, per client, the *sum* of its terms and how many terms
it has; the trainer divides each sum by the client's own denominator, so each client's loss is exactly the
mean the model would have computed over that client's batch alone. A model whose loss is computed otherwise
(another function, a reduction other than the mean, a loss over tensors not laid out by rows) raises
:class:`~fedpeft.tuners.row_batched.RowBatchUnsupported`, and the clients train one at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedpeft.tuners.row_batched import RowBatchUnsupported

SPLIT = ("cross_entropy", "mse_loss", "binary_cross_entropy_with_logits")


@dataclass
class ClientLosses:
    """Per client slot: the summed loss terms of its rows (with grad) and how many terms they are."""

    segments: Sequence[tuple[int, int, int]]  # (slot, first row, end row) of each client's rows in the batch
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    calls: int = 0


def _terms(name: str, target: torch.Tensor, ignore_index: int) -> int:
    if name == "cross_entropy" and not target.is_floating_point():
        return int((target != ignore_index).sum())
    if name == "cross_entropy":  # class probabilities: one term per row
        return int(target.shape[0]) if target.dim() > 1 else 1
    return int(target.numel())


def _split(name: str, original, record: ClientLosses, num_rows: int):
    def split_loss(input: torch.Tensor, target: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        reduction = kwargs.pop("reduction", "mean")
        if any(a is not None for a in args) or reduction != "mean" or kwargs.get("weight") is not None or kwargs.get("label_smoothing"):
            raise RowBatchUnsupported(f"the model's loss calls {name} with options a fused pass cannot split per "
                                      "client (only a plain mean is split)")
        record.calls += 1
        if record.calls > 1:
            raise RowBatchUnsupported(f"the model computes more than one loss term ({name} called twice in one forward)")
        x, y = (input.reshape(1), target.reshape(1)) if input.dim() == 0 else (input, target)
        if x.shape[0] % num_rows or y.shape[0] != x.shape[0]:
            raise RowBatchUnsupported(f"the model's {name} gets {tuple(x.shape)} against {tuple(y.shape)}: not "
                                      f"laid out by the fused batch's {num_rows} rows")
        per_row = x.shape[0] // num_rows
        ignore = kwargs.get("ignore_index", -100)
        total = x.new_zeros(())
        for slot, first, end in record.segments:
            xs, ys = x[first * per_row:end * per_row], y[first * per_row:end * per_row]
            part = original(xs, ys, reduction="sum", **kwargs)
            record.sums[slot] = part
            record.counts[slot] = _terms(name, ys, ignore)
            total = total + part.detach()
        return total / max(1, sum(record.counts.values()))  # the batch's mean, as the model expects (unused)

    return split_loss


@contextlib.contextmanager
def client_losses(record: ClientLosses, num_rows: int) -> Iterator[ClientLosses]:
    """Within the block, the model's loss functions record each client's sum and count into ``record``."""
    originals = {name: getattr(F, name) for name in SPLIT}
    try:
        for name, original in originals.items():
            setattr(F, name, _split(name, original, record, num_rows))
        yield record
    finally:
        for name, original in originals.items():
            setattr(F, name, original)
