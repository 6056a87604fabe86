import json
import subprocess
import sys

import pytest
from conftest import REPO

from fedpeft.cli import main


def test_bad_config_key_exits_2_with_one_line(capsys):
    assert main(["config", str(REPO / "configs" / "quickstart.yaml"), "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.lrr: unknown key; valid keys here:")


def test_config_prints_every_default(capsys):
    assert main(["config", str(REPO / "configs" / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert "max_grad_norm: 1.0" in out and "method: lora" in out


@pytest.mark.needs_data
def test_data_command_on_real_data(capsys):
    assert main(["data", "mrpc", "--split", "validation"]) == 0
    out = capsys.readouterr().out
    assert "validation: 408 rows" in out and "labels:" in out


@pytest.mark.needs_data
def test_run_report_and_partition_from_the_cli(tmp_path, capsys):
    common = ["--set", "model.name=tiny-bert", "--set", "task.max_train_examples=40", "--set", "eval.max_examples=16",
              "--set", "federation.rounds=1", "--set", "federation.num_clients=4", "--no-progress"]
    cfg = str(REPO / "configs" / "quickstart.yaml")
    assert main(["run", cfg, "--run-dir", str(tmp_path / "r1"), *common]) == 0
    assert main(["run", cfg, "--run-dir", str(tmp_path / "r2"), *common, "--set", "peft={method: ia3}"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "r1"), str(tmp_path / "r2"), "--out", str(tmp_path / "rep")]) == 0
    table = capsys.readouterr().out
    assert "| r1 | tiny-bert | lora r16 | fedavg |" in table and "| r2 | tiny-bert | ia3 | fedavg |" in table
    assert (tmp_path / "rep" / "report.md").is_file() and len(list((tmp_path / "rep").glob("*.png"))) == 4  # rounds, MiB, upload, simulated time
    assert main(["partition", str(tmp_path / "r1")]) == 0
    assert "clients: 4  examples: 40" in capsys.readouterr().out


@pytest.mark.needs_data
def test_partition_from_config_matches_the_run(tmp_path, capsys):
    cfg = str(REPO / "configs" / "quickstart.yaml")
    sets = ["--set", "federation.partition.scheme=dirichlet_label", "--set", "federation.partition.alpha=0.3"]
    assert main(["partition", cfg, *sets]) == 0
    printed = capsys.readouterr().out
    assert "clients: 10  examples: 2000" in printed and "label entropy" in printed


def test_model_command_lists_methods(capsys):
    assert main(["model", "tiny-bert", "--methods", "lora,bitfit"]) == 0
    out = capsys.readouterr().out
    assert "bert, 2 layers (2 attention modules), 4 heads" in out and "lora" in out and "bitfit" in out


def model_json(capsys, *args: str) -> dict:
    assert main(["model", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name,task,paper", [
    ("t5-small", "classification", (3.38, 1.86)), ("google-t5/t5-base", "classification", (10.13, 5.57)),
    ("bart-base", "classification", (5.06, 2.78)),
])
def test_model_command_prints_paper000_communication_offline(capsys, name, task, paper):
    """Paper 000 Tables 1-4: LoRA r16 on q, k, v, the PEFT tensors only, MiB, dense and at 90% sparsity."""
    out = model_json(capsys, name, "--task", task, "--num-labels", "3", "--methods", "lora", "--set", "peft.r=16",
                     "--sparsity", "0.9", "--tokens", "512")
    [lora] = out["methods"]
    # within the paper's rounding to 2 decimals (it rounds 10.125 up)
    assert abs(lora["paper_mib"] - paper[0]) <= 0.005 + 1e-9 and abs(lora["paper_mib_pruned"] - paper[1]) <= 0.005 + 1e-9
    # what a run sends also carries the 3-label head, the kept-head ids and the scores
    assert lora["run_bytes"] > 4 * lora["trainable"] > 4 * lora["peft_parameters"]
    assert lora["kept_heads"] == round(0.1 * lora["num_heads"]) and lora["run_bytes_pruned"] < lora["run_bytes"]


def test_model_command_takes_peft_options_like_run(capsys):
    r16 = model_json(capsys, "t5-small", "--methods", "lora,prompt_tuning", "--task", "generation", "--set",
                     "peft.r=16", "--set", "peft.num_virtual_tokens=100")["methods"]
    r8 = model_json(capsys, "t5-small", "--methods", "lora", "--task", "generation", "--set", "peft.r=8")["methods"]
    assert r16[0]["peft_parameters"] == 2 * r8[0]["peft_parameters"]
    assert r16[1]["options"]["num_virtual_tokens"] == 100
    assert main(["model", "t5-small", "--methods", "lora", "--set", "peft.rank=8"]) == 2
    assert "peft.rank" in capsys.readouterr().err


def test_model_command_paper003_prompt_sizes(capsys):
    """Paper 003, Tables 4-5: FedPrompt exchanges 6.1M (GPT2-XL) and 3.9M (OPT-1.3B) prompt parameters."""
    for name, expected in (("gpt2-xl", 6_144_000), ("facebook/opt-1.3b", 3_932_160)):
        [prefix] = model_json(capsys, name, "--task", "generation", "--methods", "prefix_tuning", "--set",
                              "peft.num_virtual_tokens=40")["methods"]
        assert prefix["peft_parameters"] == expected


def test_model_command_paper004_vit_offline(capsys):
    """Paper 004's vision backbone (ViT-B/16) from its bundled config: what each adapter method sends against full
    fine-tuning (its Eq. 1 ratio; the paper: transmission reduced by up to 98%)."""
    import torch
    from transformers import AutoModelForImageClassification, ViTConfig

    out = model_json(capsys, "vit-base-patch16-224", "--methods", "full,houlsby,pfeiffer,lora,bitfit,ia3,prompt_tuning")
    assert (out["task_head"], out["tokens"], out["layers"], out["heads"], out["hidden"]) == (
        "classification", 197, 12, 12, 768)  # (224 / 16)^2 patches + the class token
    rows = {r["method"]: r for r in out["methods"]}
    config = ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       image_size=224, patch_size=16, num_labels=2)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForImageClassification.from_config(config).parameters())
    assert rows["full"]["trainable"] == params and rows["full"]["task_head_parameters"] == 768 * 2 + 2
    assert rows["lora"]["peft_parameters"] == 12 * 3 * (768 * 16 + 16 * 768)  # r16 on query, key, value
    for r in rows.values():
        assert r["reduction_vs_full"] == pytest.approx(1 - r["run_bytes"] / rows["full"]["run_bytes"])
    assert rows["houlsby"]["reduction_vs_full"] > 0.97 and all(
        rows[m]["reduction_vs_full"] > 0.98 for m in ("pfeiffer", "lora", "bitfit", "ia3"))
    assert "virtual tokens" in out["not_available"]["prompt_tuning"]
    assert main(["model", "vit-base", "--task", "generation"]) == 2
    assert "vision transformer" in capsys.readouterr().err
    assert main(["model", "vit-base", "--memory"]) == 2
    assert "does not take" in capsys.readouterr().err


def test_every_bundled_architecture_builds_offline_with_lora(capsys):
    from fedpeft.models.architectures import bundled_architectures

    for hub_id in bundled_architectures():
        out = model_json(capsys, hub_id, "--methods", "lora", "--sparsity", "0.5")
        assert out["methods"] and out["methods"][0]["kept_heads"] == max(1, round(0.5 * out["methods"][0]["num_heads"]))


def test_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "fedpeft.cli", "--help"], capture_output=True, text=True, check=True)
    assert "run" in out.stdout and "report" in out.stdout


