"""The plugin contract: algorithms registered from outside the package, through `import fedpeft` only, are
first-class (config validation, CLI, resume, Flower); built-ins go through the same registry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from helpers import install_entry_point_plugin

import fedpeft
from fedpeft.algorithms.registry import ALGORITHMS
from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.config.schema import options_for
from fedpeft.rundir import read_metrics, read_summary

EXAMPLE = REPO / "examples" / "custom_algorithm"
PLUGIN = str(EXAMPLE / "plugin.py")


@pytest.mark.needs_data
def test_the_example_plugin_runs_from_the_command_line_and_resumes(tmp_path, capsys):
    assert main(["run", str(EXAMPLE / "config.yaml"), "--plugin", PLUGIN, "--run-dir", "run", "--no-progress"]) == 0
    rows = read_metrics("run")
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["agg_median_norm"] > 0 for r in rows[1:])
    assert f"- {PLUGIN}" in Path("run/config.yaml").read_text()  # kept with the run ...
    assert main(["run", "--resume", "run", "--set", "federation.rounds=3", "--no-progress"]) == 0  # ... and reloaded
    assert read_summary("run")["rounds"] == 3


def test_without_the_plugin_the_name_is_refused_with_the_valid_choices(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"algorithm.name: unknown choice 'nosuch'; valid choices: 'fedadam', 'fedavg'"):
        load_config(None, ["algorithm.name=nosuch"])
    assert main(["run", str(EXAMPLE / "config.yaml"), "--plugin", str(tmp_path / "missing.py")]) == 2
    assert "plugin file" in capsys.readouterr().err


def test_the_median_ignores_one_poisoned_update():
    plugin = fedpeft.load_plugin(PLUGIN)
    options = load_config(None, ["algorithm.name=median"], plugins=[PLUGIN]).algorithm
    assert isinstance(options, plugin.MedianOptions)
    server = plugin.MedianServer(options, {"w": np.zeros(3, np.float32)}, num_clients=3, clients_per_round=3, seed=0)
    updates = {c: fedpeft.Payload({"w": np.array(v, np.float32)}, {"round": 1, "num_examples": 10})
               for c, v in enumerate([[1.0, 2.0, 3.0], [1.2, 1.8, 3.1], [1e6, -1e6, 1e6]])}
    accepted, rejected = server.accept(1, updates)
    assert not rejected
    server.aggregate(1, accepted)
    np.testing.assert_allclose(server.global_state["w"], [1.2, 1.8, 3.1], rtol=1e-6)


def test_a_taken_name_and_a_misnamed_options_model_are_refused():
    from typing import Literal

    class Again(fedpeft.AlgorithmOptions):
        name: Literal["fedavg"] = "fedavg"

    class Misnamed(fedpeft.AlgorithmOptions):
        name: Literal["one"] = "one"

    with pytest.raises(ValueError, match="already registered"):
        fedpeft.register_algorithm("fedavg", options=Again, server=ALGORITHMS["fedavg"].server,
                                   client=ALGORITHMS["fedavg"].client)
    with pytest.raises(ValueError, match="must default to 'two'"):
        fedpeft.register_algorithm("two", options=Misnamed, server=ALGORITHMS["fedavg"].server,
                                   client=ALGORITHMS["fedavg"].client)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_keeps_the_contract(name):
    entry = ALGORITHMS[name]
    assert options_for("algorithm", name) is entry.options and entry.options().name == name
    assert issubclass(entry.server, fedpeft.ServerAlgorithm)
    assert isinstance(entry.client(entry.options()), fedpeft.ClientAlgorithm)


@pytest.mark.needs_data
def test_the_public_api_runs_reads_and_resumes(tmp_path):
    cfg = load_config(None, ["model.name=tiny-bert", "task.max_train_examples=32", "task.max_length=32",
                             "federation.num_clients=2", "federation.rounds=1", "eval.max_examples=16",
                             "runtime.progress=false"])
    summary = fedpeft.run(cfg, tmp_path / "run")
    assert summary == fedpeft.read_summary(tmp_path / "run") and summary["rounds"] == 1
    assert len(fedpeft.read_partition(tmp_path / "run")["clients"]) == 2
    assert fedpeft.resume(tmp_path / "run", rounds=2)["rounds"] == 2
    assert len(fedpeft.read_metrics(tmp_path / "run")) == 3
    assert fedpeft.load_adapter(tmp_path / "run" / "adapter").meta["round"] == 2


SCAFFOLD = REPO / "examples" / "scaffold"


@pytest.mark.needs_data
def test_scaffold_keeps_its_control_variates_consistent_and_starts_as_fedavg(tmp_path):
    from fedpeft import checkpoint

    plugin = [str(SCAFFOLD / "plugin.py")]
    iid = ["federation.partition.scheme=iid", "runtime.progress=false"]
    fedpeft.run(load_config(SCAFFOLD / "config.yaml", iid, plugins=plugin), tmp_path / "scaffold")
    state = checkpoint.load(tmp_path / "scaffold")[1]
    control, clients = state["server"]["control"], state["clients"]
    assert len(clients) >= 2 and all("control" in s for s in clients.values())
    for k, c in control.items():  # c = (1/N) sum_i c_i, all of them starting at 0
        mean = sum(s["control"][k] for s in clients.values()) / 4
        np.testing.assert_allclose(c, mean, rtol=1e-4, atol=1e-6)
    # in round 1 every control variate is 0, so SCAFFOLD takes FedAvg's step (equal client sizes, SGD)
    one = [*iid, "federation.rounds=1"]
    fedpeft.run(load_config(SCAFFOLD / "config.yaml", one, plugins=plugin), tmp_path / "s1")
    fedpeft.run(load_config(SCAFFOLD / "config.yaml", [*one, "algorithm={name: fedavg}"]), tmp_path / "f1")
    a = checkpoint.load(tmp_path / "s1")[1]["server"]["global_state"]
    b = checkpoint.load(tmp_path / "f1")[1]["server"]["global_state"]
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7)


@pytest.mark.needs_data
@pytest.mark.parametrize("max_grad_norm", ["null", "0.5"])
def test_a_scaffold_local_step_is_the_papers_on_the_clipped_corrected_gradient(max_grad_norm):
    """y = x - lr clip(g(x) - c_i + c): the plain gradient g from a FedAvg client's step from the same start on
    the same batch (unclipped), the correction before the clipping."""
    from fedpeft.algorithms.fedavg.options import FedAvgOptions
    from fedpeft.algorithms.registry import make_client
    from fedpeft.runtime.local_work import train_client
    from fedpeft.runtime.setup import build_experiment

    plugin = [str(SCAFFOLD / "plugin.py")]
    sets = ["train.local_steps=1", "model.dropout=0", "peft.dropout=0", "federation.partition.scheme=iid"]
    plain = build_experiment(load_config(SCAFFOLD / "config.yaml", [*sets, "train.max_grad_norm=null"],
                                         plugins=plugin))
    x = plain.tuned.state()
    y_plain = train_client(plain, make_client(FedAvgOptions()), 1, 0,
                           fedpeft.Payload(x, {"round": 1, "client": 0}), {}).arrays
    lr = plain.cfg.train.lr
    g = {k: (x[k].astype(np.float64) - y_plain[k]) / lr for k in x}

    cfg = load_config(SCAFFOLD / "config.yaml", [*sets, f"train.max_grad_norm={max_grad_norm}"], plugins=plugin)
    exp = build_experiment(cfg)
    exp.tuned.load_state(x)
    rng = np.random.default_rng(1)
    c = {k: rng.normal(scale=0.05, size=v.shape).astype(np.float32) for k, v in x.items()}
    c_i = {k: rng.normal(scale=0.05, size=v.shape).astype(np.float32) for k, v in x.items()}
    received = fedpeft.Payload({**x, **{"control/" + k: v for k, v in c.items()}}, {"round": 1, "client": 0})
    y = train_client(exp, make_client(cfg.algorithm), 1, 0, received, {"control": dict(c_i)}).arrays
    corrected = {k: g[k] - c_i[k] + c[k] for k in x}
    scale = 1.0
    if cfg.train.max_grad_norm is not None:
        norm = np.sqrt(sum(np.sum(v ** 2) for v in corrected.values()))
        assert norm > cfg.train.max_grad_norm  # the clipping acts
        scale = min(1.0, cfg.train.max_grad_norm / (norm + 1e-6))
    for k in x:
        np.testing.assert_allclose(y[k], x[k] - lr * scale * corrected[k], rtol=1e-4, atol=1e-6)


def test_scaffold_refuses_an_optimizer_it_cannot_correct():
    with pytest.raises(ConfigError, match="scaffold corrects plain SGD steps"):
        load_config(SCAFFOLD / "config.yaml", ["train.optimizer=adamw"], plugins=[str(SCAFFOLD / "plugin.py")])
    with pytest.raises(ConfigError, match="set train.weight_decay: 0"):
        load_config(SCAFFOLD / "config.yaml", ["train.weight_decay=0.01"], plugins=[str(SCAFFOLD / "plugin.py")])


def test_the_layers_keep_to_themselves():
    """Validating a config (SuperNode key pins included) imports no runtime; importing the algorithms and the
    embedded runtime loads neither Flower nor a plotting library; `import fedpeft` loads neither torch nor the
    config."""
    import subprocess
    import sys

    key = "SHA256:" + "A" * 43  # a pinned SuperNode key: validating it needs no Flower either
    probe = ("import sys, fedpeft; light = [m for m in ('torch', 'pydantic') if m in sys.modules]; "
             f"fedpeft.load_config(None, ['runtime.flower.partition_keys={{0: \"{key}\"}}']); "
             "runtime = sorted(m for m in sys.modules if m.startswith('fedpeft.runtime')); "
             "import fedpeft.algorithms, fedpeft.runtime.embedded; "
             "print(light, runtime, sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'matplotlib'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] [] []", out.stdout + out.stderr


def test_installed_packages_register_through_the_entry_point_group(tmp_path, monkeypatch):


    install_entry_point_plugin(monkeypatch, tmp_path, "installed_fl", (
        "from typing import Literal\n"
        "import fedpeft\n"
        "from fedpeft.algorithms.registry import ALGORITHMS\n"
        "class InstalledOptions(fedpeft.AlgorithmOptions):\n"
        "    name: Literal['installed'] = 'installed'\n"
        "def register():\n"
        "    fedavg = ALGORITHMS['fedavg']\n"
        "    fedpeft.register_algorithm('installed', options=InstalledOptions, server=fedavg.server,\n"
        "                               client=lambda o: fedavg.client(fedavg.options()))\n"
    ))
    cfg = load_config(None, ["algorithm.name=installed"])  # validating a config loads the installed plugins
    assert cfg.algorithm.name == "installed" and "installed" in ALGORITHMS


def test_a_method_registered_in_the_script_itself_is_refused_for_flower(tmp_path):
    """A Flower app in another process could not find it: one line saying how to make it a plugin."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from typing import Literal\n"
        "import fedpeft\n"
        "from fedpeft.algorithms import registered_algorithm\n"
        "class InScript(fedpeft.AlgorithmOptions):\n"
        "    name: Literal['inscript'] = 'inscript'\n"
        "fedavg = registered_algorithm('fedavg')\n"
        "fedpeft.register_algorithm('inscript', options=InScript, server=fedavg.server,\n"
        "                           client=lambda o: fedavg.client(fedavg.options()))\n"
        "cfg = fedpeft.validate_config({'algorithm': {'name': 'inscript'}, 'runtime': {'name': 'flower'}})\n"
        "try:\n"
        "    fedpeft.run(cfg)\n"
        "except fedpeft.UserError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "algorithm.name 'inscript' is registered in your script (__main__)" in out.stdout, out.stderr


