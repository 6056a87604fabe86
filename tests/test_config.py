import pytest
from conftest import REPO

from fedpeft.config import ConfigError, load_config
from fedpeft.config.load import apply_overrides, parse_override
from fedpeft.config.schema import RunConfig


def test_defaults_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, RunConfig)
    assert cfg.peft.method == "lora" and cfg.algorithm.name == "fedavg"
    assert cfg.primary_metric() == "accuracy"


def test_every_shipped_config_validates():
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs, "configs/ must ship ready-made configs"
    for path in configs:
        load_config(path)


def test_override_parsing():
    assert parse_override("train.lr=1e-3") == (["train", "lr"], 0.001)
    assert parse_override("peft.target_modules=[query,value]") == (["peft", "target_modules"], ["query", "value"])
    assert parse_override("eval.max_examples=null") == (["eval", "max_examples"], None)
    raw = apply_overrides({"train": {"lr": 1.0}}, ["train.lr=0.5", "seed=3"])
    assert raw == {"train": {"lr": 0.5}, "seed": 3}


@pytest.mark.parametrize(
    "override, expected",
    [
        ("foo=1", "foo: unknown key; valid keys here: algorithm, eval, federation"),
        ("train.optimizer=adagrad", "train.optimizer: Input should be 'adamw', 'adam' or 'sgd'"),
        ("peft.method=lorax", "peft.method: unknown choice 'lorax'; valid choices: 'bitfit', 'full', 'houlsby'"),
        ("peft.rank=4", "peft.lora.rank: unknown key; valid keys here: alpha, dropout, method, r, target_modules"),
        ("algorithm.mu=0.1", "algorithm.fedavg.mu: unknown key; valid keys here: dp, name, robust, server_lr"),
        ("train.lr=-1", "train.lr: Input should be greater than 0"),
        ("federation.clients_per_round=11", "clients_per_round (11) exceeds num_clients (10)"),
        ("federation.partition.scheme=pathological", "federation.partition.scheme: Input should be 'iid'"),
    ],
)
def test_bad_values_are_rejected_with_the_valid_choices(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)  # one problem, one line


def test_a_value_read_as_a_mapping_says_to_quote_it():
    # YAML reads a trailing ':' as a one-key mapping; the error names the --set key and the quoted form
    with pytest.raises(ConfigError) as err:
        load_config(None, ["peft.method=prompt_tuning", "peft.init_text=Review sentiment:"])
    assert "(got the mapping {'Review sentiment': None}" in str(err.value)
    assert """--set 'peft.init_text="Review sentiment:"'""" in str(err.value) and "\n" not in str(err.value)
    quoted = load_config(None, ["peft.method=prompt_tuning", 'peft.init_text="Review sentiment:"'])
    assert quoted.peft.init_text == "Review sentiment:"


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_section_without_tag_means_default_method():
    cfg = load_config(None, ["peft.r=4", "algorithm.server_lr=0.5"])
    assert cfg.peft.method == "lora" and cfg.peft.r == 4
    assert cfg.algorithm.name == "fedavg" and cfg.algorithm.server_lr == 0.5


def test_method_options_are_validated_per_method():
    cfg = load_config(None, ["peft.method=prefix_tuning", "peft.projection=true", "peft.num_virtual_tokens=8"])
    assert cfg.peft.projection is True and cfg.peft.num_virtual_tokens == 8
    cfg = load_config(None, ["algorithm.name=fedyogi", "algorithm.tau=0.01"])
    assert cfg.algorithm.tau == 0.01


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    from fedpeft.cli import main

    path = tmp_path / "broken.yaml"
    path.write_text("task:\n  dataset: [sst2\nmodel:\n  name: tiny-bert\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}:3:6: not valid YAML") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("text, line, first", [
    ("train:\n  lr: 0.001\nfederation:\n  rounds: 3\ntrain:\n  batch_size: 4\n", 5, 1),  # a section twice
    ("train:\n  lr: 0.001\n  batch_size: 4\n  lr: 0.01\n", 4, 2),  # a key twice in one section
])
def test_a_duplicated_key_or_section_is_refused(tmp_path, text, line, first):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{path}:{line}:\d+: key '\w+' is given twice in one mapping "
                                          rf"\(first on line {first}\)"):
        load_config(path)