@pytest.mark.parametrize("algorithm,pruned", [("{name: fedavg}", False),
                                              ("{name: headprune, sparsity: 0.5, selection: random}", True)])
@pytest.mark.needs_data
def test_footprint_run_bytes_match_a_real_upload(tmp_path, algorithm, pruned):
    """`fedpeft model`'s run bytes against the bytes a tiny run's client really sent (metadata digits aside)."""
    from helpers import tiny_config

    from fedpeft.config import load_config as load
    from fedpeft.footprint import footprint
    from fedpeft.models import registry
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    run(tiny_config(f"algorithm={algorithm}", "federation.rounds=1"), tmp_path / "run")
    sent = [b for b in read_metrics(tmp_path / "run")[1]["bytes_up"].values() if b]
    f = footprint("tiny-bert", registry.load_config("tiny-bert"), load(None, []).peft, "classification",
                  sparsity=0.5 if pruned else None)
    predicted = f.run_bytes_pruned if pruned else f.run_bytes
    assert sent and all(abs(b - predicted) <= 64 for b in sent), (sent, predicted)


@pytest.mark.needs_data
def test_a_run_in_which_every_round_failed_exits_non_zero(tmp_path, capsys, monkeypatch):
    from fedpeft.runtime import local_work
    from fedpeft.training.local import NonFiniteLoss

    def diverge(*args, **kwargs):
        raise NonFiniteLoss("training loss is nan at step 1")

    monkeypatch.setattr(local_work, "train_client", diverge)
    args = ["run", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path / "r"), "--no-progress",
            "--set", "model.name=tiny-bert", "--set", "task.max_train_examples=40", "--set", "eval.max_examples=16",
            "--set", "federation.rounds=2", "--set", "federation.num_clients=4"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error: all 2 rounds failed, so the global model is the initial one" in err
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["failed_rounds"] == 2


