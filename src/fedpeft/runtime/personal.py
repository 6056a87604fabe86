"""Personalized evaluation (``eval.personalized``): each selected client scores the model its algorithm
assembles for it (the global part it received plus what it keeps) on a held-out slice of its own partition,
and reports the scores with its update; the round's row gets them per client and as the mean weighted by
the slices' sizes, as personalized federated learning papers report.

The client half decides when its personalized model is assembled and calls ``ctx.evaluate_personal()``
there, before training; the runtime decides whether anything is due (the rounds the global model is
evaluated: every ``eval.every`` rounds and the last) and does the scoring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedpeft.algorithms.base import MAX_EXAMPLES, UpdateRejected, finite_number, shown
from fedpeft.config import RunConfig
from fedpeft.training.evaluate import PREDICTIONS, evaluate

PERSONAL = "personal"  # the update's metadata key of the report
EXAMPLES = "examples"  # the held-out examples the scores are over


def personal_due(cfg: RunConfig, rnd: int) -> bool:
    every = cfg.eval.every
    return cfg.eval.personalized and (rnd == cfg.federation.rounds or (every > 0 and rnd % every == 0))


def score(exp: Any, module: Any, task: Any) -> dict[str, float]:
    """The task's metrics of ``module`` on ``task``'s eval split (a client's held-out slice), as plain
    numbers named without the ``eval_`` prefix, with the number of examples."""
    cfg = exp.cfg
    result = evaluate(module, task, tokenizer=exp.tokenizer, device=exp.device, batch_size=cfg.eval.batch_size,
                      encoder_decoder=exp.encoder_decoder, max_new_tokens=cfg.task.generation_max_new_tokens,
                      precision=cfg.runtime.precision)
    out: dict[str, Any] = {EXAMPLES: _count(task.eval)}
    for k, v in result.items():
        if k in (PREDICTIONS, "_examples") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[k.removeprefix("eval_")] = float(v)
    return out


def _count(data: Any) -> int:
    """Examples of an evaluation set of any kind (fedpeft.data.prepare.EvalSet)."""
    for name in ("references", "gold"):  # generation / instruction; multiple choice
        if hasattr(data, name):
            return len(getattr(data, name))
    return len(data)  # classification


def check_personal(value: Any) -> str | None:
    """Why a client's personalized report cannot be used (one line), or None."""
    if not isinstance(value, Mapping):
        return f"the personalized evaluation report is {type(value).__name__}, not an object of scores"
    n = value.get(EXAMPLES)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_EXAMPLES:
        return (f"the personalized evaluation report's '{EXAMPLES}' is {shown(n)}, not a positive integer "
                "up to 2**53")
    for k, v in value.items():
        if k == EXAMPLES:
            continue
        try:
            finite_number(v, k)
        except UpdateRejected:
            return f"the personalized evaluation report's {shown(k)} is {shown(v)}, not a finite number"
    return None


def personal_row(metas: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The round's personalized entries: ``client_personal`` (client -> its scores) and ``personal_<metric>``,
    the mean over the reporting clients weighted by their held-out examples."""
    reports = {c: m[PERSONAL] for c, m in metas.items() if PERSONAL in m and check_personal(m[PERSONAL]) is None}
    if not reports:
        return {}
    row: dict[str, Any] = {"client_personal": {str(c): dict(r) for c, r in sorted(reports.items())}}
    total = sum(r[EXAMPLES] for r in reports.values())
    names = sorted({k for r in reports.values() for k in r if k != EXAMPLES})
    for name in names:
        having = [r for r in reports.values() if name in r]
        weight = sum(r[EXAMPLES] for r in having)
        # in float64 (a client's score may be a huge JSON integer: an int product would not convert back)
        row[f"personal_{name}"] = sum(float(r[name]) * r[EXAMPLES] for r in having) / weight
    row["personal_examples"] = total
    return row
