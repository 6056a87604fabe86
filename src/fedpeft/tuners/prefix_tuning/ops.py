"""Prefix tuning's analytic OPs (:mod:`fedpeft.tuners.analytic_ops`): prompts at every layer, which is what
paper 000 calls P-tuning: Table 6's P-tuning row (L times the prompt row) in place of the attention row, and the
prompt term in each of the L modules in the MAC convention (the paper does not print Table 3's number of virtual
tokens; 20 is inferred)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.tuners.analytic_ops import OpsTerms, prompt_terms


def prefix_ops(L: int, d: int, T: int, options: Mapping[str, Any], heads: int | None) -> OpsTerms:
    return prompt_terms(L, d, T, options, copies=L)
