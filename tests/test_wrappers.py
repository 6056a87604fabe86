"""Privacy and robustness as wrappers around an algorithm's halves (as Flower's strategy wrappers go around any
strategy): the wrapper passes on the whole contract, takes the place of the weighted mean of any algorithm that
offers it (a plugin's included), and a robust rule is a registered kind a user adds in one file."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from conftest import REPO
from docs_samples import docs_sample
from helpers import tiny_config

import fedpeft
from fedpeft.algorithms import make_client, make_server
from fedpeft.algorithms.base import ClientAlgorithm, ServerAlgorithm
from fedpeft.algorithms.privacy.wrapper import PrivateClient, PrivateServer
from fedpeft.algorithms.registry import ALGORITHMS
from fedpeft.algorithms.robust.registry import ROBUST_RULES, robust_aggregate
from fedpeft.algorithms.robust.wrapper import RobustServer
from fedpeft.algorithms.wrapping import ClientWrapper, ServerWrapper
from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.plugins import _file_module_name
from fedpeft.rundir import read_metrics
from fedpeft.wire import Payload

EXAMPLE = REPO / "examples" / "custom_robust_rule"
PLUGIN = str(EXAMPLE / "plugin.py")


def _public_methods(cls):
    return {name for name, value in inspect.getmembers(cls, callable)
            if not name.startswith("_") and not isinstance(inspect.getattr_static(cls, name), classmethod)}


def test_a_wrapper_passes_on_every_method_of_the_halves_contract():
    """A method added to ServerAlgorithm (or ClientAlgorithm) that the wrappers did not pass on would run on the
    wrapper's own (empty) state: every public method is the wrapper's own."""
    assert _public_methods(ServerAlgorithm) >= {"select", "accept", "aggregate", "combine", "state_dict"}
    assert _public_methods(ServerAlgorithm) - set(vars(ServerWrapper)) == set()
    assert _public_methods(ClientAlgorithm) - set(vars(ClientWrapper)) == set()


def updates_with_an_outlier():
    values = [[1, 1], [2, 2], [3, 3], [4, 4], [100, -100]]
    return {c: Payload({"w": np.array(v, np.float32)}, {"round": 1, "num_examples": 1}) for c, v in enumerate(values)}


class ProbeOptions(fedpeft.AlgorithmOptions):
    name: Literal["wrapped_probe"] = "wrapped_probe"
    robust: fedpeft.RobustRule | None = None


class ProbeServer(fedpeft.ServerAlgorithm[ProbeOptions]):
    """Half a step along whatever takes the place of the clients' weighted mean change."""

    def aggregate(self, rnd, updates):
        ids = sorted(updates)
        d = self.combine(rnd, [{k: updates[c].arrays[k] - v for k, v in self.global_state.items()} for c in ids],
                         [updates[c].meta["num_examples"] for c in ids], ids)
        self.global_state = {k: (v + 0.5 * d[k]).astype(np.float32) for k, v in self.global_state.items()}
        return {}


@pytest.fixture
def probe():
    fedpeft.register_algorithm("wrapped_probe", options=ProbeOptions, server=ProbeServer,
                               client=ALGORITHMS["fedavg"].client_code)
    yield
    ALGORITHMS.remove("wrapped_probe")


def test_a_plugin_algorithm_that_offers_robust_gets_every_rule(probe):
    options = load_config(None, ["algorithm.name=wrapped_probe", "algorithm.robust={rule: median}",
                                 "federation.num_clients=5", "federation.clients_per_round=5",
                                 "federation.min_replies=5"]).algorithm
    server = make_server(options, {"w": np.zeros(2, np.float32)}, num_clients=5, clients_per_round=5, seed=0)
    assert isinstance(server, RobustServer) and isinstance(server.inner, ProbeServer)
    server.aggregate(1, updates_with_an_outlier())
    assert server.global_state["w"].tolist() == [1.5, 1.0]  # half the median (3, 2)
    assert server.round_info()["client_update_norm"]["4"] == pytest.approx(100 * np.sqrt(2))
    plain = make_server(ProbeOptions(), {"w": np.zeros(2, np.float32)}, num_clients=5, clients_per_round=5, seed=0)
    assert type(plain) is ProbeServer
    plain.aggregate(1, updates_with_an_outlier())
    assert plain.global_state["w"].tolist() == pytest.approx([11.0, -9.0])  # half the mean (22, -18)


def test_the_wrappers_a_config_turns_on():
    private = tiny_config("algorithm.dp={noise_multiplier: 1.0}").algorithm
    server = make_server(private, {"w": np.zeros(2, np.float32)}, num_clients=4, clients_per_round=2, seed=0)
    assert isinstance(server, PrivateServer) and server.innermost is server.inner
    assert isinstance(make_client(private), PrivateClient)
    plain = tiny_config().algorithm
    assert plain.wrappers() == [] and not isinstance(make_client(plain), ClientWrapper)
    assert not isinstance(make_server(plain, {"w": np.zeros(2, np.float32)}, num_clients=4, clients_per_round=2,
                                      seed=0), ServerWrapper)
    with pytest.raises(ConfigError, match="algorithm.dp and algorithm.robust together are not supported"):
        tiny_config("algorithm.dp={noise_multiplier: 1.0}", "algorithm.robust={rule: median}",
                    "federation.clients_per_round=4", "federation.min_replies=4")


