"""Small builders shared by the runtime tests."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedpeft import checkpoint
from fedpeft.config import load_config
from fedpeft.rundir import read_metrics, read_summary

TIMING_KEYS = {"time_client_s", "time_aggregation_s", "time_evaluation_s", "time_overhead_s", "time_round_s", "wall_s",
               "time_schedule_s",
               "client_train_seconds", "agg_importance_s_mean",
               "client_process_s", "client_setup_s", "client_start_delay_s", "client_return_delay_s",
               "peak_rss_mb", "peak_accelerator_mb", "backbone_bytes"}  # and the memory figures


def tiny_config(*overrides: str, plugins=()):
    base = [
        "model.name=tiny-bert", "task.dataset=sst2", "task.max_train_examples=64", "task.max_length=32",
        "federation.num_clients=4", "federation.clients_per_round=2", "federation.rounds=2",
        "train.batch_size=8", "eval.max_examples=32", "eval.batch_size=32", "runtime.progress=false",
    ]
    return load_config(None, [*base, *overrides], plugins=plugins)


def without_timings(rows):
    out = []
    for r in rows:
        out.append({k: v for k, v in r.items() if k not in TIMING_KEYS})
    return out


def slow_host(monkeypatch) -> list[float]:
    """Make every local training take three times as long (and 0.2 s more), as on a slower or busy host. Returns
    the list to which each added sleep (seconds) is appended: a test checks the slowdown against it, not against
    another run's timings (which a loaded machine can stretch as much)."""
    import time

    from fedpeft.training.local import LocalTrainer

    real_train = LocalTrainer.train
    added: list[float] = []

    def slow_train(self, *args, **kwargs):
        started = time.perf_counter()
        result = real_train(self, *args, **kwargs)
        added.append(2 * (time.perf_counter() - started) + 0.2)
        time.sleep(added[-1])
        return result

    monkeypatch.setattr(LocalTrainer, "train", slow_train)
    return added


def crash_at_round(rt, monkeypatch, rnd: int) -> None:
    """Make ``rt.run()`` raise KeyboardInterrupt on reaching round ``rnd`` (earlier rounds are checkpointed)."""
    real_round = rt.run_round

    def die(r, wall_start):
        if r == rnd:
            raise KeyboardInterrupt
        return real_round(r, wall_start)

    monkeypatch.setattr(rt, "run_round", die)


def crash_in_checkpoint(monkeypatch, rnd: int) -> None:
    """Make the checkpoint of round ``rnd`` raise KeyboardInterrupt: the round's metrics row is written, its
    checkpoint never is (``monkeypatch.undo()`` restores checkpoint.save)."""
    from fedpeft import checkpoint

    real_save = checkpoint.save

    def save_then_die(run_dir, r, state):
        if r == rnd:
            raise KeyboardInterrupt
        return real_save(run_dir, r, state)

    monkeypatch.setattr(checkpoint, "save", save_then_die)


# summary.json entries that differ between two runs of the same work (clocks, memory, where it ran)
SUMMARY_VOLATILE = {"wall_s", "time_to_target_s", "time_client_s", "time_aggregation_s", "time_evaluation_s",
                    "time_overhead_s", "peak_rss_mb", "peak_accelerator_mb", "run_dir"}


def final_state(run_dir: Path) -> dict[str, np.ndarray]:
    """The global trainable state of a run's last checkpoint."""
    return checkpoint.load(run_dir)[1]["server"]["global_state"]


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs of the same work gave the same metrics, summary and final global state (timings aside)."""
    assert without_timings(read_metrics(a)) == without_timings(read_metrics(b))
    sa, sb = read_summary(a), read_summary(b)
    assert ({k: v for k, v in sa.items() if k not in SUMMARY_VOLATILE}
            == {k: v for k, v in sb.items() if k not in SUMMARY_VOLATILE})
    ga, gb = final_state(a), final_state(b)
    assert ga.keys() == gb.keys() and all(np.array_equal(ga[k], gb[k]) for k in ga)


def write_flower_app(folder: Path, package: str, modules: dict[str, str], *, serverapp: str, clientapp: str,
                     config: dict, publisher: str = "fedpeft-tests") -> Path:
    """A Flower app of the tests' own in ``folder``: the package ``package`` with ``modules`` (file stem ->
    source) and a pyproject.toml naming its ServerApp and ClientApp (``module:attribute`` inside the package)
    and its run config."""
    import tomli_w

    (folder / package).mkdir(parents=True)
    (folder / package / "__init__.py").write_text("")
    for stem, source in modules.items():
        (folder / package / f"{stem}.py").write_text(source)
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": package, "version": "1.0.0", "description": f"test app {package}",
                    "license": "Apache-2.0", "dependencies": []},
        "tool": {"hatch": {"build": {"targets": {"wheel": {"packages": ["."]}}}},
                 "flwr": {"app": {"publisher": publisher,
                                  "components": {"serverapp": f"{package}.{serverapp}",
                                                 "clientapp": f"{package}.{clientapp}"},
                                  "config": config}}},
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(pyproject))
    return folder


def install_entry_point_plugin(monkeypatch, folder: Path, module: str, text: str) -> None:
    """Make ``text`` the plugin of an installed package: module ``module`` (written to ``folder``, put on the
    path) whose ``register`` function is the only entry point of the ``fedpeft.plugins`` group, not loaded yet."""
    from importlib.metadata import EntryPoint

    from fedpeft import plugins

    (folder / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    found = [EntryPoint(name=module, value=f"{module}:register", group=plugins.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(plugins, "entry_points", lambda group: found if group == plugins.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_installed_loaded", False)


# A loss travels as its shortest text: a last digit that moves changes a payload's safetensors header padding by
# 8 bytes, and a round's (or the run's cumulative) count sums many payloads. A tensor too many or too few changes
# a payload by its bytes plus its header entry (about 80 bytes): outside this for one payload's count (16 bytes
# up to 160 KB), though a tiny tensor in a large cumulative count could hide in the relative slack.
BYTES_SLACK, BYTES_REL_SLACK = 16, 1e-4


def metrics_difference(a, b, path: str = "", rel_tol: float = 1e-5) -> str | None:
    """None if two metrics values (rows, dicts, lists) agree, else where they first differ: floats to ``rel_tol``
    (absolute 1e-7), byte counts to BYTES_SLACK or BYTES_REL_SLACK, everything else exactly."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None or not math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-7):
            return f"{path}: {a!r} != {b!r}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(set(a) ^ set(b))} differ"
        return next((d for k in a if (d := metrics_difference(a[k], b[k], f"{path}.{k}", rel_tol)) is not None), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := metrics_difference(x, y, f"{path}[{i}]", rel_tol)) is not None), None)
    if "bytes" in path and isinstance(a, int) and isinstance(b, int):
        slack = max(BYTES_SLACK, int(BYTES_REL_SLACK * max(a, b)))
        return None if abs(a - b) <= slack else f"{path}: {a!r} != {b!r} (more than {slack} bytes apart)"
    return None if a == b else f"{path}: {a!r} != {b!r}"
