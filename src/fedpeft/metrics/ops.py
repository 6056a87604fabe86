"""Analytic training OPs of paper 000: Appendix A (Table 6) transcribed as printed, and the convention that
reproduces the paper's printed figures.

Per training sequence of T tokens, with L attention modules (encoder self + decoder self + decoder
cross attention; this matches the paper's Table 7: T5-small L=18, T5-base L=36), hidden size d,
LoRA rank r and Tp prompt tokens:

=============  ===========================================  ===================================================
component      forward                                      backward
=============  ===========================================  ===================================================
QKV            L(T d^3)                                     L(T d^3 + T d^2)
attention      L(T^2 d^2 + T^3 d)                           L(T^2 d^2 + 3 T^3 d)
FC             L(T d^3)                                     L(T d^3 + T d^2)
LoRA           L(T d^2 r + T r^2 d)                         L(T d^2 r + 2 T r d + T r^2 d + T d^3)
IA3            L(T d)                                       L(2 T d)
prompt tuning  Tp d^3 + (Tp+T)^2 d^2 + (Tp+T)^3 d           Tp d^3 + (Tp+T)^2 d^2 + 3 (Tp+T)^3 d
P-tuning       L x the prompt-tuning row                    L x the prompt-tuning row
=============  ===========================================  ===================================================

How methods combine the rows (the paper lists components; the sums are our reading):
backbone = QKV + attention + FC (forward and backward); LoRA and IA3 add their row; prompt tuning
and P-tuning replace the attention row with theirs. fedpeft maps ``prompt_tuning`` and ``p_tuning``
(input-level prompts) to the prompt-tuning row and ``prefix_tuning`` (prompts at every layer, which
is what paper 000 calls P-tuning) to the P-tuning row. Full fine-tuning, bottleneck adapters and
BitFit have no row of their own and count the backbone only. Each method declares its count when it
registers (``analytic_ops``, a function returning :class:`~fedpeft.tuners.analytic_ops.OpsTerms`; a built-in's
own rows are in its package, ``fedpeft/tuners/<method>/ops.py``, the shared ones in
:mod:`fedpeft.tuners.analytic_ops`); a method that declares none reports its analytic OPs as unknown.

These are the paper's formulas as printed (note the d^3 terms); they are not physical FLOPs, and they do
not reproduce the paper's own figures (T5-small, LoRA r16, T = 512: 13,691 G against the printed 33.07 G).
:func:`paper000_macs` is the counting convention that does reproduce them (multiply-accumulates per
sequence; every printed figure of Tables 1, 3 and 4 within 0.4%). Runs report the Appendix-A transcription as
``ops_analytic`` (``client_ops_analytic`` in metrics.jsonl), unchanged so that earlier runs stay
comparable; ``fedpeft model`` prints both. Measured FLOPs come from ``torch.utils.flop_counter`` with
attention counted alike on torch's kernels (:mod:`fedpeft.metrics.flops`; see training.local).

Pruned training (head pruning, paper 000 Sec. 4.3): the paper reports 3.9x fewer OPs at 90% sparsity
but does not say how sparsity enters Table 6. Our reading, ``head_fraction`` = kept heads / all heads:
the head-associated rows (QKV, attention, and the method's own row: LoRA, IA3 or the prompt rows, which
include attention) are multiplied by the kept fraction; the FC row is not. For T5-small with LoRA r=16
at T=512 this gives 3.81x at 90% sparsity, against the paper's printed 33.07G / 8.47G = 3.90x. It is a
count of what a pruned-head implementation would compute, not of what fedpeft computes: fedpeft masks
the pruned slices' updates, so the measured FLOPs of dense and pruned training are the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.tuners.analytic_ops import AnalyticOps


def method_ops(method: str) -> AnalyticOps:
    """The analytic OPs the PEFT method ``method`` declared (a one-line ValueError if it declared none)."""
    from fedpeft.tuners import registered_peft_method

    ops = registered_peft_method(method).analytic_ops
    if ops is None:
        raise ValueError(f"peft method {method!r} declared no analytic OPs (register_peft_method(analytic_ops=...))")
    return ops


def sequence_ops(method: str, L: int, d: int, T: int, options: Mapping[str, Any] | None = None,
                 head_fraction: float = 1.0) -> float:
    """Training OPs (forward + backward) of one sequence of T tokens counted by the Table 6 rows the PEFT method
    ``method`` declares; with ``head_fraction`` < 1 the head-associated rows are scaled by it (pruned training,
    see above)."""
    return method_ops(method)(L, d, T, options or {}, None).appendix_a_ops(head_fraction)


def paper000_macs(method: str, L: int, d: int, T: int, options: Mapping[str, Any] | None = None,
                  kept_fraction: float = 1.0, heads: int | None = None) -> float:
    """Training MACs of one sequence of T tokens in the convention that reproduces paper 000's printed OPs
    (Tables 1, 3 and 4: every figure within 0.06% but RoBERTa's, +0.4% / +0.2%, when fed the paper's Table 7
    L, H and d; Table 2's 20 Newsgroups figures are not reproduced; see BENCHMARKS.md "Paper 000 OPs, paper
    vs ours"). It is a reconstruction fitted to the printed figures, not a formula the paper states.

    With a = L T d^2 (one d x d product over T tokens in each of the L attention modules), b = L T^2 d and
    c = L T d, each method declares a fixed part and a part scaled by the kept fraction of heads, written in its
    package's ``ops.py`` (the frozen backbone and the input prompts, which several methods count, in
    :mod:`fedpeft.tuners.analytic_ops`). The frozen backbone: query/key/value projections forward and input
    gradient 6a, attention 5b (pruned); the attention output projection ("FC" in Table 6) forward and input
    gradient 2a (not pruned); no feed-forward block, embeddings or task head. Methods the paper does not count
    (bottleneck adapters, BitFit) count as the frozen backbone.

    Units: MACs (one multiply-add = 1), the paper's "OPs"; G = 1e9. A ValueError for a method whose declaration
    has no MAC terms.
    """
    value = method_ops(method)(L, d, T, options or {}, heads).paper000_ops(kept_fraction)
    if value is None:
        raise ValueError(f"peft method {method!r} declares no terms of paper 000's MAC convention")
    return value


CONVENTIONS = ("paper000_macs", "appendix_a")


def all_conventions(ops: AnalyticOps | None, config: Any, tokens: int, options: Mapping[str, Any] | None = None,
                    head_fraction: float = 1.0, sparsity: float | None = None) -> dict[str, float | None]:
    """OPs of one training sequence of ``tokens`` tokens on the backbone ``config`` under every counting
    convention this module offers (name -> OPs, None where the declaration ``ops`` of a method does not count
    it, or where the method declares none). ``paper000_macs`` scales the pruned terms by ``1 - sparsity`` (the
    paper's exact fraction) when a sparsity is given, else by ``head_fraction``; ``appendix_a`` scales the head
    rows by ``head_fraction`` (the kept heads / all heads of a run)."""
    from fedpeft.models.layout import uniform_shape

    shape = uniform_shape(config)
    if shape is None or ops is None:  # stages of different widths (Swin), no attention (ConvNeXt), no declaration
        return {"paper000_macs": None, "appendix_a": None}
    terms = ops(shape.num_attention_modules, shape.hidden, tokens, options or {}, shape.num_heads)
    kept = head_fraction if sparsity is None else 1.0 - sparsity
    return {"paper000_macs": terms.paper000_ops(kept), "appendix_a": terms.appendix_a_ops(head_fraction)}
