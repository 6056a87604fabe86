"""Natural clients: the column and dirichlet_column partition schemes, on hand-made and real (E2E NLG) data."""

import json
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO
from helpers import tiny_config

from fedpeft.cli import main
from fedpeft.config import ConfigError, load_config
from fedpeft.config.schema import TaskConfig
from fedpeft.data.catalog import mr_fields
from fedpeft.data.partition import (
    MISSING,
    PartitionError,
    by_column,
    dirichlet_column,
    format_stats,
    partition,
    partition_stats,
)
from fedpeft.data.prepare import train_column
from fedpeft.data.sources import DataError, data_dirs
from fedpeft.runtime.setup import build_partition

E2E = ["task.type=generation", "task.dataset=e2e_nlg", "task.train_split=validation_pairs", "task.eval_split=test"]


def _e2e_pairs() -> list[dict]:
    path = next(d / "e2e_nlg" / "validation_pairs.jsonl" for d in data_dirs()
                if (d / "e2e_nlg" / "validation_pairs.jsonl").is_file())
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _e2e_task(**kw) -> TaskConfig:
    return TaskConfig(type="generation", dataset="e2e_nlg", train_split="validation_pairs", eval_split="test",
                      max_train_examples=kw.pop("max_train_examples", None), **kw)


def _cover(parts, n):
    idx = np.concatenate(parts)
    assert len(idx) == n and len(np.unique(idx)) == n


def test_mr_attributes_become_snake_case_fields():
    mr = "name[The Vaults], eatType[pub], priceRange[more than £30], customer rating[5 out of 5], near[Café Adriatic]"
    assert mr_fields(mr) == {"name": "The Vaults", "eat_type": "pub", "price_range": "more than £30",
                             "customer_rating": "5 out of 5", "near": "Café Adriatic"}


@pytest.mark.needs_data
def test_column_partition_of_e2e_by_eat_type_matches_the_file():
    rows = _e2e_pairs()
    coffee = sum("eatType[coffee shop]" in r["input"] for r in rows)
    without = sum("eatType[" not in r["input"] for r in rows)
    assert coffee + without == len(rows) == 4672  # this split names one eat type, or none
    values = train_column(_e2e_task(), "eat_type", seed=0)
    assert Counter(values.tolist()) == {"coffee shop": coffee, MISSING: without}
    parts = by_column(values, 2, np.random.default_rng(0), column="eat_type")
    _cover(parts, len(rows))
    assert [len(p) for p in parts] == [coffee, without]  # the larger value is client 0
    assert all("eatType[coffee shop]" in rows[i]["input"] for i in parts[0])
    assert all("eatType[" not in rows[i]["input"] for i in parts[1])
    stats = partition_stats(parts, categories=values, column="eat_type")
    assert [c["values"] for c in stats["clients"]] == [{"coffee shop": coffee}, {MISSING: without}]


@pytest.mark.needs_data
def test_column_partition_of_e2e_by_name_one_client_per_restaurant():
    rows = _e2e_pairs()
    names = Counter(re.search(r"name\[([^\]]*)\]", r["input"])[1] for r in rows)
    assert len(names) == 20
    values = train_column(_e2e_task(), "name", seed=0)
    parts = by_column(values, 20, np.random.default_rng(0), column="name")
    _cover(parts, len(rows))
    held = [Counter(re.search(r"name\[([^\]]*)\]", rows[i]["input"])[1] for i in p) for p in parts]
    assert all(len(h) == 1 for h in held)  # one restaurant per client, all of its rows
    assert {next(iter(h)): sum(h.values()) for h in held} == names
    assert held[0] == {"The Eagle": 679} and sorted(map(len, parts), reverse=True) == [len(p) for p in parts]


@pytest.mark.needs_data
def test_more_names_than_clients_are_grouped_whole_and_balanced():
    values = train_column(_e2e_task(), "name", seed=0)
    parts = by_column(values, 4, np.random.default_rng(0), column="name")
    _cover(parts, len(values))
    owners = [set(values[p]) for p in parts]
    assert sum(map(len, owners)) == 20 and set().union(*owners) == set(values)  # each name in one client
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 20  # largest first onto the least loaded client: 1159..1173 here


