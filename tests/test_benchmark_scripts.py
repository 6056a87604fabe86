"""The benchmark scripts that train or reuse runs share their setup through benchmarks/results_io.py: a run's
config (``results_io.load_config``: plugins trusted, no progress bar) and training it or reusing its finished run
(``results_io.train_or_reuse``), not a copy of that code in each script."""

from __future__ import annotations

import ast
import sys

import pytest
from conftest import REPO

BENCHMARKS = REPO / "benchmarks"


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def test_no_benchmark_script_copies_the_shared_setup():
    copies = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name == "results_io.py":
            continue
        for node in ast.walk(ast.parse(script.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if _name(node.func) == "reuse_or_clear":
                copies.append(f"{script.name}:{node.lineno}: calls reuse_or_clear (use results_io.train_or_reuse)")
            if _name(node.func) == "partial" and node.args and _name(node.args[0]) in ("read_config", "load_config"):
                copies.append(f"{script.name}:{node.lineno}: its own load_config (use results_io.load_config)")
    assert not copies, "\n".join(copies)


@pytest.fixture
def results_io():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import results_io

        yield results_io
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_shared_config_trusts_the_plugins_is_quiet_and_lets_a_set_turn_the_bar_on(results_io, monkeypatch):
    import fedpeft.config

    seen = []
    real = fedpeft.config.load_config
    monkeypatch.setattr(fedpeft.config, "load_config",
                        lambda *a, **kw: seen.append(kw.get("trust_plugins")) or real(*a, **kw))
    cfg = results_io.load_config(REPO / "configs" / "quickstart.yaml", ["federation.rounds=1"])
    assert seen == [True]
    assert cfg.runtime.progress is False and cfg.federation.rounds == 1
    assert results_io.load_config(REPO / "configs" / "quickstart.yaml", ["runtime.progress=true"]).runtime.progress
