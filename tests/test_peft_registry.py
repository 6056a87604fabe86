"""The PEFT method contract: every registered method (built-in ones through the same public function a plugin
calls) wraps a backbone, trains, and saves an adapter that loads back to the same model; a plugin's method
with no analytic OPs trains and reports them as unknown."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import numpy as np
import pytest
import torch
from conftest import REPO

import fedpeft
from fedpeft.adapters import load_adapter
from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.config.schema import options_for
from fedpeft.models import registry
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.tuners import PEFT_METHODS, apply_tuner, method_options, registered_peft_method
from fedpeft.tuners.analytic_ops import OpsTerms

EXAMPLE = REPO / "examples" / "custom_peft_method"
PLUGIN = str(EXAMPLE / "plugin.py")


@pytest.mark.parametrize("name", sorted(PEFT_METHODS))
def test_every_registered_method_keeps_the_contract(name, tmp_path):
    entry = registered_peft_method(name)
    assert options_for("peft", name) is entry.options and entry.options().method == name
    assert entry.options.maps_to_heads == (entry.head_params is not None)
    if entry.analytic_ops is not None:  # what it declares is a count of one sequence, in both conventions
        terms = entry.analytic_ops(2, 8, 4, entry.options().model_dump(), 2)
        assert isinstance(terms, OpsTerms) and terms.appendix_a_ops() > terms.appendix_a_ops(0.5) > 0
        assert terms.paper000_ops() is None or terms.paper000_ops() > 0
    tok = registry.load_tokenizer("tiny-bert")
    tuned = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok, seed=3),
                        method_options(name), "classification", tokenizer=tok)
    assert any("classifier" in n for n in tuned.params), "a classifier's task head trains under every method"
    frozen = [n for n, p in tuned.module.named_parameters() if not p.requires_grad]
    assert frozen or name == "full"
    rng = np.random.default_rng(0)
    tuned.load_state({k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in tuned.state().items()})
    tuned.save_adapter(tmp_path, "tiny-bert", extra={"num_labels": 2, "seed": 3})
    assert json.loads((tmp_path / "fedpeft_adapter.json").read_text())["save_format"] == entry.save_format
    batch = tok(["a fine film", "dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = tuned.module.eval()(**batch).logits
        loaded = load_adapter(tmp_path).model(**batch).logits
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.needs_data
def test_the_example_method_runs_from_the_command_line_with_unknown_ops(tmp_path, capsys):
    assert main(["run", str(EXAMPLE / "config.yaml"), "--plugin", PLUGIN, "--run-dir", "run", "--no-progress"]) == 0
    rows = read_metrics("run")
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["ops_analytic"] is None and set(r["client_ops_analytic"].values()) == {None}
        assert r["flops"] > 0 and r["agg_update_norm"] > 0  # measured FLOPs still come, and it trains
    assert read_summary("run")["total_ops_analytic"] is None
    meta = json.loads((tmp_path / "run" / "adapter" / "fedpeft_adapter.json").read_text())
    assert meta["method"] == "layernorm" and meta["plugins"] == [PLUGIN]
    # in a fresh process the adapter loads once the caller names the plugin or trusts the ones its json lists;
    # without either it is refused naming the plugin (an adapter is data: it never imports code by itself)
    def probe(keywords: str) -> subprocess.CompletedProcess:
        code = (f"import fedpeft; a = fedpeft.load_adapter('run/adapter'{keywords}); "
                "print(a.meta['method'], type(a.model).__name__)")
        return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=tmp_path)

    for keywords in (f", plugins=[{PLUGIN!r}]", ", trust_plugins=True"):
        out = probe(keywords)
        assert out.stdout.split() == ["layernorm", "BertForSequenceClassification"], out.stderr
    refused = probe("")
    assert refused.returncode != 0 and "PEFT method 'layernorm' is not registered" in refused.stderr
    assert f"--plugin {PLUGIN}" in refused.stderr and "--trust-plugins" in refused.stderr
    capsys.readouterr()
    assert main(["eval", "run", "--adapter", "last", "--max-examples", "32", "--json", "--plugin", PLUGIN]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["eval_accuracy"] == pytest.approx(rows[-1]["eval_accuracy"])


def test_the_example_method_trains_only_norms_and_the_head():
    fedpeft.load_plugin(PLUGIN)
    tok = registry.load_tokenizer("tiny-bert")
    tuned = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok),
                        method_options("layernorm"), "classification")
    assert tuned.params and all("LayerNorm" in n or n.startswith("classifier.") for n in tuned.params)
    skipped = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok),
                          method_options("layernorm", skip_embedding_norm=True), "classification")
    assert set(tuned.params) - set(skipped.params) == {"bert.embeddings.LayerNorm.weight", "bert.embeddings.LayerNorm.bias"}


def test_a_method_without_heads_is_refused_by_headprune_naming_those_with_heads():
    with pytest.raises(ConfigError, match=r"which 'layernorm' has none of: set peft.method to one of ia3, lora, p_tuning"):
        load_config(EXAMPLE / "config.yaml", ["algorithm={name: headprune}"], plugins=[PLUGIN])


def test_fedpeft_model_lists_a_plugin_method_with_unknown_ops(capsys):
    assert main(["model", "tiny-bert", "--plugin", PLUGIN, "--methods", "lora,layernorm"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("layernorm"))
    assert line.split()[-2:] == ["unknown", "unknown"]
    assert main(["model", "tiny-bert", "--methods", "nosuch"]) == 2
    assert "choose from bitfit, full, houlsby" in capsys.readouterr().err


def test_registration_mistakes_are_refused_with_the_fix():
    class Mine(fedpeft.PeftOptions):
        method: Literal["mine"] = "mine"

    class Headed(fedpeft.PeftOptions):
        method: Literal["headed"] = "headed"
        maps_to_heads = True

    def apply(model, options, ctx):
        return model

    with pytest.raises(ValueError, match="must default to 'other'"):
        fedpeft.register_peft_method("other", options=Mine, apply=apply)
    with pytest.raises(ValueError, match="save_format 'pickle'"):
        fedpeft.register_peft_method("mine", options=Mine, apply=apply, save_format="pickle")
    with pytest.raises(TypeError, match="analytic_ops must be a function"):
        fedpeft.register_peft_method("mine", options=Mine, apply=apply, analytic_ops=42)
    with pytest.raises(TypeError, match="rows are declared as a function .* frozen_backbone"):  # the old form
        fedpeft.register_peft_method("mine", options=Mine, apply=apply, analytic_ops=("qkv", "attention", "fc"))
    with pytest.raises(ValueError, match="give head_params exactly when"):
        fedpeft.register_peft_method("headed", options=Headed, apply=apply)
    with pytest.raises(ValueError, match="already registered"):
        class Lora(fedpeft.PeftOptions):
            method: Literal["lora"] = "lora"

        fedpeft.register_peft_method("lora", options=Lora, apply=apply)
    with pytest.raises(ValueError, match="already registered"):  # the same options, another implementation
        fedpeft.register_peft_method("bitfit", options=options_for("peft", "bitfit"), apply=apply)
    assert "mine" not in PEFT_METHODS
    with pytest.raises(ValueError, match="unknown choice 'mine'"):
        options_for("peft", "mine")


QV_LORA_PLUGIN = '''"""LoRA on the query and value projections only (as in the LoRA paper), a plugin that declares what head pruning
and paper 000's OPs need: its head map and its analytic OPs."""