@pytest.mark.parametrize("name", ROBUST_RULES.names())
def test_every_registered_rule_with_its_defaults_keeps_a_scaled_update_from_owning_the_aggregate(name):
    """The contract of a robust rule, over the registry: with one attacker among enough updates for the rule's
    defaults, the aggregate has the updates' form and stays near the honest ones."""
    rule = ROBUST_RULES[name].options()
    n = max(rule.min_updates(), 10)
    rng = np.random.default_rng(0)
    honest = [{"w": (np.ones(20) + 0.1 * rng.normal(size=20)).astype(np.float32),
               "b": np.ones((2, 3), np.float32)} for _ in range(n - 1)]
    attack = {"w": (-1000 * honest[0]["w"]).astype(np.float32), "b": np.full((2, 3), 1e4, np.float32)}
    result = robust_aggregate([*honest, attack], [10] * n, rule)
    assert result.aggregate["b"].shape == (2, 3) and result.aggregate["w"].dtype == np.float32
    assert len(result.norms) == n
    assert np.linalg.norm(result.aggregate["w"] - 1) < 2.0 and np.abs(result.aggregate["b"] - 1).max() < 1e3 / n


@pytest.fixture
def unloads_the_example():
    """Forget the example plugin's rule and module afterwards (a later load registers it again)."""
    yield
    ROBUST_RULES.remove("geometric_median")
    sys.modules.pop(_file_module_name(Path(PLUGIN)), None)


def test_a_robust_rule_is_registered_in_one_file_and_used_by_every_robust_algorithm(unloads_the_example):
    plugin = fedpeft.load_plugin(PLUGIN)
    assert ROBUST_RULES["geometric_median"].options is plugin.GeometricMedianRule
    # by hand: the geometric median of a unit square's corners (0, 0), (1, 0), (0, 1) and the far (50, 50) is the
    # square's centre, where the four unit vectors towards them cancel; the weighted mean is (12.75, 12.75)
    points = [{"w": np.array(p, np.float32)} for p in ([0, 0], [1, 0], [0, 1], [50, 50])]
    result = robust_aggregate(points, [1, 1, 1, 1], plugin.GeometricMedianRule(iterations=100, smoothing=1e-9))
    assert result.aggregate["w"].tolist() == pytest.approx([0.5, 0.5], abs=1e-3)
    assert result.norms[3] == pytest.approx(50 * np.sqrt(2))  # (filled in for a rule that reports no norms)
    for algorithm in ("fedavg", "fedadam", "fedprox", "ffa_lora"):
        cfg = tiny_config(f"algorithm.name={algorithm}", "algorithm.robust={rule: geometric_median}",
                          "federation.clients_per_round=3", "federation.min_replies=3", plugins=[PLUGIN])
        assert isinstance(cfg.algorithm.robust, plugin.GeometricMedianRule)
    with pytest.raises(ConfigError, match="rule geometric_median needs at least 3 updates per round"):
        tiny_config("algorithm.robust={rule: geometric_median}", plugins=[PLUGIN])
    with pytest.raises(ConfigError, match=r"algorithm.fedavg.robust.geometric_median.steps: unknown key"):
        tiny_config("algorithm.robust={rule: geometric_median, steps: 3}", plugins=[PLUGIN])
    ROBUST_RULES.remove("geometric_median")
    with pytest.raises(ConfigError, match="unknown choice 'geometric_median'; valid choices: 'krum', 'median'"):
        tiny_config("algorithm.robust={rule: geometric_median}")


