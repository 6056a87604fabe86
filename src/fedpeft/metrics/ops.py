"""Analytic training OPs of paper 000 (Appendix A, Table 6), transcribed as printed.

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
BitFit have no row of their own and count the backbone only.

These are the paper's formulas (note the d^3 terms), kept for comparability with its tables; they
are not physical FLOPs. Measured FLOPs come from ``torch.utils.flop_counter`` (see training.local).

Pruned training (head pruning, paper 000 Sec. 4.3): the paper reports 3.9x fewer OPs at 90% sparsity
but does not say how sparsity enters Table 6. Our reading, ``head_fraction`` = kept heads / all heads:
the head-associated rows (QKV, attention, and the method's own row: LoRA, IA3 or the prompt rows, which
include attention) are multiplied by the kept fraction; the FC row is not. For T5-small with LoRA r=16
at T=512 this gives 3.81x at 90% sparsity, against the paper's printed 33.07G / 8.47G = 3.90x. It is a
count of what a pruned-head implementation would compute, not of what fedpeft computes: fedpeft masks
the pruned slices' updates, so the measured FLOPs of dense and pruned training are the same.
"""

from __future__ import annotations

from typing import Any


def components(L: int, d: int, T: int, r: int = 0, Tp: int = 0) -> dict[str, tuple[float, float]]:
    """(forward, backward) OPs of every Table 6 row for one sequence."""
    L, d, T, r, Tp = float(L), float(d), float(T), float(r), float(Tp)
    prompt_fwd = Tp * d**3 + (Tp + T) ** 2 * d**2 + (Tp + T) ** 3 * d
    prompt_bwd = Tp * d**3 + (Tp + T) ** 2 * d**2 + 3 * (Tp + T) ** 3 * d
    return {
        "qkv": (L * T * d**3, L * (T * d**3 + T * d**2)),
        "attention": (L * (T**2 * d**2 + T**3 * d), L * (T**2 * d**2 + 3 * T**3 * d)),
        "fc": (L * T * d**3, L * (T * d**3 + T * d**2)),
        "lora": (L * (T * d**2 * r + T * r**2 * d), L * (T * d**2 * r + 2 * T * r * d + T * r**2 * d + T * d**3)),
        "ia3": (L * T * d, L * 2 * T * d),
        "prompt_tuning": (prompt_fwd, prompt_bwd),
        "p_tuning": (L * prompt_fwd, L * prompt_bwd),
    }


ROWS_BY_METHOD = {
    "full": ("qkv", "attention", "fc"),
    "bitfit": ("qkv", "attention", "fc"),
    "houlsby": ("qkv", "attention", "fc"),
    "pfeiffer": ("qkv", "attention", "fc"),
    "lora": ("qkv", "attention", "fc", "lora"),
    "ia3": ("qkv", "attention", "fc", "ia3"),
    "prompt_tuning": ("qkv", "fc", "prompt_tuning"),
    "p_tuning": ("qkv", "fc", "prompt_tuning"),
    "prefix_tuning": ("qkv", "fc", "p_tuning"),
}


HEAD_ROWS = frozenset({"qkv", "attention", "lora", "ia3", "prompt_tuning", "p_tuning"})


def sequence_ops(method: str, L: int, d: int, T: int, options: dict[str, Any] | None = None,
                 head_fraction: float = 1.0) -> float:
    """Training OPs (forward + backward) of one sequence of T tokens under ``method``; with
    ``head_fraction`` < 1 the head-associated rows are scaled by it (pruned training, see above)."""
    if not 0.0 <= head_fraction <= 1.0:
        raise ValueError(f"head_fraction must be in [0, 1], got {head_fraction}")
    options = options or {}
    r = int(options.get("r", 0) or 0)
    Tp = int(options.get("num_virtual_tokens", 0) or 0)
    rows = components(L, d, T, r=r, Tp=Tp)
    return float(sum(sum(rows[name]) * (head_fraction if name in HEAD_ROWS else 1.0)
                     for name in ROWS_BY_METHOD[method]))


def all_conventions(method: str, config, tokens: int, options: dict[str, Any] | None = None,
                    head_fraction: float = 1.0, sparsity: float | None = None) -> dict[str, float]:
    """OPs of one training sequence of ``tokens`` tokens on the backbone ``config`` under every counting
    convention this module offers (name -> OPs)."""
    from fedpeft.models.layout import model_shape

    shape = model_shape(config)
    return {"appendix_a": sequence_ops(method, shape.num_attention_modules, shape.hidden, tokens, options, head_fraction)}