def test_fedpeft_data_takes_the_task_options_a_run_takes(tmp_path, capsys):
    """A dataset whose columns are not fedpeft's names is shown under the renames a run would use."""
    from fedpeft.cli import main

    (tmp_path / "qs").mkdir()
    (tmp_path / "qs" / "train.jsonl").write_text("".join(
        f'{{"question": "what is {i}?", "topic": "{"num" if i % 2 else "loc"}"}}\n' for i in range(6)))
    assert main(["data", str(tmp_path / "qs")]) == 0  # no field is text: no task inferred, nothing to refuse
    assert "labels:" not in capsys.readouterr().out
    assert main(["data", str(tmp_path / "qs"), "--set", "task.columns.text=question", "--set",
                 "task.columns.label=topic"]) == 0
    out = capsys.readouterr().out
    assert "fields: label, question, text, topic" in out and "labels: 'loc': 3, 'num': 3" in out
    assert main(["data", str(tmp_path / "qs"), "--set", "task.columns.text=question", "--set", "task.type=generation"]
                ) == 2  # the task chosen, its fields checked
    assert "has no field 'input'" in capsys.readouterr().out


@pytest.mark.needs_data
def test_fedpeft_partition_names_the_classes_when_the_data_has_names(capsys):
    from conftest import REPO

    from fedpeft.cli import main

    assert main(["partition", str(REPO / "configs" / "quickstart.yaml"), "--set", "task.dataset=20newsgroups",
                 "--set", "task.eval_split=test", "--set", "task.max_train_examples=200", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "sci.space:" in out and " 0:" not in out


def test_fedpeft_data_reads_the_name_as_given_and_passes_the_hub_config(tmp_path, monkeypatch, capsys):
    """A dataset named like a YAML number or boolean is a name, not a value; --set task.dataset_config reaches the
    Hub's split listing and loading."""
    import datasets

    from fedpeft import hub
    from fedpeft.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "2024").mkdir()
    (tmp_path / "2024" / "train.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    assert main(["data", "2024", "--data-dir", str(tmp_path)]) == 0 and "train: 2 rows" in capsys.readouterr().out
    seen = []
    monkeypatch.setattr(hub, "hub_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda hub_id, config=None, **_: seen.append(config)
                        or ["train"])
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, config=None, split=None, **_: seen.append(config)
                        or [{"sentence": "fine", "label": 1}, {"sentence": "bad", "label": 0}])
    assert main(["data", "example-org/glue-like", "--data-dir", str(tmp_path), "--set", "task.dataset_config=cola",
                 "--set", "task.columns.text=sentence"]) == 0
    assert seen == ["cola", "cola"] and "labels: 0: 1, 1: 1" in capsys.readouterr().out
    assert main(["data", "2024", "--data-dir", str(tmp_path), "--set", "task.dataset=other"]) == 2
    assert "give the dataset as the command's argument" in capsys.readouterr().err
