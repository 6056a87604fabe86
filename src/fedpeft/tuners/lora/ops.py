"""LoRA's analytic OPs (:mod:`fedpeft.tuners.analytic_ops`): the backbone's rows and Table 6's LoRA row (rank r,
a row of the attention heads); in paper 000's MAC convention, 3 x 6 T d r per module (forward 2, backward 4
products of T d r), of which 12 r c is not pruned and 6 r c is, plus (d / H) c (pruned) whatever the rank, a
term the printed figures need (``heads`` None takes d / H = 64)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.tuners.analytic_ops import OpsTerms, Row, backbone_rows, head_row, paper000_products


def lora_row(L: float, d: float, T: float, r: float) -> Row:
    """Table 6's LoRA row as printed."""
    return (L * (T * d**2 * r + T * r**2 * d), L * (T * d**2 * r + 2 * T * r * d + T * r**2 * d + T * d**3))


def lora_ops(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    Lf, df, Tf = float(L), float(d), float(T)
    r = float(int(options.get("r", 0) or 0))
    a, b, c = paper000_products(Lf, df, Tf)
    head_dim = df / heads if heads else 64.0
    return OpsTerms((*backbone_rows(Lf, df, Tf), head_row(lora_row(Lf, df, Tf, r))),
                    (2 * a + 12 * r * c, 6 * a + 5 * b + 6 * r * c + head_dim * c))
