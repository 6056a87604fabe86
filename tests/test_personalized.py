"""eval.personalized: each selected client's personalized model scored on a held-out slice of its own
partition, reported per client and as the sample-weighted mean."""

import types

import numpy as np
import pytest
from helpers import tiny_config

import fedpeft
from fedpeft.config import ConfigError
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.personal import check_personal, personal_row, score
from fedpeft.runtime.setup import hold_out


def test_hold_out_splits_each_part_without_losing_an_example():
    parts = [np.arange(0, 10), np.arange(10, 11), np.arange(11, 14)]
    train, held = hold_out(parts, 0.2, seed=3)
    assert [len(h) for h in held] == [2, 0, 1]  # a client of one example keeps it for training
    for part, t, h in zip(parts, train, held):
        assert not set(t) & set(h) and sorted([*t, *h]) == list(part)
    assert all(np.array_equal(a, b) for a, b in zip(held, hold_out(parts, 0.2, seed=3)[1]))


def test_reports_are_checked_and_averaged_by_held_out_examples():
    assert check_personal({"examples": 2, "accuracy": 0.5}) is None
    assert "not a finite number" in check_personal({"examples": 2, "accuracy": float("nan")})
    assert "positive integer" in check_personal({"examples": 0, "accuracy": 0.5})
    assert "not an object" in check_personal([1, 2])
    row = personal_row({1: {"personal": {"examples": 1, "accuracy": 1.0}},
                        4: {"personal": {"examples": 3, "accuracy": 0.0, "loss": 2.0}}, 5: {}})
    assert row["personal_accuracy"] == pytest.approx(0.25) and row["personal_loss"] == 2.0
    assert row["personal_examples"] == 4 and set(row["client_personal"]) == {"1", "4"}


def test_an_algorithm_without_a_personalized_model_is_refused():
    with pytest.raises(ConfigError, match="eval.personalized: algorithm headprune"):
        tiny_config("algorithm.name=headprune", "eval.personalized=true")
    with pytest.raises(ConfigError, match="eval.personalized together are not supported"):
        tiny_config("eval.personalized=true", "runtime.name=flower", "runtime.flower.secure_aggregation={}",
                    "runtime.flower.num_supernodes=4")


class Sent(fedpeft.RunObserver):
    """What each client received, and (by reference to the runtime) what it kept, at each round's start."""

    def __init__(self):
        self.payloads, self.kept = {}, {}
        self.rt = None

    def on_configure(self, rnd, payloads):
        self.payloads[rnd] = payloads
        self.kept[rnd] = {c: {k: dict(v) if isinstance(v, dict) else v for k, v in s.items()}
                          for c, s in self.rt.client_states.items()}


def rescore(rt, cid, arrays):
    rt.exp.tuned.load_state(arrays)
    return score(rt.exp, rt.exp.tuned.module, rt.exp.personal_data(cid))


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["fedavg", "fedsa_lora"])
def test_the_reported_score_is_the_personalized_model_on_the_clients_own_slice(name, tmp_path):
    cfg = tiny_config(f"algorithm.name={name}", "eval.personalized=true", "peft.r=4", "federation.rounds=3",
                      "federation.clients_per_round=3", "train.lr=0.01")
    sent = Sent()
    rt = EmbeddedRuntime(cfg, tmp_path / name, observers=[sent])
    sent.rt = rt
    rt.run()
    rows = read_metrics(tmp_path / name)
    held = {c: set(h.tolist()) for c, h in enumerate(rt.exp.personal_parts)}
    for c, part in enumerate(rt.exp.parts):  # held out of training
        assert held[c] and not held[c] & set(part.tolist())
    for r in rows[1:]:
        assert set(r["client_personal"]) == {str(c) for c in r["clients"]}
        sizes = {c: r["client_personal"][str(c)]["examples"] for c in r["clients"]}
        assert sizes == {c: len(held[c]) for c in r["clients"]}
        mean = sum(r["client_personal"][str(c)]["accuracy"] * sizes[c] for c in r["clients"]) / sum(sizes.values())
        assert r["personal_accuracy"] == pytest.approx(mean)
    last = rows[-1]
    for c in last["clients"]:  # recompute the last round's scores from what the client received and kept
        arrays = dict(sent.payloads[3][c].arrays)
        kept = sent.kept[3].get(c, {}).get("lora_B")
        if name == "fedsa_lora" and kept is not None:
            arrays.update(kept)  # the client's own B, not the server's initial one
        got = rescore(rt, c, {**rt.server.global_state, **arrays})
        assert got["accuracy"] == pytest.approx(last["client_personal"][str(c)]["accuracy"])
        assert got["loss"] == pytest.approx(last["client_personal"][str(c)]["loss"], rel=1e-5)
    if name == "fedsa_lora":  # a returning client's own B differs from the server's: so does its score
        back = [c for c in last["clients"] if sent.kept[3].get(c, {}).get("lora_B") is not None]
        assert back
        c = back[0]
        with_initial_b = rescore(rt, c, {**rt.server.global_state, **sent.payloads[3][c].arrays})
        assert with_initial_b["loss"] != pytest.approx(last["client_personal"][str(c)]["loss"], rel=1e-6)


