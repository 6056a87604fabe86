"""The server wrapper of ``algorithm.robust``: the rule the config names in place of the weighted mean of the
clients' changes, around any algorithm with a ``robust`` option."""

from __future__ import annotations

from typing import Any

from fedpeft.algorithms.base import ServerAlgorithm, UpdateRejected
from fedpeft.algorithms.robust.core import round_report
from fedpeft.algorithms.robust.registry import robust_aggregate
from fedpeft.algorithms.wrapping import ServerWrapper
from fedpeft.config.adversarial import RobustRuleOptions
from fedpeft.wire import Arrays


class RobustServer(ServerWrapper):
    """Aggregates the clients' changes with the registered rule ``settings.rule`` (the algorithm's own server step
    then steps on the result) and reports per round what the rule did (kept, excluded, clipped, every update's
    norm)."""

    settings: RobustRuleOptions

    def __init__(self, inner: ServerAlgorithm[Any], settings: RobustRuleOptions) -> None:
        super().__init__(inner, settings)
        self.report: dict[str, Any] = {}
        self.take_mean()

    def combine(self, rnd: int, deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays:
        result = robust_aggregate(deltas, weights, self.settings)
        self.report = round_report(result, clients)
        return result.aggregate

    def round_info(self) -> dict[str, Any]:
        info, self.report = self.report, {}
        return {**self.inner.round_info(), **info}

    def aggregate_mean(self, rnd: int, mean_update: dict[str, Any]) -> dict[str, float]:
        raise UpdateRejected("robust aggregation needs each client's update, not their mean")