def test_yaml_merge_keys_still_work_and_a_list_as_key_is_refused(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("defaults: &d\n  lr: 0.01\ntrain:\n  <<: *d\n  batch_size: 4\n")
    from fedpeft.config.load import read_yaml

    assert read_yaml(merged)["train"] == {"lr": 0.01, "batch_size": 4}
    listed = tmp_path / "listed.yaml"
    listed.write_text("train:\n  [lr, batch_size]: 1\n")
    with pytest.raises(ConfigError, match=rf"{listed}:2:3: a list cannot be a key"):
        load_config(listed)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lr=true", "train.lr: got the boolean true, which this option does not take"),
        ("federation.num_clients=yes", "federation.num_clients: got the boolean true"),
        ("peft.r=on", "peft.r: got the boolean true"),
        ("seed=false", "seed: got the boolean false"),
        ("algorithm={name: fedprox, mu: true}", "algorithm.mu: got the boolean true"),
        ("algorithm.robust={rule: trimmed_mean, trim_fraction: true}", "algorithm.robust.trim_fraction: got the boolean"),
        ("peft.target_modules=[query, true]", "peft.target_modules: got the boolean ['query', True]"),
        ("train.lr=.inf", "train.lr: Input should be a finite number (got inf)"),
        ("train.lr=nan", "train.lr: Input should be a finite number (got 'nan')"),
        ("algorithm={name: fedadam, server_lr: -.inf}", "algorithm.fedadam.server_lr: Input should be a finite number"),
        ("seed=-1", "seed: Input should be greater than or equal to 0 (got -1)"),
        ("seed=9223372036854775808", "seed: Input should be less than 9223372036854775808"),
    ],
)
def test_booleans_non_finite_numbers_and_out_of_range_seeds_are_refused(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_boolean_options_still_take_booleans_and_the_largest_seed_is_taken():
    cfg = load_config(None, ["eval.save_best=false", "runtime.progress=no", f"seed={2**63 - 1}"])
    assert cfg.eval.save_best is False and cfg.runtime.progress is False and cfg.seed == 2**63 - 1


def _numeric_fields(model):
    """(name, annotation) of the options that take a number and no boolean."""
    from fedpeft.config.section import admits_bool

    numeric = {int, float, int | None, float | None}
    return [(n, f.annotation) for n, f in model.model_fields.items()
            if f.annotation in numeric and not admits_bool(f.annotation)]


def test_every_registered_methods_numeric_options_refuse_a_boolean():
    """Through the registries: every algorithm's and PEFT method's number options (built-in or a plugin's,
    which subclass the same base) refuse true instead of reading it as 1."""
    from fedpeft.registry import ALGORITHMS, PEFT_METHODS

    checked = 0
    for table, tag in ((ALGORITHMS, "name"), (PEFT_METHODS, "method")):
        for name, entry in table.items():
            model = entry.options
            for field, _ in _numeric_fields(model):
                with pytest.raises(ValueError, match="got the boolean true"):
                    model.model_validate({tag: name, field: True})
                checked += 1
    assert checked > 20


def test_an_empty_config_file_is_refused(tmp_path):
    for text in ("", "# only a comment\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml: the config file is empty; write the sections"):
            load_config(path)


def test_a_hint_names_the_keys_of_the_union_member_the_discriminator_picks():
    """The valid keys listed for an unknown key come from the member the union's discriminator selects, even when
    another member has a Literal field with the same value (here both have mode 'x')."""
    from typing import Annotated, Literal

    from pydantic import Field

    from fedpeft.config.load import _section_model
    from fedpeft.config.section import Section

    class First(Section):
        kind: Literal["first"] = "first"
        mode: Literal["x"] = "x"
        alpha: int = 1

    class Second(Section):
        kind: Literal["second"] = "second"
        mode: Literal["x"] = "x"
        beta: int = 1

    union = Annotated[First | Second, Field(discriminator="kind")]
    assert _section_model(union, {"kind": "second", "mode": "x", "gamma": 1}) is Second
    assert _section_model(First | Second, {"kind": "second", "gamma": 1}, "kind") is Second
    assert _section_model(First | Second, {"kind": "second", "gamma": 1}) is Second  # no discriminator: the Literal


def test_a_dotted_set_of_the_method_starts_from_the_new_methods_options(tmp_path, caplog):
    """`--set peft.method=bitfit` on a LoRA config drops LoRA's keys of the file (logged), keeps the ones the new
    method shares, and still refuses a key the user set for a method that has none."""
    import logging

    path = tmp_path / "run.yaml"
    path.write_text("peft: {method: lora, r: 16, alpha: 32, dropout: 0.1}\n"
                    "algorithm: {name: fedprox, mu: 0.01, server_lr: 0.5}\n")
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        cfg = load_config(path, ["peft.method=bitfit", "algorithm.name=fedavg"])
    assert cfg.peft.method == "bitfit" and cfg.algorithm.name == "fedavg" and cfg.algorithm.server_lr == 0.5
    assert "the config's peft options alpha, dropout, r belong to another method and were dropped" in caplog.text
    assert "the config's algorithm options mu belong to another method" in caplog.text
    assert load_config(path, ["peft.method=ia3"]).peft.method == "ia3"
    assert load_config(path, ["peft.method=lora", "peft.r=4"]).peft.r == 4  # the same method: nothing dropped
    with pytest.raises(ConfigError, match=r"peft.bitfit.r: unknown key"):
        load_config(path, ["peft.method=bitfit", "peft.r=8"])  # set by the user: refused, not dropped


def test_a_method_switch_after_a_whole_section_or_to_a_non_name_is_left_to_validation(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("peft: {method: lora, r: 16}\n")
    with pytest.raises(ConfigError, match=r"peft.method: unknown choice"):
        load_config(path, ["peft.method=[a]"])  # a list, not a name: the usual one-line refusal
    with pytest.raises(ConfigError, match=r"peft.bitfit.r: unknown key"):  # the whole section is the user's
        load_config(path, ["peft={method: lora, r: 8}", "peft.method=bitfit"])
