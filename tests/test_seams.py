"""The open seams: datasets, experiment trackers and runtimes registered from outside the package (a
``--plugin`` file, a config's ``plugins:``, an installed package's entry point) are first-class; the built-in
ones go through the same public functions; the CLI and the Python API start runs in one place."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import install_entry_point_plugin

import fedpeft
from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.registry import DATASETS, RUNTIMES, TRACKERS
from fedpeft.rundir import read_metrics, read_summary

# a throwaway dataset (a Hub dataset whose rows the plugin converts), tracker and runtime, registered the way a
# user's plugin does: through `import fedpeft` only
PLUGIN_SOURCE = '''
import fedpeft
from fedpeft.runtime.embedded import launch as embedded_launch
from fedpeft.tracking import Tracker

LAUNCHES = []   # (config name, resume, number of observers) of each run the toy runtime launched
SEEN = []       # (round, row) the rows tracker received


def review(row):
    return {"text": row["review"], "label": int(row["stars"] >= 3)}


class RowsTracker(Tracker):
    name = "rows"

    def log_row(self, rnd, row):
        SEEN.append((rnd, dict(row)))


def toy_launch(cfg, run_dir, *, resume, observers, log, on_run_dir):
    LAUNCHES.append((cfg.name, resume, len(observers)))
    return embedded_launch(cfg, run_dir, resume=resume, observers=observers, log=log, on_run_dir=on_run_dir)


fedpeft.register_dataset("toy_reviews", task="classification", hub_id="example-org/toy-reviews", convert=review,
                         default_metric="mcc")
fedpeft.register_tracker("rows", RowsTracker)
fedpeft.register_runtime("toy", toy_launch)
'''
THROWAWAY = ((DATASETS, "toy_reviews"), (TRACKERS, "rows"), (RUNTIMES, "toy"), (RUNTIMES, "remote"),
             (DATASETS, "installed_ds"), (TRACKERS, "installed_tr"), (RUNTIMES, "installed_rt"),
             (DATASETS, "coded_reviews"))
TINY = {"name": "seams", "model": {"name": "tiny-bert"},
        "task": {"dataset": "toy_reviews", "max_train_examples": 32, "max_length": 32},
        "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1},
        "train": {"batch_size": 8}, "eval": {"max_examples": 16},
        "runtime": {"name": "toy", "loggers": ["rows"], "progress": False}}


@pytest.fixture(autouse=True)
def forget_the_throwaways():
    yield
    for registry, name in THROWAWAY:
        registry.remove(name)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "toy_plugin.py"
    path.write_text(PLUGIN_SOURCE)
    return str(path)


@pytest.fixture
def toy_hub(monkeypatch):
    """The Hub dataset of toy_reviews, served from memory (the Hub is unreachable here)."""
    import datasets

    from fedpeft import hub

    splits = {"train": 64, "validation": 24}
    calls = []

    def load_dataset(hub_id, config=None, split=None, **_):
        assert hub_id == "example-org/toy-reviews", hub_id
        calls.append(split)
        return [{"review": f"{'great' if i % 2 else 'awful'} film number {i}", "stars": 5 if i % 2 else 1}
                for i in range(splits[split])]

    monkeypatch.setattr(hub, "hub_unavailable", lambda repo_id, repo_type: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_a_plugin_dataset_tracker_and_runtime_validate_and_unknown_names_list_them(plugin_file):
    cfg = load_config(None, ["task.dataset=toy_reviews", "runtime.name=toy", "runtime.loggers=[rows]"],
                      plugins=[plugin_file])
    assert (cfg.runtime.name, cfg.runtime.loggers) == ("toy", ["rows"])
    assert cfg.primary_metric() == "mcc"  # the registered dataset's default metric
    with pytest.raises(ConfigError, match=r"^runtime.name: unknown choice 'nope'; valid choices: 'embedded', "
                       r"'flower', 'toy'$"):
        load_config(None, ["runtime.name=nope"])
    with pytest.raises(ConfigError, match=r"^runtime.loggers: unknown choice 'nope'; valid choices: "
                       r"'mlflow', 'rows', 'tensorboard', 'wandb'$"):
        load_config(None, ["runtime.loggers=[rows, nope]"])


def test_without_the_plugin_its_names_are_refused():
    with pytest.raises(ConfigError, match=r"runtime.name: unknown choice 'toy'; valid choices: 'embedded', 'flower'$"):
        load_config(None, ["runtime.name=toy"])
    with pytest.raises(ConfigError, match=r"runtime.loggers: unknown choice 'rows'; valid choices: 'mlflow', "
                       r"'tensorboard', 'wandb'$"):
        load_config(None, ["runtime.loggers=[rows]"])


def test_the_command_line_runs_a_plugin_runtime_with_its_tracker_and_dataset(plugin_file, toy_hub, tmp_path,
                                                                           capsys):
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump(TINY))
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--plugin", plugin_file, "--run-dir", str(run_dir)]) == 0
    plugin = fedpeft.load_plugin(plugin_file)  # the module the run loaded (once per process)
    assert plugin.LAUNCHES == [("seams", False, 0)]  # the CLI's dispatch reached the toy runtime
    assert f"run directory: {run_dir}" in capsys.readouterr().err
    assert sorted(toy_hub) == ["train", "validation"]  # the dataset's rows came through its loader
    rows = read_metrics(run_dir)
    assert [rnd for rnd, _ in plugin.SEEN] == [r["round"] for r in rows] == [0, 1]  # the tracker got every row
    assert [row for _, row in plugin.SEEN] == rows
    assert read_summary(run_dir)["primary_metric"] == "mcc"
    assert json.loads((run_dir / "tracking.json").read_text()) == {"rows": {}}
    # the resumed run goes through the same dispatch, with the plugins its saved config lists
    assert main(["run", "--resume", str(run_dir), "--set", "federation.rounds=2"]) == 0
    assert plugin.LAUNCHES[-1] == ("seams", True, 0) and read_summary(run_dir)["rounds"] == 2


def test_the_python_api_runs_a_plugin_runtime_named_in_the_configs_plugins(plugin_file, toy_hub, tmp_path):
    class Rounds(fedpeft.RunObserver):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_round_end(self, rnd, row):
            self.seen.append(rnd)

    observer = Rounds()
    summary = fedpeft.run({**TINY, "plugins": [plugin_file]}, tmp_path / "run", observers=[observer])
    plugin = fedpeft.load_plugin(plugin_file)
    assert plugin.LAUNCHES == [("seams", False, 1)] and observer.seen == [0, 1]
    assert summary["primary_metric"] == "mcc" and [rnd for rnd, _ in plugin.SEEN] == [0, 1]
    fedpeft.resume(tmp_path / "run", rounds=2)
    assert plugin.LAUNCHES[-1] == ("seams", True, 0) and [rnd for rnd, _ in plugin.SEEN] == [0, 1, 2]


def test_a_runtime_that_runs_elsewhere_refuses_observers_by_its_declaration(tmp_path):
    launched = []
    fedpeft.register_runtime("remote", lambda *a, **k: launched.append(a), in_process=False)
    cfg = load_config(None, ["runtime.name=remote"])
    with pytest.raises(ConfigError, match=r"^observers watch a run in this process; runtime.name remote runs its "
                       r"server and clients in other processes: use runtime.name embedded, or read"):
        fedpeft.run(cfg, tmp_path / "run", observers=[fedpeft.RunObserver()])
    assert not launched and not (tmp_path / "run").exists()


def test_installed_packages_register_datasets_trackers_and_runtimes(tmp_path, monkeypatch):
    install_entry_point_plugin(monkeypatch, tmp_path, "installed_seams", (
        "import fedpeft\n"
        "def register():\n"
        "    fedpeft.register_dataset('installed_ds', task='generation', hub_id='example-org/ds',\n"
        "                             default_metric='bleu')\n"
        "    fedpeft.register_tracker('installed_tr', 'installed_seams:Missing', package='no_such_package_here')\n"
        "    fedpeft.register_runtime('installed_rt', 'installed_seams:launch')\n"
    ))
    cfg = load_config(None, ["task.dataset=installed_ds", "task.type=generation", "runtime.name=installed_rt",
                             "runtime.loggers=[installed_tr]"])
    assert cfg.primary_metric() == "bleu" and DATASETS.get("installed_ds").fields == ("input", "target")
    from fedpeft.tracking import TrackerUnavailable, check_available

    with pytest.raises(TrackerUnavailable, match=r"^runtime.loggers: installed_tr needs the no_such_package_here "
                       r"package, which is not installed: pip install no_such_package_here \(or remove"):
        check_available(cfg.runtime.loggers)


def test_bad_registrations_are_refused_in_one_line():
    cases = [
        (lambda: fedpeft.register_dataset("d", task="regression", hub_id="a/b"), "task 'regression' is not one of"),
        (lambda: fedpeft.register_dataset("d", task="classification", hub_id=""), "give the Hub dataset"),
        (lambda: fedpeft.register_dataset("d", task="generation", hub_id="a/b", fields=("input",)),
         "fields lacks target"),
        (lambda: fedpeft.register_dataset("sst2", task="classification", hub_id="a/b"), "already registered"),
        (lambda: fedpeft.register_tracker("t", 42), "give a subclass of fedpeft.tracking.Tracker"),
        (lambda: fedpeft.register_tracker("t", "no colon"), "package.module:attribute"),
        (lambda: fedpeft.register_tracker("t", "m:C", extra="x"), "name it as package too"),
        (lambda: fedpeft.register_runtime("r", 42), "give the launch function"),
        (lambda: fedpeft.register_runtime("embedded", "m:f"), "already registered"),
        (lambda: fedpeft.register_runtime("", "m:f"), "non-empty name"),
    ]
    for register, message in cases:
        with pytest.raises((ValueError, TypeError), match=message) as info:
            register()
        assert "\n" not in str(info.value)
    assert {"d", "t", "r"}.isdisjoint({*DATASETS, *TRACKERS, *RUNTIMES})


def test_the_built_ins_register_through_the_public_functions_and_the_closed_lists_are_gone():
    """In a fresh process: every entry of the three registries was added by fedpeft.register_dataset /
    register_tracker / register_runtime while the built-in modules loaded, and nothing else was."""
    probe = """