from typing import ClassVar, Literal

import fedpeft
from fedpeft.tuners.analytic_ops import OpsTerms, backbone_rows, head_row, paper000_products

CALLS = []


class QvLoraOptions(fedpeft.PeftOptions):
    method: Literal["qv_lora"] = "qv_lora"
    maps_to_heads: ClassVar[bool] = True  # its head map is declared below
    lora_factors: ClassVar[bool] = True
    r: int = 4
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: list[str] = ["query", "value"]  # BERT's names


def qv_lora_ops(L, d, T, options, heads):
    """The backbone's rows and two thirds of Table 6's LoRA row (two of the three projections)."""
    CALLS.append((L, d, T, heads))
    r = float(options["r"])
    row = (L * (T * d**2 * r + T * r**2 * d), L * (T * d**2 * r + 2 * T * r * d + T * r**2 * d + T * d**3))
    a, b, c = paper000_products(L, d, T)
    return OpsTerms((*backbone_rows(L, d, T), head_row((2 * row[0] / 3, 2 * row[1] / 3))),
                    (2 * a + 8 * r * c, 6 * a + 5 * b + 4 * r * c))


fedpeft.register_peft_method("qv_lora", options=QvLoraOptions, apply="fedpeft.tuners.lora.apply:apply_lora",
                             save_format="peft", trains_task_head=True, analytic_ops=qv_lora_ops,
                             head_params="fedpeft.heads.layout:qkv_head_params")
'''


@pytest.mark.needs_data
def test_a_plugin_method_gets_head_pruning_and_the_analytic_ops_by_declaring_them(tmp_path, capsys):
    """Nothing outside the plugin names it: headprune splits its tensors by head with the head map it declares,
    and runs count the analytic OPs it declares (scaled to the kept heads), as for a built-in."""
    from helpers import tiny_config

    from fedpeft.runtime.embedded import EmbeddedRuntime

    plugin = tmp_path / "qv_lora.py"
    plugin.write_text(QV_LORA_PLUGIN)
    cfg = tiny_config("peft={method: qv_lora}", "algorithm={name: headprune, sparsity: 0.5}", "federation.rounds=1",
                      plugins=[str(plugin)])
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    rt.run()
    layout = rt.exp.layout
    assert layout is not None and layout.params
    adapted = {part for name in layout.params for part in name.split(".") if part in ("query", "key", "value")}
    assert adapted == {"query", "value"} and all("lora_B" in name for name in layout.params)
    row = read_metrics(tmp_path / "run")[1]
    assert not row.get("rejected") and row["agg_kept_heads_mean"] == layout.num_heads / 2
    assert row["ops_analytic"] > 0 and all(v > 0 for v in row["client_ops_analytic"].values())
    declared = sys.modules[next(m for m in sys.modules if m.startswith("fedpeft_plugin_") and "qv_lora" in m)]
    assert declared.CALLS  # the run counted with the plugin's own function
    trainer = rt.exp.trainer
    assert {f for _, f in trainer._ops_cache} == {0.5}
    for (T, fraction), ops in trainer._ops_cache.items():
        terms = declared.qv_lora_ops(layout.num_modules, rt.exp.shape.hidden, T, cfg.peft.model_dump(), None)
        assert ops == terms.appendix_a_ops(fraction) < terms.appendix_a_ops()
    # fedpeft model counts it too: both conventions, dense and with half the heads pruned
    capsys.readouterr()
    assert main(["model", "tiny-bert", "--plugin", str(plugin), "--methods", "qv_lora", "--sparsity", "0.5",
                 "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["methods"]
    assert shown["method"] == "qv_lora" and shown["kept_heads"] == shown["num_heads"] // 2
    assert 0 < shown["ops_pruned"]["appendix_a"] < shown["ops"]["appendix_a"]
    assert 0 < shown["ops_pruned"]["paper000_macs"] < shown["ops"]["paper000_macs"]
