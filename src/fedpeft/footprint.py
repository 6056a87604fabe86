"""What one PEFT method costs on one backbone, from its architecture config alone (no weights): trainable
parameters, the upload per client and round in the papers' convention and as a run's wire bytes, and
the analytic training OPs, dense and under head pruning at a sparsity. ``fedpeft model NAME`` prints it.

Conventions:

* **papers' upload** (``paper_mib``): the method's own tensors only (no task head), float32, in MiB
  (2^20 bytes), the way paper 000 (Tables 1-4) and papers 002/003 count communication. Under head
  pruning: the tensors that are not tied to a head in full, plus the head-tied ones times the kept
  fraction ``1 - s`` (paper 000, Table 3: 3.38 -> 1.86 MB for T5-small LoRA r16 at 90%).
* **run bytes** (``run_bytes``): ``wire.encoded_size`` of what a client really uploads: every trainable
  array (task head included), for head pruning the kept heads' slices plus the kept-head ids and the
  importance scores (``fedpeft.heads.sparse.packed_spec``, ``keep_count`` heads kept, spread over the
  key/value groups: with grouped key/value heads the most a client can send), and the metadata of a
  typical FedAvg / head-pruning update. A real run's metadata differs by the digits of its numbers
  (within 64 bytes, tested).
* **OPs**: per training sequence of ``tokens`` tokens, by ``fedpeft.metrics.ops`` (see there for the
  conventions and which one a run reports).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedpeft import wire
from fedpeft.heads import LayoutError, build_layout, keep_count
from fedpeft.heads.sparse import packed_spec
from fedpeft.metrics import ops as analytic
from fedpeft.models.architectures import build_on_meta
from fedpeft.models.layout import TASK_HEADS, arch_spec

MIB = 2**20
DEFAULT_HEADS = TASK_HEADS
# the metadata of a typical client update (fedavg / headprune clients): numbers of typical width
_UPDATE_META = {"round": 1, "client": 0, "num_examples": 90, "train_loss": 1.0986122886681098, "train_steps": 6,
                "train_examples": 90, "train_tokens": 11520, "train_seconds": wire.clock_text(2.0),
                "train_flops": wire.clock_text(1.0e12), "train_flops_sampled_steps": 1,
                "train_ops_analytic": 1.23456789e13}
_IMPORTANCE_META = {"importance_seconds": wire.clock_text(1.0), "importance_examples": 64}


@dataclass
class Footprint:
    model: str
    method: str
    options: dict[str, Any]
    kind: str
    trainable: int  # every parameter that trains, task head included
    peft_parameters: int  # the method's own tensors (no task head)
    task_head_parameters: int
    paper_mib: float
    run_bytes: int
    tokens: int
    ops: dict[str, float | None]  # convention -> OPs per sequence, dense (None: the convention does not count it)
    sparsity: float | None = None
    num_heads: int | None = None
    kept_heads: int | None = None
    head_parameters: int | None = None  # of peft_parameters, those tied to attention heads
    paper_mib_pruned: float | None = None
    run_bytes_pruned: int | None = None
    ops_pruned: dict[str, float | None] = field(default_factory=dict)
    pruning_note: str | None = None  # why there is no pruned column

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _task_head_names(spec: dict[str, Any], model_type: str) -> set[str]:
    try:
        heads = set(arch_spec(model_type).heads)
    except ValueError:
        heads = set(DEFAULT_HEADS)
    # peft marks the task head's modules modules_to_save (DistilBERT: pre_classifier and classifier)
    return {n for n in spec if "modules_to_save" in n.split(".")
            or any(part in heads or part.endswith("classifier") for part in n.split("."))}


def footprint(name: str, config, method_opts, kind: str, *, num_labels: int = 2, sparsity: float | None = None,
              tokens: int = 128) -> Footprint:
    """The footprint of the PEFT method ``method_opts`` (a registered schema.PeftOptions) on ``config``."""
    from fedpeft.tuners import apply_tuner, registered_peft_method

    method = method_opts.method
    declared = registered_peft_method(method).analytic_ops
    tuned = apply_tuner(build_on_meta(config, kind, num_labels), method_opts, kind)
    spec = tuned.spec()
    head_names = _task_head_names(spec, config.model_type)
    peft_spec = {n: s for n, s in spec.items() if n not in head_names}
    peft_params = sum(math.prod(shape) for shape, _ in peft_spec.values())
    options = tuned.options
    out = Footprint(
        model=name, method=method, options=options, kind=kind, trainable=tuned.num_trainable(),
        peft_parameters=peft_params, task_head_parameters=tuned.num_trainable() - peft_params,
        paper_mib=4 * peft_params / MIB, run_bytes=wire.encoded_size(spec, _UPDATE_META), tokens=tokens,
        ops=analytic.all_conventions(declared, config, tokens, options), sparsity=sparsity)
    if sparsity is None:
        return out
    try:
        layout = build_layout(spec, config, method)
    except LayoutError as exc:
        out.pruning_note = str(exc)
        return out
    kept = keep_count(layout.num_heads, sparsity)
    # Which heads are kept changes the size only with grouped key/value heads (a key/value slice travels if any
    # head of its group is kept): evenly spread heads fall in different groups, the most a client can send.
    spread = np.unique(np.linspace(0, layout.num_heads, kept, endpoint=False).astype(np.int64))
    head_params = sum(math.prod(p.shape) for p in layout.params.values())
    packed = packed_spec(spec, layout, spread, with_scores=True)
    out.num_heads, out.kept_heads, out.head_parameters = layout.num_heads, kept, head_params
    out.paper_mib_pruned = 4 * (peft_params - head_params + (1.0 - sparsity) * head_params) / MIB
    out.run_bytes_pruned = wire.encoded_size(packed, {**_UPDATE_META, **_IMPORTANCE_META})
    out.ops_pruned = analytic.all_conventions(declared, config, tokens, options,
                                              head_fraction=kept / layout.num_heads, sparsity=sparsity)
    return out
