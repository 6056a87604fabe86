"""Full fine-tuning's analytic OPs (:mod:`fedpeft.tuners.analytic_ops`): Table 6 has no row of its own (the
backbone's rows), and paper 000's MAC convention adds the weight gradients: 3a of q, k, v (pruned) and a of the
output projection (not pruned)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.tuners.analytic_ops import OpsTerms, backbone_rows, paper000_products


def full_ops(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    Lf, df, Tf = float(L), float(d), float(T)
    a, b, _ = paper000_products(Lf, df, Tf)
    return OpsTerms(backbone_rows(Lf, df, Tf), (3 * a, 9 * a + 5 * b))
