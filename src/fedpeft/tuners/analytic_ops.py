"""The analytic OPs a PEFT method declares (``register_peft_method(analytic_ops=f)``): paper 000's two counts of
one training sequence, as terms, so that a count can scale the ones head pruning removes.

A declaration is a function ``f(L, d, T, options, heads) -> OpsTerms`` (:class:`AnalyticOps`): L attention
modules, hidden size d, T tokens, the method's options as a mapping, and the number of attention heads (None:
unknown). Each method's own terms live in its package (``fedpeft/tuners/<method>/ops.py``); what several methods
share lives here, below their packages: Table 6's backbone rows (QKV, attention, FC) and its prompt row, the
frozen backbone of paper 000's MAC convention, and the declarations of the methods that count as the frozen
backbone (bottleneck adapters, BitFit) or as input prompts (prompt tuning, P-tuning v1). How the rows are read
and how the MAC convention was fitted is in :mod:`fedpeft.metrics.ops`, which sums the terms.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

Row = tuple[float, float]  # (forward, backward) OPs of one row of Table 6


@dataclass(frozen=True)
class OpsTerms:
    """One training sequence's analytic OPs of a method.

    * ``appendix_a``: the Table 6 rows the method counts, in the table's order, each as (its forward + backward
      OPs, whether it belongs to the attention heads: scaled by the kept fraction of heads under pruning).
    * ``paper000_macs``: (fixed, pruned) MACs in the convention that reproduces paper 000's printed figures
      (the pruned part is scaled by the kept fraction); None where that convention does not count the method.
    """

    appendix_a: tuple[tuple[float, bool], ...]
    paper000_macs: tuple[float, float] | None = None

    def appendix_a_ops(self, head_fraction: float = 1.0) -> float:
        """The Table 6 count, the head rows scaled by ``head_fraction`` (kept heads / all heads)."""
        if not 0.0 <= head_fraction <= 1.0:
            raise ValueError(f"head_fraction must be in [0, 1], got {head_fraction}")
        return float(sum(ops * (head_fraction if per_head else 1.0) for ops, per_head in self.appendix_a))

    def paper000_ops(self, kept_fraction: float = 1.0) -> float | None:
        """The MAC convention's count with ``kept_fraction`` of the heads (None: not counted)."""
        k = float(kept_fraction)
        if not 0.0 <= k <= 1.0:
            raise ValueError(f"kept_fraction must be in [0, 1], got {kept_fraction}")
        if self.paper000_macs is None:
            return None
        fixed, pruned = self.paper000_macs
        return fixed + k * pruned


class AnalyticOps(Protocol):
    """What a PEFT method declares as its analytic OPs (see the module's text)."""

    def __call__(self, L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms: ...


# --- Table 6's rows that several methods count (fedpeft.metrics.ops has the table as printed) ---------------

def qkv_row(L: float, d: float, T: float) -> Row:
    return (L * T * d**3, L * (T * d**3 + T * d**2))


def attention_row(L: float, d: float, T: float) -> Row:
    return (L * (T**2 * d**2 + T**3 * d), L * (T**2 * d**2 + 3 * T**3 * d))


def fc_row(L: float, d: float, T: float) -> Row:
    return (L * T * d**3, L * (T * d**3 + T * d**2))


def prompt_row(d: float, T: float, Tp: float) -> Row:
    """Table 6's prompt-tuning row (prompts of Tp tokens at the input); its P-tuning row is L times it."""
    return (Tp * d**3 + (Tp + T) ** 2 * d**2 + (Tp + T) ** 3 * d,
            Tp * d**3 + (Tp + T) ** 2 * d**2 + 3 * (Tp + T) ** 3 * d)


def head_row(row: Row) -> tuple[float, bool]:
    """A row of the attention heads (scaled under pruning), as OpsTerms.appendix_a holds it."""
    return (sum(row), True)


def backbone_rows(L: float, d: float, T: float) -> tuple[tuple[float, bool], ...]:
    """QKV, attention and FC: what every method counts of the backbone (FC is not a head row)."""
    return (head_row(qkv_row(L, d, T)), head_row(attention_row(L, d, T)), (sum(fc_row(L, d, T)), False))


def paper000_products(L: float, d: float, T: float) -> tuple[float, float, float]:
    """a = L T d^2 (one d x d product over T tokens in each attention module), b = L T^2 d, c = L T d."""
    return L * T * d * d, L * T * T * d, L * T * d


def frozen_backbone(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    """The methods that count as the frozen backbone (bottleneck adapters, BitFit: Table 6 has no row of theirs,
    and paper 000 does not count them)."""
    Lf, df, Tf = float(L), float(d), float(T)
    a, b, _ = paper000_products(Lf, df, Tf)
    return OpsTerms(backbone_rows(Lf, df, Tf), (2 * a, 6 * a + 5 * b))


def prompt_terms(L: int, d: int, T: int, options: Mapping[str, Any], copies: int) -> OpsTerms:
    """Prompts of ``options["num_virtual_tokens"]`` tokens in ``copies`` places (1: at the input; L: at every
    layer): the prompt row replaces the attention row (``copies`` times); in the MAC convention the prompts sit
    inside the T-token window."""
    Lf, df, Tf = float(L), float(d), float(T)
    Tp = float(int(options.get("num_virtual_tokens", 0) or 0))
    fwd, bwd = prompt_row(df, Tf, Tp)
    rows = ((sum(qkv_row(Lf, df, Tf)), True), (sum(fc_row(Lf, df, Tf)), False), (sum((copies * fwd, copies * bwd)), True))
    Ti = max(Tf - Tp, 0.0)
    fixed = 2 * Lf * Ti * df * df + copies * 2 * Tp * df * df
    pruned = 3 * Lf * Ti * df * df + 5 * Lf * Ti * Ti * df + copies * 9 * Tp * df * df
    return OpsTerms(rows, (fixed, pruned))


def input_prompts(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    """Prompts at the input only (prompt tuning, P-tuning v1): Table 6's prompt-tuning row."""
    return prompt_terms(L, d, T, options, copies=1)