def test_the_docs_rule_is_the_example_s(unloads_the_example):
    """docs/guide/robustness.md's sample registers the rule as written and aggregates as the example file does."""
    namespace: dict = {"__name__": "docs_robust_rule"}
    exec(compile(docs_sample("robust-rule"), "docs robust-rule sample", "exec", dont_inherit=True), namespace)  # noqa: S102
    assert ROBUST_RULES["geometric_median"].options is namespace["GeometricMedianRule"]
    ROBUST_RULES.remove("geometric_median")
    plugin = fedpeft.load_plugin(PLUGIN)
    rng = np.random.default_rng(1)
    ups = [{"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
           for _ in range(6)]
    docs = namespace["geometric_median"](ups, [1, 2, 3, 4, 5, 6], namespace["GeometricMedianRule"]())
    example = plugin.geometric_median(ups, [1, 2, 3, 4, 5, 6], plugin.GeometricMedianRule())
    assert all(np.array_equal(docs.aggregate[k], example.aggregate[k]) for k in ("a", "b"))


@pytest.mark.needs_data
def test_the_example_robust_rule_runs_from_the_command_line(tmp_path, capsys, unloads_the_example):
    assert main(["methods", "--kind", "robust", "--plugin", PLUGIN]) == 0
    listed = capsys.readouterr().out
    assert "algorithm.robust.rule (6 registered)" in listed and "geometric_median" in listed
    assert main(["run", str(EXAMPLE / "config.yaml"), "--plugin", PLUGIN, "--run-dir", "run", "--no-progress"]) == 0
    rows = read_metrics("run")
    assert [r["round"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert len(row["client_update_norm"]) == 5 and row["adversarial_clients"] == [row["adversarial_clients"][0]]
        attacker = str(row["adversarial_clients"][0])  # its update is 10 times an honest one
        assert row["client_update_norm"][attacker] > 5 * min(row["client_update_norm"].values())


def test_a_rule_is_refused_unless_it_is_a_robust_rule_named_as_registered():
    class Misnamed(fedpeft.RobustRuleOptions):
        rule: Literal["one"] = "one"

    class NotARule(fedpeft.AlgorithmOptions):
        name: Literal["two"] = "two"

    with pytest.raises(ValueError, match="rule must default to 'two'"):
        fedpeft.register_robust_rule("two", options=Misnamed, aggregate=lambda u, w, r: None)
    with pytest.raises(TypeError, match="options must subclass fedpeft.RobustRuleOptions"):
        fedpeft.register_robust_rule("two", options=NotARule, aggregate=lambda u, w, r: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"algorithm.robust.rule 'median' is already registered \(by "
                                         r"fedpeft.algorithms.robust\)"):
        fedpeft.register_robust_rule("median", options=type("MedianAgain", (ROBUST_RULES["median"].options,), {}),
                                     aggregate=lambda u, w, r: None)
    with pytest.raises(ValueError, match="aggregate: code reference 'nocolon'"):
        fedpeft.register_robust_rule("one", options=Misnamed, aggregate="nocolon")


def test_a_rule_that_returns_something_else_is_stopped():
    class Broken(fedpeft.RobustRuleOptions):
        rule: Literal["broken_rule"] = "broken_rule"

    results = {"dict": {"w": np.zeros(2, np.float32)}, "shape": fedpeft.RobustResult({"w": np.zeros(3, np.float32)}),
               "nan": fedpeft.RobustResult({"w": np.array([np.nan, 0], np.float32)})}
    ups = [{"w": np.ones(2, np.float32)}] * 3
    fedpeft.register_robust_rule("broken_rule", options=Broken, aggregate=lambda u, w, r: results[mode])
    try:
        mode = "dict"
        with pytest.raises(fedpeft.UserError, match="returned a dict; return a fedpeft.RobustResult"):
            robust_aggregate(ups, [1, 1, 1], Broken())
        mode = "shape"
        with pytest.raises(fedpeft.UserError, match="returned other tensors or shapes"):
            robust_aggregate(ups, [1, 1, 1], Broken())
        mode = "nan"
        with pytest.raises(fedpeft.UserError, match="returned NaN or Inf in 'w'"):
            robust_aggregate(ups, [1, 1, 1], Broken())
    finally:
        ROBUST_RULES.remove("broken_rule")


class SilentServer(fedpeft.ServerAlgorithm[ProbeOptions]):
    """Declares robust (its options) but averages by itself: the option would do nothing."""

    def aggregate(self, rnd, updates):
        ids = sorted(updates)
        self.global_state = {k: np.mean([updates[c].arrays[k] for c in ids], axis=0) for k in self.global_state}
        return {}


def test_an_algorithm_that_declares_the_option_but_aggregates_without_combine_is_stopped():
    fedpeft.register_algorithm("wrapped_probe", options=ProbeOptions, server=SilentServer,
                               client=ALGORITHMS["fedavg"].client_code)
    try:
        options = ProbeOptions(robust={"rule": "median"})
        server = make_server(options, {"w": np.zeros(2, np.float32)}, num_clients=5, clients_per_round=5, seed=0)
        with pytest.raises(RuntimeError, match="algorithm.robust: the server half of algorithm wrapped_probe "
                                               "aggregated without ServerAlgorithm.combine"):
            server.aggregate(1, updates_with_an_outlier())
    finally:
        ALGORITHMS.remove("wrapped_probe")


@pytest.mark.parametrize("overrides, first", [
    (["algorithm.robust={rule: median}", "federation.min_replies=3", "federation.clients_per_round=3",
      "federation.num_clients=4", "federation.asynchronous={buffer_size: 2}"], "need federation.num_clients >= 5"),
    (["algorithm.dp={noise_multiplier: 1.0}", "federation.clients_per_round=4", "system.over_selection=0.5"],
     "selects 6 clients a round"),
])
def test_a_wrapper_s_checks_come_where_the_config_checks_that_section(overrides, first):
    """A config with several problems names the same first one as before the options became wrappers."""
    with pytest.raises(ConfigError, match=first):
        tiny_config(*overrides)
