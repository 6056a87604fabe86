"""The benchmark scripts share their setup through benchmarks/results_io.py: a run's config
(``results_io.load_config``: plugins trusted, no progress bar) and training it or reusing its finished run
(``results_io.train_or_reuse``), not a copy of that code in each script."""

from __future__ import annotations

import ast
import sys

from conftest import REPO

BENCHMARKS = REPO / "benchmarks"


def test_no_benchmark_script_copies_the_shared_setup():
    copies = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name == "results_io.py":
            continue
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fedpeft.config":
                copies += [f"{script.name}: imports fedpeft.config.{a.name}" for a in node.names
                           if a.name == "load_config" and a.asname]  # (the partial(read_config, ...) copies)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "reuse_or_clear":
                copies.append(f"{script.name}:{node.lineno}: calls reuse_or_clear (use results_io.train_or_reuse)")
    assert not copies, "\n".join(copies)


def test_the_shared_config_is_trusted_and_quiet_and_lets_a_set_turn_the_bar_on():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import results_io
    finally:
        sys.path.remove(str(BENCHMARKS))
    cfg = results_io.load_config(REPO / "configs" / "quickstart.yaml", ["federation.rounds=1"])
    assert cfg.runtime.progress is False and cfg.federation.rounds == 1
    assert results_io.load_config(REPO / "configs" / "quickstart.yaml", ["runtime.progress=true"]).runtime.progress