import sys
from fedpeft import registry
added = []
real = registry.Registry.add
def add(self, name, entry, **kw):
    added.append((self.kind, name, sys._getframe(1).f_code.co_name))
    return real(self, name, entry, **kw)
registry.Registry.add = add
from fedpeft.plugins import load_built_ins
load_built_ins()
seams = [a for a in added if a[0] in ("dataset", "tracker", "runtime")]  # the methods' registries fill too
print(sorted(seams) == sorted((kind, name, f"register_{kind}") for kind, reg in
      (("dataset", registry.DATASETS), ("tracker", registry.TRACKERS), ("runtime", registry.RUNTIMES)) for name in reg))
print(registry.DATASETS.names()); print(registry.TRACKERS.names()); print(registry.RUNTIMES.names())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "flwr")) or "light")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "True", out.stdout + out.stderr
    assert eval(lines[1]) == sorted(["sst2", "cola", "rte", "mrpc", "qnli", "mnli", "boolq", "20newsgroups", "mr",
                                     "subj", "e2e_nlg", "arc_easy", "arc_challenge", "openbookqa", "piqa", "hellaswag",
                                     "race"])  # registries list their names alphabetically
    assert eval(lines[2]) == ["mlflow", "tensorboard", "wandb"]
    assert eval(lines[3]) == ["embedded", "flower"]
    assert lines[4] == "light"  # registering the built-ins imports neither torch nor Flower

    from fedpeft import tracking
    from fedpeft.config.schema import RuntimeConfig
    from fedpeft.data import catalog

    assert not hasattr(catalog, "CATALOG") and not hasattr(tracking, "BACKENDS")
    assert RuntimeConfig.model_fields["name"].annotation is str
    assert RuntimeConfig.model_fields["loggers"].annotation == list[str]


