"""What someone hands you is data, not code (issue 50): a config, a run directory or an adapter never makes a
read-only command or a loader import a plugin it names; only the user names plugins (--plugin, plugins=) or
trusts a file's (--trust-plugins, trust_plugins=True). Seals cannot be stripped: a file without one is refused
unless the reader opts in (--allow-unsealed, allow_unsealed=True). A run directory's path is printable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config
from safetensors.numpy import load_file, save_file

from fedpeft import checkpoint, wire
from fedpeft.adapters import AdapterError, load_adapter
from fedpeft.cli import main
from fedpeft.config import dump_config
from fedpeft.integrity import PLACEHOLDER, seal
from fedpeft.rundir import CONFIG_SEAL, read_summary

REPO = Path(__file__).resolve().parents[1]
MEDIAN = REPO / "examples" / "custom_algorithm" / "plugin.py"


def marking_plugin(folder: Path, algorithm: str | None = None) -> tuple[Path, Path]:
    """A plugin file that leaves a marker file when it is imported (and registers the example's median
    algorithm as ``algorithm``, if given); returns (plugin, marker)."""
    marker = folder / "plugin-ran"
    text = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    if algorithm is not None:
        text += MEDIAN.read_text().replace('"median"', repr(algorithm)).replace("from __future__ import annotations",
                                                                                "")
    plugin = folder / "handed_over.py"
    plugin.write_text(text)
    return plugin, marker


def fedpeft_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command in a fresh process (no plugin imported yet), as a user runs it."""
    env = {**os.environ, "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-m", "fedpeft.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, check=False)


def error_line(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def write_tiny_config(path: Path, *overrides: str, plugins: list[str] | None = None) -> Path:
    text = dump_config(tiny_config(*overrides))
    if plugins is not None:
        text = text.replace("plugins: []", f"plugins: {json.dumps(plugins)}", 1)
    path.write_text(text)
    return path


def reseal_config(run_dir: Path, change) -> None:
    """Edit a run's config.yaml and seal it again, as anyone can (a seal is no signature)."""
    path = run_dir / "config.yaml"
    body = change(path.read_text().split("\n", 1)[1]).encode()
    data = CONFIG_SEAL.format(digest=PLACEHOLDER).encode() + body
    path.write_bytes(seal(data, 0, data.index(b"\n")))


def rewrite_adapter_json(adapter: Path, change, *, sealed: bool = True) -> None:
    meta = json.loads((adapter / "fedpeft_adapter.json").read_text())
    meta = change(meta)
    if sealed:
        meta["sha256"] = PLACEHOLDER
        (adapter / "fedpeft_adapter.json").write_bytes(seal(json.dumps(meta, indent=2).encode()))
    else:
        (adapter / "fedpeft_adapter.json").write_text(json.dumps(meta, indent=2))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("handed")
    config = write_tiny_config(root / "tiny.yaml", "federation.rounds=1", "eval.save_best=false")
    assert main(["run", str(config), "--run-dir", str(root / "run"), "--no-progress"]) == 0
    return root / "run"


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


# -- a config is code only when it is run ---------------------------------------------------------------------------
@pytest.mark.needs_data
def test_read_only_commands_never_import_a_plugin_a_config_names(tmp_path):
    plugin, marker = marking_plugin(tmp_path, algorithm="handed_median")
    unused = write_tiny_config(tmp_path / "unused.yaml", plugins=[str(plugin)])  # the plugin is not needed
    for command in (["config", str(unused)], ["partition", str(unused)]):
        out = fedpeft_cli(*command, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert not marker.exists(), command
        assert f"names plugin(s) {plugin}" in out.stderr and "--trust-plugins" in out.stderr  # said, not silent
    plain = write_tiny_config(tmp_path / "plain.yaml")
    for command in (["config", str(plain)], ["data", "sst2", "--split", "validation"]):
        out = fedpeft_cli(*command, "--set", f"plugins=[{plugin}]", cwd=tmp_path)
        assert out.returncode == 2 and "a plugin is code; name it with --plugin" in error_line(out.stderr)
        assert not marker.exists(), command

    needed = write_tiny_config(tmp_path / "needed.yaml", plugins=[str(plugin)])
    needed.write_text(needed.read_text().replace("name: fedavg\n  server_lr: 1.0\n  dp: null\n  robust: null",
                                                 "name: handed_median"))
    for command in (["config", str(needed)], ["partition", str(needed)]):
        out = fedpeft_cli(*command, cwd=tmp_path)
        line = error_line(out.stderr)
        assert out.returncode == 2 and not marker.exists()
        assert "algorithm.name: unknown choice 'handed_median'" in line
        assert f"--plugin {plugin}" in line and "--trust-plugins" in line and "trust_plugins=True" in line
    for opt_in in (["--plugin", str(plugin)], ["--trust-plugins"]):
        out = fedpeft_cli("config", str(needed), *opt_in, cwd=tmp_path)
        assert out.returncode == 0 and "name: handed_median" in out.stdout, out.stderr
        assert marker.exists()
        marker.unlink()


def test_load_config_imports_a_files_plugins_only_when_named_or_trusted(tmp_path):
    import fedpeft

    plugin, marker = marking_plugin(tmp_path)
    config = write_tiny_config(tmp_path / "c.yaml", plugins=["./handed_over.py"])
    assert fedpeft.load_config(config).plugins == [str(plugin)] and not marker.exists()
    with pytest.raises(fedpeft.ConfigError, match="give a list of plugins"):
        fedpeft.load_config(config, plugins=str(plugin))  # a string is no list of plugins
    assert not marker.exists()
    fedpeft.load_config(config, plugins=[str(plugin)])  # named by the caller
    assert marker.exists()


def test_load_config_imports_a_files_plugins_when_trusted(tmp_path):
    import fedpeft

    _, marker = marking_plugin(tmp_path)
    config = write_tiny_config(tmp_path / "c.yaml", plugins=["./handed_over.py"])
    fedpeft.load_config(config, trust_plugins=True)
    assert marker.exists()


@pytest.mark.needs_data
def test_running_a_config_or_resuming_its_run_imports_its_plugins(tmp_path):
    """The two places a config is code, in fresh processes: `fedpeft run CONFIG` and `fedpeft run --resume`."""
    plugin, marker = marking_plugin(tmp_path, algorithm="handed_median")
    config = write_tiny_config(tmp_path / "c.yaml", "federation.rounds=1", plugins=[str(plugin)])
    config.write_text(config.read_text().replace("name: fedavg\n  server_lr: 1.0\n  dp: null\n  robust: null",
                                                 "name: handed_median"))
    out = fedpeft_cli("run", str(config), "--run-dir", "run", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0 and marker.exists(), out.stderr
    marker.unlink()
    out = fedpeft_cli("run", "--resume", "run", "--set", "federation.rounds=2", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0 and marker.exists(), out.stderr
    assert read_summary(tmp_path / "run")["rounds"] == 2


# -- a run directory is data ----------------------------------------------------------------------------------------
@pytest.mark.needs_data
def test_report_and_eval_of_a_run_naming_a_plugin_import_nothing(run_copy, tmp_path):
    plugin, marker = marking_plugin(tmp_path)
    reseal_config(run_copy, lambda text: text.replace("plugins: []", f"plugins: [{plugin}]", 1))
    (run_copy / "summary.json").unlink()  # the report then reads the run's config for its primary metric
    out = fedpeft_cli("report", str(run_copy), cwd=tmp_path)
    assert out.returncode == 0 and "| lora r16 | fedavg | sst2 |" in out.stdout, out.stderr
    assert not marker.exists() and "plugin" not in out.stderr  # it takes no --plugin: nothing to advise
    reseal_config(run_copy, lambda text: text.replace("name: fedavg", "name: only_a_plugin_has_it", 1))
    out = fedpeft_cli("report", str(run_copy), cwd=tmp_path)  # a method of the plugin: the task's metric
    assert out.returncode == 0 and "metric: accuracy" in out.stdout and not marker.exists(), out.stderr
    reseal_config(run_copy, lambda text: text.replace("name: only_a_plugin_has_it", "name: fedavg", 1))
    out = fedpeft_cli("eval", str(run_copy), "--adapter", "last", "--max-examples", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not marker.exists() and f"names plugin(s) {plugin}" in out.stderr


# -- an adapter is data ---------------------------------------------------------------------------------------------
@pytest.mark.needs_data
def test_a_crafted_adapter_with_a_recomputed_seal_runs_no_code(run_copy, tmp_path, capsys):
    """The attack of issue 50: a method nobody registered, a plugin path, and a seal computed again."""
    plugin, marker = marking_plugin(tmp_path)
    adapter = run_copy / "adapter"
    rewrite_adapter_json(adapter, lambda meta: {**meta, "method": "anything", "plugins": [str(plugin)]})
    with pytest.raises(AdapterError) as refused:
        load_adapter(adapter)
    message = str(refused.value)
    assert "PEFT method 'anything' is not registered" in message and "\n" not in message
    assert f"--plugin {plugin}" in message and "trust_plugins=True" in message
    assert not marker.exists()
    capsys.readouterr()
    assert main(["eval", str(run_copy), "--adapter", "last", "--max-examples", "8"]) == 2
    assert "PEFT method 'anything' is not registered" in error_line(capsys.readouterr().err)
    assert not marker.exists()
    with pytest.raises(AdapterError, match="is not registered by its plugins"):  # trusted: imported, still unknown
        load_adapter(adapter, trust_plugins=True)
    assert marker.exists()


@pytest.mark.needs_data
def test_an_adapter_stripped_of_its_seal_is_refused_unless_allowed(run_copy, capsys, caplog):
    adapter = run_copy / "adapter"
    weights = adapter / "adapter_model.safetensors"
    save_file({k: v * 0 + 7 for k, v in load_file(str(weights)).items()}, str(weights))  # every weight set to 7
    rewrite_adapter_json(adapter, lambda meta: {k: v for k, v in meta.items() if k not in ("sha256", "files")},
                         sealed=False)
    with pytest.raises(AdapterError) as refused:
        load_adapter(adapter)
    message = str(refused.value)
    assert message.startswith(f"{adapter / 'fedpeft_adapter.json'} carries no SHA-256 seal (no 'sha256' or 'files')")
    assert "--allow-unsealed" in message and "allow_unsealed=True" in message and "\n" not in message
    capsys.readouterr()
    assert main(["eval", str(run_copy), "--adapter", "last", "--max-examples", "8"]) == 2
    assert "carries no SHA-256 seal" in error_line(capsys.readouterr().err)
    with caplog.at_level("WARNING", logger="fedpeft"):
        assert load_adapter(adapter, allow_unsealed=True).meta["round"] == 1  # the opt-in, and a warning
    assert "records no sha256 or files (allowed by allow_unsealed)" in caplog.text
    assert main(["eval", str(run_copy), "--adapter", "last", "--max-examples", "8", "--allow-unsealed"]) == 0


@pytest.mark.needs_data
def test_an_adapter_with_pickle_weights_or_unrecorded_files_is_refused(run_copy):
    adapter = run_copy / "adapter"
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04pickled")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin: a pickle-based weights file, which can run code"):
        load_adapter(adapter)
    (adapter / "adapter_model.bin").unlink()
    shutil.copy(adapter / "adapter_config.json", adapter / "extra_config.json")
    with pytest.raises(AdapterError, match=r"extra_config\.json is not among the files fedpeft_adapter\.json records"):
        load_adapter(adapter)
    (adapter / "extra_config.json").unlink()
    rewrite_adapter_json(adapter, lambda meta: {**meta, "files": {**meta["files"], "../config.yaml": "0" * 64}})
    with pytest.raises(AdapterError, match=r"'files' names '../config.yaml', outside the adapter directory"):
        load_adapter(adapter)


# -- a resume runs its config; unsealed run files only on request ----------------------------------------------------
@pytest.mark.needs_data
def test_a_stripped_run_resumes_only_with_allow_unsealed_which_seals_it(run_copy, capsys):
    config = run_copy / "config.yaml"
    config.write_text(config.read_text().split("\n", 1)[1])  # the seal line removed
    payload = wire.decode((run_copy / checkpoint.FILENAME).read_bytes())
    stripped = {k: v for k, v in payload.meta.items() if k not in ("sha256", "nonfinite")}
    (run_copy / checkpoint.FILENAME).write_bytes(wire.encode(wire.Payload(payload.arrays, {**stripped, "format": 1})))
    resume = ["run", "--resume", str(run_copy), "--set", "federation.rounds=2", "--no-progress"]
    assert main(resume) == 2
    assert "config.yaml carries no SHA-256 seal" in error_line(capsys.readouterr().err)
    config.write_text(CONFIG_SEAL.format(digest="0" * 64) + config.read_text())
    assert main(resume) == 2  # the config's seal does not match now: damaged, not unsealed
    config.write_text(config.read_text().split("\n", 1)[1])
    assert "does not match the checksum" in error_line(capsys.readouterr().err)
    assert main([*resume, "--allow-unsealed"]) == 0
    assert read_summary(run_copy)["rounds"] == 2
    assert config.read_text().startswith("# sha256 ")
    assert wire.decode((run_copy / checkpoint.FILENAME).read_bytes()).meta["format"] == checkpoint.SEALED_FORMAT


@pytest.mark.needs_data
def test_a_run_whose_checkpoint_alone_lost_its_seal_is_refused_then_resumed_on_request(run_copy, capsys):
    payload = wire.decode((run_copy / checkpoint.FILENAME).read_bytes())
    stripped = {k: v for k, v in payload.meta.items() if k not in ("sha256", "nonfinite")}
    (run_copy / checkpoint.FILENAME).write_bytes(wire.encode(wire.Payload(payload.arrays, {**stripped, "format": 1})))
    resume = ["run", "--resume", str(run_copy), "--set", "federation.rounds=2", "--no-progress"]
    assert main(resume) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{run_copy / checkpoint.FILENAME} carries no SHA-256 seal" in line and "--allow-unsealed" in line
    assert main([*resume, "--allow-unsealed"]) == 0 and read_summary(run_copy)["rounds"] == 2


def test_allow_unsealed_writes_nothing_where_there_is_no_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "none"), "--allow-unsealed"]) == 2
    assert "is not a run directory" in error_line(capsys.readouterr().err)
    (tmp_path / "empty").mkdir()
    assert main(["run", "--resume", str(tmp_path / "empty"), "--allow-unsealed"]) == 2
    assert not (tmp_path / "none").exists() and list((tmp_path / "empty").iterdir()) == []


def test_allow_unsealed_belongs_to_a_resume(tmp_path, capsys):
    config = write_tiny_config(tmp_path / "c.yaml")
    assert main(["run", str(config), "--allow-unsealed"]) == 2
    assert "--allow-unsealed goes with --resume" in error_line(capsys.readouterr().err)


# -- printable run directories -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a\nb", "tab\there", "esc\x1b[31m", "sep\u2028x", "rtl\u202eoverride"])
def test_a_run_directory_with_a_control_character_is_refused_before_any_work(tmp_path, capsys, name):
    config = write_tiny_config(tmp_path / "c.yaml")
    assert main(["run", str(config), "--run-dir", str(tmp_path / name), "--no-progress"]) == 2
    line = error_line(capsys.readouterr().err)
    assert "run directory" in line and "holds the unprintable character" in line
    assert not (tmp_path / name).exists()
    assert main(["config", str(config), "--set", f'output_dir="runs/{name.encode("unicode_escape").decode()}"']) == 2
    assert "output_dir:" in error_line(capsys.readouterr().err)
