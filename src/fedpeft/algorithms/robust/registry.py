"""The registered Byzantine-robust aggregation rules: a name, its options model and its aggregation function.

fedpeft's rules register here (``fedpeft/algorithms/robust/__init__.py``) through
:func:`register_robust_rule`, the function a plugin calls (``fedpeft.register_robust_rule``); an algorithm with a
``robust`` option aggregates with whichever rule the config names (see :mod:`fedpeft.algorithms.robust.wrapper`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from fedpeft import registry
from fedpeft.algorithms.robust.core import RobustResult, check_same_layout, norms
from fedpeft.config.adversarial import RobustRuleOptions
from fedpeft.errors import UserError
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, code_ref, resolve

# (the round's updates x_c - x, the clients' sample counts, the rule's options) -> the aggregate and what it did
RobustAggregate = Callable[[Sequence[Mapping[str, np.ndarray]], Sequence[float], Any], RobustResult]


class RobustRuleError(UserError, ValueError):
    """A robust rule returned something else than an aggregate of the updates' form (a one-line error naming it)."""


@dataclass(frozen=True)
class RegisteredRobustRule:
    """One registered rule (see :func:`register_robust_rule`); ``aggregate`` may be a lazy
    :class:`~fedpeft.registry.CodeRef`, resolved on first use."""

    name: str
    options: type[RobustRuleOptions]
    aggregate_code: RobustAggregate | CodeRef

    @property
    def aggregate(self) -> RobustAggregate:
        return resolve(self.aggregate_code)


# the registry of fedpeft.registry, typed with its full entries (the same object)
ROBUST_RULES = cast("registry.Registry[RegisteredRobustRule]", registry.ROBUST_RULES)


def register_robust_rule(name: str, *, options: type[RobustRuleOptions], aggregate: RobustAggregate | CodeRef | str
                         ) -> None:
    """Register a Byzantine-robust aggregation rule under ``name``: ``options`` is its pydantic options model (a
    subclass of ``fedpeft.RobustRuleOptions`` with ``rule: Literal[name] = name``; its ``min_updates`` and
    ``check`` say what the rule needs of a federation) and ``aggregate(updates, weights, options)`` its rule: the
    round's updates (x_c - x, one dict of float32 arrays per client, same names and shapes), the clients' sample
    counts and the options, to a ``fedpeft.RobustResult`` whose ``aggregate`` has the updates' names and shapes.
    ``aggregate`` may be a ``"package.module:attribute"`` reference (imported on first use). From then on
    ``algorithm.robust: {rule: NAME, ...}`` is valid for every algorithm with a ``robust`` option."""
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    if not (isinstance(options, type) and issubclass(options, RobustRuleOptions)):
        raise TypeError(f"register_robust_rule({name!r}): options must subclass fedpeft.RobustRuleOptions")
    if options.model_fields["rule"].default != name:
        raise ValueError(f"register_robust_rule({name!r}): {options.__name__}.rule must default to {name!r}, e.g. "
                         f"rule: Literal[{name!r}] = {name!r}")
    try:
        code = code_ref(aggregate)
    except ValueError as exc:
        raise ValueError(f"register_robust_rule({name!r}): aggregate: {exc}") from None
    if not isinstance(code, CodeRef) and not callable(code):
        raise TypeError(f"register_robust_rule({name!r}): aggregate must be a function (updates, weights, options) "
                        "-> fedpeft.RobustResult")
    ROBUST_RULES.add(name, RegisteredRobustRule(name, options, code), same=_same_options)


def _same_options(a: RegisteredRobustRule, b: RegisteredRobustRule) -> bool:
    """The same rule registered again (a plugin module loaded twice, or its file imported anew)."""
    return (a.options.__module__, a.options.__qualname__) == (b.options.__module__, b.options.__qualname__)


def registered_robust_rule(name: str) -> RegisteredRobustRule:
    """The rule registered under ``name`` (fedpeft's built-ins registered first); a one-line ValueError listing the
    registered ones otherwise."""
    load_built_ins()
    return ROBUST_RULES.require(name, "robust rule")


def robust_aggregate(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                     rule: RobustRuleOptions) -> RobustResult:
    """Aggregate ``updates`` with the registered rule ``rule`` names (an ``algorithm.robust`` section); ``weights``
    are the clients' sample counts, for the rules that weigh. The aggregate is ``.aggregate``, checked to have the
    updates' names and shapes and finite values (else a RobustRuleError); :func:`~fedpeft.algorithms.robust.core.round_report`
    turns the rest into metrics.jsonl entries."""
    if not updates:
        raise ValueError("robust aggregation of no updates")
    names = check_same_layout(updates)
    result = registered_robust_rule(rule.rule).aggregate(updates, weights, rule)
    if not isinstance(result, RobustResult):
        raise RobustRuleError(f"robust rule {rule.rule!r} returned a {type(result).__name__}; return a "
                              "fedpeft.RobustResult")
    out = result.aggregate
    if sorted(out) != names or any(np.shape(out[k]) != np.shape(updates[0][k]) for k in names):
        raise RobustRuleError(f"robust rule {rule.rule!r} returned other tensors or shapes than the updates it "
                              "aggregated")
    bad = next((k for k in names if not np.all(np.isfinite(out[k]))), None)
    if bad is not None:
        raise RobustRuleError(f"robust rule {rule.rule!r} returned NaN or Inf in {bad!r} (updates that large "
                              "overflow float32; a plugin rule: check its arithmetic)")
    if not result.norms:
        result.norms = [float(x) for x in norms(updates)]
    return result


