import subprocess
import sys


from fedpeft.cli import main

from conftest import REPO


def test_bad_config_key_exits_2_with_one_line(capsys):
    assert main(["config", str(REPO / "configs" / "quickstart.yaml"), "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.lrr: unknown key; valid keys here:")


def test_config_prints_every_default(capsys):
    assert main(["config", str(REPO / "configs" / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert "max_grad_norm: 1.0" in out and "method: lora" in out


def test_data_command_on_real_data(capsys):
    assert main(["data", "mrpc", "--split", "validation"]) == 0
    out = capsys.readouterr().out
    assert "validation: 408 rows" in out and "labels:" in out


def test_run_report_and_partition_from_the_cli(tmp_path, capsys):
    common = ["--set", "model.name=tiny-bert", "--set", "task.max_train_examples=40", "--set", "eval.max_examples=16",
              "--set", "federation.rounds=1", "--set", "federation.num_clients=4", "--no-progress"]
    cfg = str(REPO / "configs" / "quickstart.yaml")
    assert main(["run", cfg, "--run-dir", str(tmp_path / "r1"), *common]) == 0
    assert main(["run", cfg, "--run-dir", str(tmp_path / "r2"), *common, "--set", "peft={method: ia3}"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "r1"), str(tmp_path / "r2"), "--out", str(tmp_path / "rep")]) == 0
    table = capsys.readouterr().out
    assert "| r1 | tiny-bert | lora |" in table and "| r2 | tiny-bert | ia3 |" in table
    assert (tmp_path / "rep" / "report.md").is_file() and len(list((tmp_path / "rep").glob("*.png"))) == 2
    assert main(["partition", str(tmp_path / "r1")]) == 0
    assert "clients: 4  examples: 40" in capsys.readouterr().out


def test_partition_from_config_matches_the_run(tmp_path, capsys):
    cfg = str(REPO / "configs" / "quickstart.yaml")
    sets = ["--set", "federation.partition.scheme=dirichlet_label", "--set", "federation.partition.alpha=0.3"]
    assert main(["partition", cfg, *sets]) == 0
    printed = capsys.readouterr().out
    assert "clients: 10  examples: 2000" in printed and "label entropy" in printed


def test_model_command_lists_methods(capsys):
    assert main(["model", "tiny-bert", "--methods", "lora,bitfit"]) == 0
    out = capsys.readouterr().out
    assert "bert, 2 layers, 4 heads" in out and "lora" in out and "bitfit" in out


def test_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "fedpeft.cli", "--help"], capture_output=True, text=True, check=True)
    assert "run" in out.stdout and "report" in out.stdout