def test_grouping_by_hand_largest_first_onto_the_least_loaded_client():
    cats = np.array(["a"] * 50 + ["b"] * 40 + ["c"] * 30 + ["d"] * 20 + ["e"] * 10)
    parts = by_column(cats, 2, np.random.default_rng(0))
    # a->0 (50, 0); b->1 (50, 40); c->1 (50, 70); d->0 (70, 70); e->0, the first of the tied (80, 70)
    assert [sorted(set(cats[p])) for p in parts] == [["a", "d", "e"], ["b", "c"]]
    _cover(parts, len(cats))


def test_grouping_is_seeded_and_deterministic():
    cats = np.repeat([f"v{i}" for i in range(12)], 5)  # equal sizes: the seeded order decides
    a, b, c = (by_column(cats, 3, np.random.default_rng(s)) for s in (1, 1, 2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert all(len(p) == 20 for p in c)


def test_too_few_values_is_one_line_naming_column_count_and_fix():
    cats = np.array(["pub", "pub", "coffee shop", MISSING])
    with pytest.raises(PartitionError) as err:
        by_column(cats, 4, np.random.default_rng(0), column="eat_type")
    msg = str(err.value)
    assert "'eat_type' has 3 distinct values" in msg and "num_clients (4)" in msg and "at most 3" in msg
    assert "\n" not in msg
    with pytest.raises(PartitionError, match="min_size"):
        by_column(np.array(["a"] * 9 + ["b"]), 2, np.random.default_rng(0), min_size=2)


def test_dirichlet_column_is_seeded_and_skews_more_as_alpha_shrinks():
    cats = np.repeat(["red", "green", "blue", "grey"], 500)
    a = dirichlet_column(cats, 20, 0.3, np.random.default_rng(5))
    b = dirichlet_column(cats, 20, 0.3, np.random.default_rng(5))
    c = dirichlet_column(cats, 20, 0.3, np.random.default_rng(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    _cover(a, len(cats))
    tv = {alpha: partition_stats(dirichlet_column(cats, 20, alpha, np.random.default_rng(3)), categories=cats)[
        "value_tv_distance_to_global_mean"] for alpha in (100.0, 1.0, 0.05)}
    assert tv[100.0] < 0.1 < tv[1.0] < tv[0.05] and tv[0.05] > 0.5
    with pytest.raises(PartitionError, match="single value"):
        dirichlet_column(np.array(["x"] * 10), 2, 0.5, np.random.default_rng(0))


def test_partition_dispatches_the_column_schemes():
    cats = np.array(["a", "b", "a", "c"])
    parts = partition("column", 3, np.random.default_rng(0), n=4, categories=cats, column="site")
    assert parts[0].tolist() == [0, 2] and sorted(p.tolist() for p in parts[1:]) == [[1], [3]]
    with pytest.raises(PartitionError, match="needs the value of federation.partition.column"):
        partition("dirichlet_column", 2, np.random.default_rng(0), n=4)


def test_config_requires_the_column_for_its_schemes_and_refuses_it_elsewhere():
    ok = load_config(None, ["federation.partition.scheme=column", "federation.partition.column=eat_type"])
    assert ok.federation.partition.column == "eat_type"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["federation.partition.scheme=dirichlet_column"])
    assert "needs column" in str(err.value) and "--set federation.partition.column=" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["federation.partition.column=eat_type"])
    assert "column is used only by schemes column and dirichlet_column (scheme is iid)" in str(err.value)
    assert "\n" not in str(err.value)


def test_server_share_is_kept_out_of_a_column_partition():
    cfg = load_config(None, [
        "model.name=tiny-llama", *E2E, "peft={method: prefix_tuning, num_virtual_tokens: 4}",
        "algorithm={name: fedsp}", "federation.num_clients=3", "federation.clients_per_round=2",
        "federation.partition.scheme=column", "federation.partition.column=site"])
    values = np.repeat(["x", "y", "z", "w"], [40, 30, 20, 10])
    data = SimpleNamespace(train=range(len(values)), train_labels=None)
    parts, server = build_partition(cfg, data, values)
    assert server is not None and len(server) == round(len(values) / 11)
    _cover([*parts, server], len(values))
    rest = np.setdiff1d(np.arange(len(values)), server)
    assert Counter(v for p in parts for v in values[p]) == Counter(values[rest])
    assert all(len(set(values[p]) & set(values[q])) == 0 for i, p in enumerate(parts) for q in parts[i + 1:])


def test_missing_values_form_their_own_category_and_lists_are_refused(tmp_path, caplog):
    rows = [{"input": "a", "target": "b", "site": "north"}, {"input": "a", "target": "b", "site": None},
            {"input": "a", "target": "b", "site": "  "}, {"input": "a", "target": "b"},
            {"input": "a", "target": "b", "site": 3}, {"input": "a", "target": "b", "site": True}]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = TaskConfig(type="generation", dataset=str(tmp_path / "d"), max_train_examples=None)
    assert train_column(task, "site", 0).tolist() == ["north", MISSING, MISSING, MISSING, "3", "true"]
    assert "'site': 3 of 6 training rows have no value" in caplog.text  # said, not silent
    rows[0]["site"] = MISSING  # a real value spelled like the missing category is refused, not merged
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"row 1: federation.partition.column 'site' is '\(missing\)'"):
        train_column(task, "site", 0)
    rows[0]["site"] = "north"
    with pytest.raises(DataError, match="no row has the field 'sitee'.*fields: input, site, target"):
        train_column(task, "sitee", 0)
    rows[4]["site"] = ["a", "b"]
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError) as err:
        train_column(task, "site", 0)
    assert "train.jsonl: split 'train' row 5: federation.partition.column 'site' is ['a', 'b']" in str(err.value)
    assert "choose another column" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.needs_data
