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
BitFit have no row of their own and count the backbone only. Each method declares its rows when it
registers (``analytic_ops``; the built-in ones in ``fedpeft/tuners/__init__.py``); a method without rows
reports its analytic OPs as unknown.

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


# The methods paper 000 counts (paper000_macs); fedpeft's bottleneck adapters and BitFit are counted there as
# the frozen backbone, like full fine-tuning's forward pass (the paper does not count them).
PAPER000_METHODS = ("full", "lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "houlsby", "pfeiffer",
                    "bitfit")


HEAD_ROWS = frozenset({"qkv", "attention", "lora", "ia3", "prompt_tuning", "p_tuning"})


def rows_ops(rows: tuple[str, ...], L: int, d: int, T: int, options: dict[str, Any] | None = None,
             head_fraction: float = 1.0) -> float:
    """Training OPs (forward + backward) of one sequence of T tokens counted by the Table 6 ``rows`` (a PEFT
    method's registered ``analytic_ops``); with ``head_fraction`` < 1 the head-associated rows are scaled by it
    (pruned training, see above)."""
    if not 0.0 <= head_fraction <= 1.0:
        raise ValueError(f"head_fraction must be in [0, 1], got {head_fraction}")
    options = options or {}
    r = int(options.get("r", 0) or 0)
    Tp = int(options.get("num_virtual_tokens", 0) or 0)
    table = components(L, d, T, r=r, Tp=Tp)
    return float(sum(sum(table[name]) * (head_fraction if name in HEAD_ROWS else 1.0) for name in rows))


def sequence_ops(method: str, L: int, d: int, T: int, options: dict[str, Any] | None = None,
                 head_fraction: float = 1.0) -> float:
    """:func:`rows_ops` of a registered PEFT method with analytic rows, by name."""
    from fedpeft.tuners import registered_peft_method

    rows = registered_peft_method(method).analytic_ops
    if rows is None:
        raise ValueError(f"peft method {method!r} registered no analytic OPs rows")
    return rows_ops(rows, L, d, T, options, head_fraction)


def paper000_macs(method: str, L: int, d: int, T: int, options: dict[str, Any] | None = None,
                  kept_fraction: float = 1.0, heads: int | None = None) -> float:
    """Training MACs of one sequence of T tokens in the convention that reproduces paper 000's printed OPs
    (Tables 1, 3 and 4: every figure within 0.06% but RoBERTa's, +0.4% / +0.2%, when fed the paper's Table 7
    L, H and d; Table 2's 20 Newsgroups figures are not reproduced; see BENCHMARKS.md "Paper 000 OPs, paper
    vs ours"). It is a reconstruction fitted to the printed figures, not a formula the paper states.

    With a = L T d^2 (one d x d product over T tokens in each of the L attention modules), b = L T^2 d and
    c = L T d, per method (``fixed`` is not pruned, ``pruned`` is scaled by the kept fraction of heads):

    * the frozen backbone: query/key/value projections forward and input gradient 6a, attention 5b (pruned);
      the attention output projection ("FC" in Table 6) forward and input gradient 2a (not pruned); no
      feed-forward block, embeddings or task head;
    * full fine-tuning adds the weight gradients: 3a (q, k, v; pruned) and a (output projection; not pruned);
    * LoRA of rank r on q, k, v: 3 x 6 T d r per module (forward 2, backward 4 products of T d r), of which
      12 r c is not pruned and 6 r c is, plus (d / H) c (pruned) whatever the rank: a fitted term the
      figures need (d / H = 64 for every Table 7 backbone but RoBERTa's 42.7, which fits RoBERTa better
      than a constant 64 or T / 8 would; ``heads`` None takes 64);
    * IA3: 9c (three scaling vectors, forward c and backward 2c; pruned) and the q/k/v weight-gradient term 3a;
    * input prompts (prompt_tuning, p_tuning) of Tp tokens inside the T-token window (T - Tp input tokens):
      the backbone rows over T - Tp tokens with q/k/v forward only (3a'), plus 2 Tp d^2 (not pruned) and
      9 Tp d^2 (pruned) once; prompts at every layer (prefix_tuning, the paper's P-tuning): the same with
      the prompt row in each of the L modules (the 20 virtual tokens of Table 3 are inferred: the paper does
      not print them);
    * methods the paper does not count (bottleneck adapters, BitFit): the frozen backbone.

    Units: MACs (one multiply-add = 1), the paper's "OPs"; G = 1e9.
    """
    options = options or {}
    k = float(kept_fraction)
    if not 0.0 <= k <= 1.0:
        raise ValueError(f"kept_fraction must be in [0, 1], got {kept_fraction}")
    L, d, T = float(L), float(d), float(T)
    a, b, c = L * T * d * d, L * T * T * d, L * T * d
    if method in ("prompt_tuning", "p_tuning", "prefix_tuning"):
        Tp = float(options.get("num_virtual_tokens", 0) or 0)
        Ti = max(T - Tp, 0.0)
        rows = L if method == "prefix_tuning" else 1.0
        fixed = 2 * L * Ti * d * d + rows * 2 * Tp * d * d
        pruned = 3 * L * Ti * d * d + 5 * L * Ti * Ti * d + rows * 9 * Tp * d * d
    elif method == "full":
        fixed, pruned = 3 * a, 9 * a + 5 * b
    elif method == "lora":
        r = float(options.get("r", 0) or 0)
        head_dim = d / heads if heads else 64.0
        fixed, pruned = 2 * a + 12 * r * c, 6 * a + 5 * b + 6 * r * c + head_dim * c
    elif method == "ia3":
        fixed, pruned = 2 * a, 9 * a + 5 * b + 9 * c
    else:
        fixed, pruned = 2 * a, 6 * a + 5 * b
    return fixed + k * pruned


CONVENTIONS = ("paper000_macs", "appendix_a")


def all_conventions(method: str, config, tokens: int, options: dict[str, Any] | None = None,
                    head_fraction: float = 1.0, sparsity: float | None = None,
                    rows: tuple[str, ...] | None = None) -> dict[str, float | None]:
    """OPs of one training sequence of ``tokens`` tokens on the backbone ``config`` under every counting
    convention this module offers (name -> OPs, None where the convention does not count ``method``).
    ``paper000_macs`` counts the methods of ``PAPER000_METHODS`` and scales the pruned rows by ``1 - sparsity``
    (the paper's exact fraction) when a sparsity is given, else by ``head_fraction``; ``appendix_a`` counts the
    Table 6 ``rows`` (a registered method's ``analytic_ops``; None: not counted) with ``head_fraction`` (the kept heads / all
    heads of a run)."""
    from fedpeft.models.layout import uniform_shape

    shape = uniform_shape(config)
    if shape is None:  # stages of different widths (Swin), or no attention (ConvNeXt): not counted
        return {"paper000_macs": None, "appendix_a": None}
    L, d = shape.num_attention_modules, shape.hidden
    kept = head_fraction if sparsity is None else 1.0 - sparsity
    counted = method in PAPER000_METHODS
    return {"paper000_macs": paper000_macs(method, L, d, tokens, options, kept, heads=shape.num_heads) if counted
            else None,
            "appendix_a": rows_ops(rows, L, d, tokens, options, head_fraction) if rows is not None else None}
