"""Every built-in algorithm and PEFT method gives the metrics recorded in tests/golden/ (all fields but the
timings; floats to a relative 1e-5, which leaves room for another CPU's arithmetic; byte counts to 16 bytes or
a relative 1e-4, whichever is larger: a client's loss travels in its update's metadata as the shortest text that
reads back as the same float, so another CPU's last digits change that text's length and, through
safetensors' 8-byte header alignment, the payload's by 8, and a round's count sums many payloads; everything
else exactly)."""

from __future__ import annotations

import json

import pytest
from golden_runs import GOLDEN, golden_path, golden_rows
from helpers import metrics_difference


@pytest.mark.parametrize("name", sorted(GOLDEN))
@pytest.mark.needs_data
def test_metrics_match_the_recorded_run(name, tmp_path):
    expected = [json.loads(line) for line in golden_path(name).read_text().splitlines()]
    rows = json.loads(json.dumps(golden_rows(name, tmp_path / "run")))  # as written to metrics.jsonl
    difference = metrics_difference(rows, expected, name)
    assert difference is None, f"{difference} (rerecord only if the change of result is intended)"


def test_every_built_in_method_and_algorithm_has_a_golden_run():
    from golden_runs import METHODS

    from fedpeft.algorithms import ALGORITHMS
    from fedpeft.tuners import PEFT_METHODS

    def built_in(code) -> bool:  # plugins other tests loaded are registered too by now
        return code.__module__.startswith("fedpeft.")

    assert set(METHODS) == {n for n, m in PEFT_METHODS.items() if built_in(m.options)}
    covered = {part for name in GOLDEN for part in name.split("-")}
    algorithms = {n for n, a in ALGORITHMS.items() if built_in(a.options)}
    assert algorithms <= covered | {"fedavg"}, sorted(algorithms - covered)