def test_column_values_follow_the_seeded_training_subset():
    from fedpeft.data.prepare import prepare_task
    from fedpeft.models import registry

    task = _e2e_task(max_train_examples=50)
    tok = registry.load_tokenizer("tiny-gpt2")
    data = prepare_task(task, tok, encoder_decoder=False, seed=3, eval_max_examples=4)
    values = train_column(task, "name", seed=3)
    assert len(values) == len(data.train) == 50
    for ids, name in zip(data.train.input_ids, values):  # tiny-gpt2 has an uncased BERT vocabulary
        assert f"name[{name}]".lower().replace(" ", "") in tok.decode(ids).replace(" ", "")


@pytest.mark.needs_data
def test_partition_command_shows_each_clients_values(capsys):
    sets = ["model.name=tiny-gpt2", *E2E, "task.max_train_examples=null", "federation.num_clients=4",
            "federation.partition.scheme=column", "federation.partition.column=name"]
    cfg = str(REPO / "configs" / "quickstart.yaml")
    assert main(["partition", cfg, *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "clients: 4  examples: 4672" in out and "column 'name': 20 values" in out
    assert "client  size  name" in out and "     0  1159  The Eagle:679, Browns Cambridge:233" in out
    bad = [*sets[:-1], "federation.partition.column=eat_type"]
    assert main(["partition", cfg, *[a for s in bad for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'eat_type' has 2 distinct values" in err[0]


@pytest.mark.needs_data
def test_tiny_run_with_clients_by_eat_type(tmp_path):
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    cfg = tiny_config("model.name=tiny-gpt2", *E2E, "eval.max_examples=4", "task.generation_max_new_tokens=4",
                      "federation.num_clients=2", "federation.rounds=1", "train.local_steps=1",
                      "federation.partition.scheme=column", "federation.partition.column=eat_type")
    run(cfg, tmp_path / "run")
    counts = Counter(train_column(cfg.task, "eat_type", cfg.seed).tolist())  # 64 seeded rows
    sizes = json.loads((tmp_path / "run" / "partition.json").read_text())["clients"]
    assert [c["size"] for c in sizes] == [counts["coffee shop"], counts[MISSING]]
    last = read_metrics(tmp_path / "run")[-1]
    assert last["round"] == 1 and sorted(last["clients"]) == [0, 1] and np.isfinite(last["eval_rougeL"])


def test_format_stats_lists_values_largest_first():
    cats = np.array(["b"] * 3 + ["a"] * 5 + [f"v{i}" for i in range(7)])
    stats = partition_stats([np.arange(len(cats))], categories=cats, column="site")
    line = format_stats(stats).splitlines()[-1]
    assert line.startswith("     0    15  a:5, b:3, v0:1, v1:1, v2:1, v3:1, ... 3 more")