@pytest.mark.needs_data
def test_each_built_in_dataset_declares_the_fields_of_its_offline_rows():
    from fedpeft.data.sources import describe_splits, load_rows, locate_local

    checked = 0
    for name, entry in DATASETS.items():
        if locate_local(name) is None:
            continue
        split = describe_splits(name)["splits"][0]
        row = load_rows(name, f"{split}[:1]")[0]
        assert set(entry.fields) <= set(row), (name, split, sorted(row))
        checked += 1
    assert checked >= 10


LOADER_PLUGIN = '''
import fedpeft

WORDS = ["good", "bad", "great", "awful", "fine", "poor", "superb", "dull"]


def rows(split):
    if split == "broken":
        return [{"text": "ok", "label": 1}, "not a row"]
    n = {"train": 64, "validation": 16}[split]
    return [{"text": f"a {WORDS[i % 8]} film number {i}", "label": (i % 8) % 2} for i in range(n)]


fedpeft.register_dataset("coded_reviews", task="classification", loader="coded_reviews_plugin:rows",
                         splits=("train", "validation", "broken"), default_metric="mcc")
'''


def test_a_dataset_read_by_its_own_loader_trains_and_bad_rows_are_refused(tmp_path, monkeypatch, capsys):
    """A dataset whose rows come from code (a private database, an API): registered with a loader, it is named,
    listed, checked and trained on like any other; a loader that returns a non-row is refused in one line."""
    from fedpeft.data.files import DataError
    from fedpeft.data.sources import describe_splits, load_rows

    (tmp_path / "coded_reviews_plugin.py").write_text(LOADER_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = fedpeft.run({**TINY, "plugins": ["coded_reviews_plugin"], "runtime": {"progress": False},
                           "task": {"dataset": "coded_reviews", "max_train_examples": 32, "max_length": 32}},
                          tmp_path / "run")
    assert summary["rounds"] == 1 and summary["primary_metric"] == "mcc" and summary["dataset"] == "coded_reviews"
    assert len(load_rows("coded_reviews", "train[:10]")) == 10
    assert describe_splits("coded_reviews")["splits"] == ["train", "validation", "broken"]
    with pytest.raises(DataError, match=r"^dataset 'coded_reviews' split 'broken' \(loader coded_reviews_plugin:rows\) "
                                        r"row 2: str, not a row; return dicts"):
        load_rows("coded_reviews", "broken")
    with pytest.raises(DataError, match=r"^dataset 'coded_reviews' has no split 'test'; its loader serves train, "
                                        r"validation, broken$"):
        load_rows("coded_reviews", "test")
    with pytest.raises(ValueError, match="give a loader or a hub_id, not both"):
        fedpeft.register_dataset("both", task="classification", hub_id="a/b", loader="m:f", splits=("train",))
    with pytest.raises(ValueError, match="name the splits its loader serves"):
        fedpeft.register_dataset("nosplits", task="classification", loader="m:f")