@pytest.mark.needs_data
@pytest.mark.parametrize("name", sorted(n for n, a in __import__("fedpeft.algorithms", fromlist=["ALGORITHMS"])
                                        .ALGORITHMS.items() if a.options.supports_personalized_eval))
def test_every_algorithm_that_declares_it_reports_personalized_scores(name, tmp_path):
    from golden_runs import GOLDEN

    overrides = GOLDEN.get(f"algorithm-{name}", [f"algorithm.name={name}"])
    cfg = tiny_config(*overrides, "eval.personalized=true", "federation.rounds=1")
    rt = EmbeddedRuntime(cfg, tmp_path / name)
    rt.run()
    row = read_metrics(tmp_path / name)[1]
    assert set(row["client_personal"]) == {str(c) for c in row["clients"]}
    metric = cfg.task_metric()
    assert 0.0 <= row[f"personal_{metric}"] <= 1.0 and row["personal_examples"] > 0


@pytest.mark.needs_data
def test_fedsa_lora_is_judged_by_its_clients_own_models(tmp_path, capsys):
    """FedSA-LoRA's model is each client's own: the personalized score is the run's primary metric (headline,
    best_round, report), no best_adapter is kept, each client's model is saved on request and fedpeft eval says
    which model it scores."""
    from fedpeft.adapters import load_adapter
    from fedpeft.cli import end_of_run_line, main, personal_models_line
    from fedpeft.report.table import report
    from fedpeft.rundir import read_summary

    cfg = tiny_config("algorithm.name=fedsa_lora", "eval.personalized=true", "eval.save_client_adapters=true",
                      "peft.r=4", "federation.rounds=3", "train.lr=0.01")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    rt.run()
    rows, summary = read_metrics(tmp_path / "run"), read_summary(tmp_path / "run")
    personal = {r["round"]: r["personal_accuracy"] for r in rows if "personal_accuracy" in r}
    assert summary["primary_metric"] == "personal_accuracy" and summary["final"] == personal[3]
    assert summary["best"] == max(personal.values()) and personal[summary["best_round"]] == summary["best"]
    assert summary["best_round"] == min(r for r, v in personal.items() if v == summary["best"])  # first of a tie
    assert summary["best_adapter"] is None and not (tmp_path / "run" / "best_adapter").exists()
    assert summary["personal_models"] and "personal_accuracy" in end_of_run_line("run", summary)
    assert personal_models_line(summary, tmp_path / "run") == (
        "model: each client's own, the global part with its own LoRA B (and, under local_head, its task head), so no "
        f"best_adapter; each in {tmp_path / 'run' / 'client_adapters'}/<id> (fedpeft eval {tmp_path / 'run'} --client ID)")
    assert "| personal_accuracy |" in report([tmp_path / "run"])

    trained = {c for r in rows[1:] for c in r["clients"]}
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "client_adapters").iterdir())
    assert saved == list(range(cfg.federation.num_clients))
    c = min(trained)
    own = {**rt.server.global_state, **rt.client_states[c]["lora_B"]}
    params = dict(load_adapter(tmp_path / "run" / "client_adapters" / str(c)).model.named_parameters())
    for name, value in own.items():  # the client's B and head, the global A
        assert np.array_equal(params[name].detach().numpy(), value), name
    assert any(not np.array_equal(own[k], rt.server.global_state[k]) for k in rt.client_states[c]["lora_B"])

    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--client", str(c), "--max-examples", "16"]) == 0
    assert f"model: client {c}'s own model after round 3: the global part with its own LoRA B" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "run"), "--max-examples", "16"]) == 0
    out = capsys.readouterr().out
    assert "model: the global model after round 3 (not the method's model: under fedsa_lora" in out
    assert main(["eval", str(tmp_path / "run"), "--client", "9"]) == 2
    assert "no client_adapters/9; the run saved clients 0..3" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "--client", "0", "--adapter", "last"]) == 2
    assert "--client 0 and --adapter last name two models" in capsys.readouterr().err


