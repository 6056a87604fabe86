"""IA3's analytic OPs (:mod:`fedpeft.tuners.analytic_ops`): the backbone's rows and Table 6's IA3 row (a row of
the attention heads); in paper 000's MAC convention, 9c for the three scaling vectors (forward c, backward 2c;
pruned) and the q/k/v weight-gradient term 3a."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.tuners.analytic_ops import OpsTerms, Row, backbone_rows, head_row, paper000_products


def ia3_row(L: float, d: float, T: float) -> Row:
    """Table 6's IA3 row as printed."""
    return (L * T * d, L * 2 * T * d)


def ia3_ops(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    Lf, df, Tf = float(L), float(d), float(T)
    a, b, c = paper000_products(Lf, df, Tf)
    return OpsTerms((*backbone_rows(Lf, df, Tf), head_row(ia3_row(Lf, df, Tf))), (2 * a, 9 * a + 5 * b + 9 * c))