def documented_update_keys() -> dict[str, str]:
    """The update metadata table of docs/plugins.md: key -> its 'set by' cell."""
    text = (REPO / "docs" / "plugins.md").read_text()
    table = text.split("<!-- update-meta-keys:", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    return {cells[1].strip().strip("`"): cells[3].strip() for cells in rows}


def test_the_plugin_docs_table_lists_exactly_the_declared_update_keys():
    from fedpeft.runtime.personal import PERSONAL

    assert set(documented_update_keys()) == {*fedpeft.UpdateMeta.model_fields, PERSONAL}


@pytest.mark.needs_data
def test_a_real_update_carries_only_the_documented_metadata_keys(tmp_path):
    """A real FedAvg update under eval.personalized carries only documented keys, every train_* one."""
    from helpers import tiny_config

    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.personal import PERSONAL

    documented = documented_update_keys()
    rt = EmbeddedRuntime(tiny_config("eval.personalized=true", "federation.rounds=1"), tmp_path / "run")
    sent = []
    original = rt.transport.run_client

    def run_client(*args, **kwargs):
        out = original(*args, **kwargs)
        sent.append(out[0].meta)
        return out

    rt.transport.run_client = run_client
    rt.run()
    rt.close()
    assert sent and all(PERSONAL in meta for meta in sent)  # the last round is evaluated: every client reports
    for meta in sent:
        assert set(meta) <= set(documented), set(meta) - set(documented)
        assert {k for k, who in documented.items() if who == "`TrainResult.as_meta()`"} <= set(meta)
        assert {"round", "num_examples", "client"} <= set(meta)


def per_layer_tensor_counts(tuned, model_config):
    """A plugin's own layout (RuntimeNeeds.layout): how many trainable tensors each layer holds."""
    counts = dict.fromkeys(range(model_config.num_hidden_layers), 0)
    for name in tuned.params:
        layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
        if layer is not None:
            counts[layer] += 1
    return counts


@pytest.mark.needs_data
def test_a_plugin_algorithm_declares_a_layout_of_its_own(tmp_path):
    """RuntimeNeeds is open: an algorithm names any builder of the layout it works by, and every runtime hands
    what it built to the server half and to every client half, without knowing what it is."""
    from typing import Literal

    from helpers import tiny_config

    from fedpeft.algorithms.fedavg.halves import FedAvgServer, fedavg_client
    from fedpeft.runtime.embedded import EmbeddedRuntime

    class CountsOptions(fedpeft.AlgorithmOptions):
        name: Literal["layout_counts"] = "layout_counts"
        server_lr: float = 1.0

    class CountsServer(FedAvgServer[CountsOptions]):
        @classmethod
        def runtime_needs(cls, options: CountsOptions) -> fedpeft.RuntimeNeeds:
            return fedpeft.RuntimeNeeds(layout=per_layer_tensor_counts)

    fedpeft.register_algorithm("layout_counts", options=CountsOptions, server=CountsServer, client=fedavg_client)
    try:
        rt = EmbeddedRuntime(tiny_config("algorithm.name=layout_counts", "federation.rounds=1"), tmp_path / "run")
        try:
            expected = per_layer_tensor_counts(rt.exp.tuned, rt.exp.tuned.module.config)
            assert rt.server.layout == expected and sum(expected.values()) > 0  # LoRA's A and B in every layer
            assert rt.exp.layout is rt.server.layout is rt.exp.client_resources["layout"]
        finally:
            rt.close()
    finally:
        ALGORITHMS.remove("layout_counts")
    # by reference, checked when declared
    assert fedpeft.RuntimeNeeds(layout="fedpeft.heads.layout:head_layout").layout == "fedpeft.heads.layout:head_layout"
    with pytest.raises(ValueError, match="write it as 'package.module:attribute'"):
        fedpeft.RuntimeNeeds(layout="head_layout")
    with pytest.raises(TypeError, match="RuntimeNeeds.layout must be a function"):
        fedpeft.RuntimeNeeds(layout=3)  # type: ignore[arg-type]