@pytest.mark.needs_data
def test_a_personalized_fedavg_run_keeps_the_global_primary_and_reports_the_personal_one(tmp_path, capsys):
    """FedAvg's model is the global one: its primary metric stays the global score, while the personalized score
    is a metric of the report like any other."""
    from fedpeft.cli import main
    from fedpeft.report.table import report
    from fedpeft.rundir import read_summary

    cfg = tiny_config("eval.personalized=true", "federation.rounds=2", "train.lr=0.01")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows, summary = read_metrics(tmp_path / "run"), read_summary(tmp_path / "run")
    assert summary["primary_metric"] == "accuracy" and summary["best_adapter"] == "best_adapter"
    assert summary["personal_models"] is None and summary["client_adapters"] is None
    table = report([tmp_path / "run"], metric="personal_accuracy")
    assert f"| personal_accuracy | - | {rows[-1]['personal_accuracy']:.4f} |" in table
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--max-examples", "16"]) == 0
    best = summary["best_round"]
    assert f"model: the global model of round {best}, the best by eval_accuracy\n" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "run"), "--client", "0"]) == 2
    assert "under fedavg every client's model is the global one: drop --client" in capsys.readouterr().err


def test_client_adapters_are_refused_where_every_client_has_the_global_model():
    with pytest.raises(ConfigError, match="eval.save_client_adapters: under algorithm fedavg every client's model is "
                                          "the global one"):
        tiny_config("eval.personalized=true", "eval.save_client_adapters=true")
    with pytest.raises(ConfigError, match="set eval.personalized: true to score the clients' own models"):
        tiny_config("algorithm.name=fedsa_lora", "peft.r=4")
    with pytest.raises(ConfigError, match="clients' own parts live in the SuperNodes"):
        tiny_config("algorithm.name=fedsa_lora", "peft.r=4", "eval.personalized=true",
                    "eval.save_client_adapters=true", "runtime.name=flower", "runtime.flower.num_supernodes=4")


def test_saving_client_adapters_needs_a_client_half_that_assembles_them(monkeypatch, tmp_path):
    from fedpeft.errors import UserError
    from fedpeft.runtime import embedded

    class Forgot(fedpeft.ClientAlgorithm):
        def fit(self, payload, ctx):
            return payload

    # (the check reads the algorithm's own client half, below any wrapper)
    monkeypatch.setattr(embedded.algorithms, "registered_algorithm",
                        lambda name: types.SimpleNamespace(client=lambda options: Forgot()))
    cfg = tiny_config("algorithm.name=fedsa_lora", "peft.r=4", "eval.personalized=true",
                      "eval.save_client_adapters=true")
    with pytest.raises(UserError, match=r"client half \(Forgot\) does not override ClientAlgorithm.personal_state"):
        EmbeddedRuntime(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything loads or is written
