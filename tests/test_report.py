"""`fedpeft report` on hand-made run directories, and strict JSON in metrics.jsonl / summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedpeft.cli import main
from fedpeft.config import dump_config, load_config
from fedpeft.metrics.accounting import summarize
from fedpeft.report import plots
from fedpeft.rundir import RunWriter, read_metrics
from fedpeft.runlock import RunLock

CFG = ["task.dataset=sst2", "model.name=tiny-bert"]


def make_rows(acc=(0.5, 0.6, 0.8, 0.7), loss=(0.6931, 0.6, 0.4, 0.45), train=(0.65, 0.41, 0.43)) -> list[dict]:
    rows = [{"round": 0, "eval_loss": loss[0], "eval_accuracy": acc[0], "eval_samples": 32, "time_evaluation_s": 0.1,
             "wall_s": 0.1, "cum_bytes": 0, "cum_bytes_up": 0, "cum_bytes_down": 0}]
    up = down = 0
    for rnd in (1, 2, 3):
        up, down = up + 100 * 2**20, down + 300 * 2**20
        rows.append({
            "round": rnd, "clients": [0], "train_loss": train[rnd - 1], "client_train_loss": {"0": train[rnd - 1]},
            "client_num_examples": {"0": 16}, "bytes_down": {"0": 300 * 2**20}, "bytes_up": {"0": 100 * 2**20},
            "bytes_down_total": 300 * 2**20, "bytes_up_total": 100 * 2**20, "cum_bytes_up": up,
            "cum_bytes_down": down, "cum_bytes": up + down, "flops": None, "ops_analytic": 0.0, "rejected": {},
            "eval_loss": loss[rnd], "eval_accuracy": acc[rnd], "eval_samples": 32, "time_client_s": 0.5,
            "time_aggregation_s": 0.01, "time_evaluation_s": 0.1, "time_overhead_s": 0.0, "time_round_s": 0.61,
            "wall_s": 0.1 + 0.61 * rnd,
        })
    return rows


def make_run(path: Path, rows: list[dict] | None = None, summary: bool = True, overrides=()) -> Path:
    """A run directory as a finished (or, without summary.json, unfinished) run leaves it."""
    path.mkdir(parents=True)
    cfg = load_config(None, [*CFG, *overrides])
    (path / "config.yaml").write_text(dump_config(cfg))
    rows = make_rows() if rows is None else rows
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        s = summarize(rows, metric=cfg.primary_metric(), target=0.75)
        s.update({"dataset": "sst2", "model": "tiny-bert", "peft_method": cfg.peft.method,
                  "algorithm": cfg.algorithm.name, "trainable_parameters": 1234})
        (path / "summary.json").write_text(json.dumps(s))
    return path


def strict(text: str):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def table_row(out: str, run: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"| {run} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def header(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("| run |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_paths_without_a_run_are_skipped_and_listed_and_none_at_all_is_an_error(tmp_path, capsys):
    make_run(tmp_path / "runs" / "a")
    make_run(tmp_path / "runs" / "b")
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("not a run")
    assert main(["report", *sorted(str(p) for p in (tmp_path / "runs").iterdir())]) == 0
    out = capsys.readouterr().out
    assert table_row(out, "a") and table_row(out, "b")
    skipped = next(x for x in out.splitlines() if x.startswith("skipped (no run): "))
    assert "empty" in skipped and "notes.txt" in skipped and "/a" not in skipped

    assert main(["report", str(tmp_path / "runs" / "empty"), str(tmp_path / "runs" / "notes.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no run directory") and "empty" in err and len(err.splitlines()) == 1


def test_an_unknown_metric_is_refused_with_the_metrics_the_runs_have(tmp_path, capsys):
    make_run(tmp_path / "a")
    assert main(["report", str(tmp_path / "a"), "--metric", "f1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'f1'" in err
    assert err.endswith("choose from accuracy, loss, train_loss")  # eval_samples is a count, not a metric


def test_the_metric_drives_the_table_and_a_loss_is_best_lowest(tmp_path, capsys):
    make_run(tmp_path / "a")
    columns = ["metric", "initial", "final", "best", "rounds to target"]

    assert main(["report", str(tmp_path / "a")]) == 0  # the primary metric, from summary.json
    out = capsys.readouterr().out
    pick = [header(out).index(c) for c in columns]
    assert [table_row(out, "a")[i] for i in pick] == ["accuracy", "0.5000", "0.7000", "0.8000", "2"]

    assert main(["report", str(tmp_path / "a"), "--metric", "loss"]) == 0
    out = capsys.readouterr().out
    assert [table_row(out, "a")[i] for i in pick] == ["loss", "0.6931", "0.4500", "0.4000", "-"]
    assert out.startswith("metric: loss")

    assert main(["report", str(tmp_path / "a"), "--metric", "train_loss"]) == 0
    out = capsys.readouterr().out
    assert [table_row(out, "a")[i] for i in pick] == ["train_loss", "-", "0.4300", "0.4100", "-"]


def test_an_unfinished_run_is_reported_from_its_rows_and_marked(tmp_path, capsys):
    make_run(tmp_path / "killed", summary=False, overrides=["federation.rounds=10"])  # no summary.json
    assert main(["report", str(tmp_path / "killed")]) == 0
    out = capsys.readouterr().out
    row = dict(zip(header(out), table_row(out, "killed (incomplete: 3 of 10 rounds, no summary)")))
    assert (row["initial"], row["final"], row["best"], row["rounds"]) == ("0.5000", "0.7000", "0.8000", "3")
    assert (row["total MiB"], row["MiB up / client / round"]) == ("1,200.0", "100.0")


def test_a_stale_owner_file_does_not_make_a_run_running(tmp_path, capsys):
    """A SIGKILLed writer leaves its owner file; the lock went with the process (here: the owner names this very
    process, alive, as a reused process id would)."""
    run = make_run(tmp_path / "dead", summary=False, overrides=["federation.rounds=10"])
    RunLock.acquire(run)._lock.release()  # the lock file exists, free; the owner file stays
    assert (run / ".fedpeft.owner.json").is_file()
    assert main(["report", str(run)]) == 0
    assert "| dead (incomplete: 3 of 10 rounds, no summary) |" in capsys.readouterr().out


def test_a_run_whose_writer_is_alive_is_marked_running(tmp_path, capsys):
    run = make_run(tmp_path / "live", summary=False, overrides=["federation.rounds=10"])
    lock = RunLock.acquire(run)  # this process writes it
    try:
        assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    finally:
        lock.release()
    assert "| live (running, 3 of 10 rounds) |" in capsys.readouterr().out


def test_runs_that_overlap_stay_visible_and_say_so(tmp_path, capsys):
    same = [make_run(tmp_path / name) for name in ("a", "b", "c")]  # identical curves
    other = make_run(tmp_path / "d", rows=make_rows(acc=(0.5, 0.55, 0.6, 0.65)))
    drawn = []
    real = plots.plt.Axes.plot

    def spy(ax, *args, **kwargs):
        drawn.append(kwargs)
        return real(ax, *args, **kwargs)

    plots.plt.Axes.plot = spy
    try:
        assert main(["report", *map(str, [*same, other]), "--out", str(tmp_path / "out")]) == 0
    finally:
        plots.plt.Axes.plot = real
    first = drawn[:4]  # accuracy against rounds
    assert [k["label"] for k in first] == ["a", "b (overlaps a)", "c (overlaps a)", "d"]
    widths = [k["linewidth"] for k in first]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]  # the later drawn thinner, on top
    assert len({k["marker"] for k in first}) == 4


def test_runs_of_different_datasets_or_tasks_are_plotted_apart(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", overrides=["task.dataset=ag_news"])
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "plotted apart" in out and "sst2-classification: a" in out and "ag_news-classification: b" in out
    assert (tmp_path / "out" / "sst2-classification-accuracy_vs_round.png").is_file()
    assert (tmp_path / "out" / "ag_news-classification-accuracy_vs_round.png").is_file()
    assert not (tmp_path / "out" / "accuracy_vs_round.png").exists()


def test_a_personalized_final_score_shows_its_sample(tmp_path, capsys):
    rows = make_rows()
    for r in rows:
        r["personal_accuracy"], r["personal_examples"] = r["eval_accuracy"], 30
        r["client_personal"] = {"0": {}, "1": {}, "2": {}}
    run = make_run(tmp_path / "fedsa", rows=rows, overrides=["algorithm.name=fedsa_lora", "eval.personalized=true"])
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    row = dict(zip(header(out), table_row(out, "fedsa")))
    assert row["final scored on"] == "30 rows of 3 clients, 95% 0.52-0.83"


def test_the_table_names_dataset_model_method_and_algorithm(tmp_path, capsys):
    make_run(tmp_path / "a")
    make_run(tmp_path / "b", overrides=["task.dataset=mrpc", "peft={method: ia3}", "algorithm.name=fedprox"])
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    head = header(out)
    assert head[:4] == ["run", "model", "method", "algorithm"] and "dataset" in head
    pick = [head.index(c) for c in ("run", "model", "method", "algorithm", "dataset")]
    assert [table_row(out, "a")[i] for i in pick] == ["a", "tiny-bert", "lora r16", "fedavg", "sst2"]
    assert [table_row(out, "b")[i] for i in pick] == ["b", "tiny-bert", "ia3", "fedprox", "mrpc"]


def test_the_settings_that_tell_runs_apart_get_a_column_each_and_only_those(tmp_path, capsys):
    """Robust rule, attackers, quantization, personalization, partition, rank, lr, seed and the algorithm's own
    options, from each run's config; a setting all runs share gets no column."""
    make_run(tmp_path / "plain")
    make_run(tmp_path / "krum", overrides=["algorithm.robust={rule: krum, num_attackers: 1}", "federation.clients_per_round=5",
                                           "federation.min_replies=5",
                                           "federation.attackers={fraction: 0.25, attack: sign_flip}"])
    make_run(tmp_path / "skewed", overrides=["federation.partition={scheme: dirichlet_label, alpha: 0.3}",
                                             "peft.r=4", "eval.personalized=true", "train.lr=0.01", "seed=3"])
    assert main(["report", *(str(tmp_path / n) for n in ("plain", "krum", "skewed"))]) == 0
    out = capsys.readouterr().out
    head = header(out)
    assert head[:9] == ["run", "model", "method", "algorithm", "robust rule", "attackers", "personalized eval",
                        "partition", "lr"] and head[9] == "seed"
    assert "quantization" not in head and "algorithm options" not in head  # the same in every run
    assert table_row(out, "plain")[2:10] == ["lora r16", "fedavg", "-", "-", "no", "iid", "0.0005", "0"]
    assert table_row(out, "krum")[4:6] == ["krum (num_attackers=1)", "sign_flip 25%"]
    assert table_row(out, "skewed")[2:10] == ["lora r4", "fedavg", "-", "-", "yes", "dirichlet_label (alpha=0.3)",
                                              "0.01", "3"]

    make_run(tmp_path / "pruned", overrides=["algorithm.name=headprune", "algorithm.sparsity=0.5"])
    make_run(tmp_path / "b1", overrides=["algorithm.name=headprune", "algorithm.pruning=none",
                                         "algorithm.aggregation=fedavg"])
    make_run(tmp_path / "q8", overrides=["model.quantization={bits: 8}"])
    assert main(["report", *(str(tmp_path / n) for n in ("pruned", "b1", "q8"))]) == 0
    out = capsys.readouterr().out
    row = dict(zip(header(out), table_row(out, "pruned")))
    assert row["algorithm options"] == "aggregation=importance, pruning=importance, sparsity=0.5"
    assert dict(zip(header(out), table_row(out, "b1")))["algorithm options"] == ("aggregation=fedavg, pruning=none, "
                                                                                "sparsity=0.9")
    assert dict(zip(header(out), table_row(out, "q8")))["quantization"] == "8-bit" and row["quantization"] == "-"


def test_plots_of_many_runs_give_each_a_style_and_draw_a_metric_only_for_runs_having_it(tmp_path, capsys):
    runs = [make_run(tmp_path / f"run{i:02d}", rows=make_rows(acc=(0.5, 0.6, 0.7, 0.5 + i / 100)))
            for i in range(22)]
    rouge = make_rows()
    for r in rouge:
        r["eval_rougeL"] = r.pop("eval_accuracy")
    runs.append(make_run(tmp_path / "gen", rows=rouge, overrides=["task.metric=rougeL"]))
    drawn = {}  # axes -> the lines drawn on them (label, colour, dashes, marker)
    real = plots.plt.Axes.plot

    def spy(ax, *args, **kwargs):
        drawn.setdefault(id(ax), []).append((kwargs["label"], kwargs["color"], kwargs["linestyle"], kwargs["marker"]))
        return real(ax, *args, **kwargs)

    plots.plt.Axes.plot = spy
    try:
        assert main(["report", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    finally:
        plots.plt.Axes.plot = real
    assert (tmp_path / "out" / "accuracy_vs_round.png").is_file() and (tmp_path / "out" / "rougeL_vs_round.png").is_file()
    figures = list(drawn.values())
    assert len(figures) == 6  # accuracy and rougeL, each against rounds, MiB and upload MiB
    for lines in figures:
        assert len({tuple(style) for _, *style in lines}) == len(lines)  # each run a style of its own
    labels = sorted(sorted(label for label, *_ in lines) for lines in figures)
    assert labels == [["gen"]] * 3 + [[f"run{i:02d}" for i in range(22)]] * 3  # a metric only for runs having it
    with Image.open(tmp_path / "out" / "accuracy_vs_round.png") as image:
        assert image.size[0] > 6 * 120  # wider than a plot without a legend: the legend sits beside the axes


def test_plots_are_titled_and_include_the_upload_axis(tmp_path, capsys):
    make_run(tmp_path / "a")
    make_run(tmp_path / "b", rows=make_rows(acc=(0.5, 0.55, 0.6, 0.65)))
    out_dir = tmp_path / "rep"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out_dir), "--metric", "loss"]) == 0
    names = sorted(p.name for p in out_dir.glob("*.png"))
    assert names == ["loss_vs_mb.png", "loss_vs_round.png", "loss_vs_upload_mb.png"]
    titles = {p.name: Image.open(p).text["Title"] for p in out_dir.glob("*.png")}
    assert titles["loss_vs_upload_mb.png"] == "loss vs upload (sst2, tiny-bert)"
    assert titles["loss_vs_round.png"] == "loss vs round (sst2, tiny-bert)"

    # the upload axis counts the upload only: 100 MiB a round here, against 400 MiB up + down
    rows = make_rows()
    assert plots.series(rows, "accuracy", "cum_bytes_up")[0] == [0, 100 * 2**20, 200 * 2**20, 300 * 2**20]
    assert plots.series(rows, "train_loss", "cum_bytes")[0] == [400 * 2**20, 800 * 2**20, 1200 * 2**20]
    curves = plots.plot_curves({"a": rows}, "train_loss", tmp_path / "direct")
    assert [p.title for p in curves] == ["train_loss vs round", "train_loss vs communication", "train_loss vs upload"]


def test_a_run_plots_its_metric_and_training_loss_against_rounds_traffic_and_upload(tmp_path):
    run = make_run(tmp_path / "a")
    written = plots.plot_run(run, read_metrics(run), "accuracy")
    assert sorted(p.path.name for p in written) == sorted(p.name for p in (run / "plots").glob("*.png")) == [
        "accuracy_vs_mb.png", "accuracy_vs_round.png", "accuracy_vs_upload_mb.png",
        "train_loss_vs_mb.png", "train_loss_vs_round.png", "train_loss_vs_upload_mb.png"]
    assert all(p.title.endswith("(sst2, tiny-bert)") for p in written)


def test_metrics_and_summary_hold_only_json_numbers_or_null(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    writer = RunWriter(run, load_config(None, CFG))
    row = {"round": 1, "train_loss": float("nan"), "eval_loss": float("inf"), "eval_accuracy": np.float32(0.5),
           "agg_norm": np.float32("inf"), "agg_mean": np.float64("-inf"), "count": np.int64(3),
           "client_train_loss": {"0": float("nan"), "1": 0.25}, "scores": [float("-inf"), 1.0, {"x": float("nan")}]}
    writer.row(row)
    writer.row({"round": 2, "eval_loss": 0.5})
    writer.summary({"final": float("nan"), "best": 0.5, "final_eval": {"eval_loss": float("inf")}})
    writer.close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    first = strict(lines[0])
    assert strict(lines[1]) == {"round": 2, "eval_loss": 0.5}
    assert first == {"round": 1, "train_loss": None, "eval_loss": None, "eval_accuracy": 0.5, "agg_norm": None,
                     "agg_mean": None, "count": 3, "client_train_loss": {"0": None, "1": 0.25},
                     "scores": [None, 1.0, {"x": None}]}
    assert np.isnan(row["train_loss"])  # the row in memory is left as it was
    assert strict((run / "summary.json").read_text()) == {"final": None, "best": 0.5, "final_eval": {"eval_loss": None}}
    assert read_metrics(run)[0] == first


def test_old_files_with_nan_tokens_are_read_and_summarized(tmp_path, capsys):
    rows = make_rows()
    rows[2]["eval_accuracy"] = float("nan")  # the best round diverged ...
    rows[3]["eval_accuracy"] = float("nan")  # ... and so did the last
    rows[3]["train_loss"] = float("inf")
    run = make_run(tmp_path / "old", rows=rows, summary=False)  # json.dumps writes NaN / Infinity tokens
    assert "NaN" in (run / "metrics.jsonl").read_text()
    back = read_metrics(run)
    assert back[2]["eval_accuracy"] is None and back[3]["train_loss"] is None and back[1]["eval_accuracy"] == 0.6
    s = summarize(back, metric="accuracy", target=0.55)
    assert (s["initial"], s["final"], s["best"], s["best_round"], s["rounds_to_target"]) == (0.5, None, 0.6, 1, 1)
    assert summarize(back, metric="accuracy", target=None) == summarize(rows, metric="accuracy", target=None) | {
        "final": None, "final_eval": {"eval_loss": 0.45, "eval_accuracy": None, "eval_samples": 32}}
    assert main(["report", str(run), "--metric", "train_loss", "--out", str(tmp_path / "rep")]) == 0
    row = table_row(capsys.readouterr().out, "old (incomplete: all 3 rounds, no summary)")
    assert row[row.index("train_loss") + 1:row.index("train_loss") + 4] == ["-", "-", "0.4100"]


@pytest.mark.parametrize("metric, index, value", [("loss", 0, float("nan")), ("accuracy", 1, float("inf"))])
def test_summarize_never_picks_a_non_finite_best(metric, index, value):
    rows = make_rows()
    rows[index][f"eval_{metric}"] = value
    s = summarize(rows, metric=metric, target=None)
    assert (s["best"], s["best_round"]) == ({"loss": 0.4, "accuracy": 0.8}[metric], 2)


def test_settings_read_older_or_partial_configs_and_show_null_as_a_dash():
    from fedpeft.report.table import differing_options, settings

    assert settings({}) == {"robust": "-", "attack": "-", "quantization": "-", "personalized": "no",
                            "partition": "iid", "lr": "-", "seed": "-", "system": "ideal"}
    assert settings({"federation": {"partition": None}, "train": {"lr": None}, "seed": None})["lr"] == "-"
    configs = [{"peft": {"method": "lora", "r": 8, "alpha": 16}}, {"peft": {"method": "lora", "r": 4, "alpha": 32}},
               {"peft": {"method": "ia3"}}, {"algorithm": {"name": "fedavg", "dp": {"clip": 1.0, "target": None}}},
               {"algorithm": {"name": "fedavg"}}]
    assert differing_options(configs[:3], "peft", "method", ("r",)) == ["alpha=16", "alpha=32", "-"]
    assert differing_options(configs[3:], "algorithm", "name", ()) == ["dp={clip: 1.0, target: -}", "dp=-"]


def test_a_metric_no_run_has_draws_no_plot(tmp_path):
    assert plots.plot_curves({"a": make_rows()}, "rougeL", tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_the_default_plots_draw_each_run_under_its_own_primary_metric(tmp_path, capsys):
    """A personal-models run (FedSA-LoRA) also records the global eval_accuracy, which is not its score: it is drawn
    under personal_accuracy only."""
    rows = make_rows()
    for r in rows[1:]:
        r["personal_accuracy"] = r["eval_accuracy"] + 0.1
    make_run(tmp_path / "global")
    personal = make_run(tmp_path / "personal", rows=rows, overrides=["algorithm.name=fedsa_lora",
                                                                      "eval.personalized=true"])
    summary = json.loads((personal / "summary.json").read_text())
    assert summary["primary_metric"] == "personal_accuracy"
    titles = []
    real = plots.plt.Axes.plot

    def spy(ax, *args, **kwargs):
        titles.append(kwargs["label"])
        return real(ax, *args, **kwargs)

    plots.plt.Axes.plot = spy
    try:
        assert main(["report", str(tmp_path / "global"), str(personal), "--out", str(tmp_path / "out")]) == 0
    finally:
        plots.plt.Axes.plot = real
    assert sorted(p.name for p in (tmp_path / "out").glob("*_vs_round.png")) == ["accuracy_vs_round.png",
                                                                                 "personal_accuracy_vs_round.png"]
    assert titles == ["global"] * 3 + ["personal"] * 3  # accuracy: the global run only; personal_accuracy: its own
    out = capsys.readouterr().out
    assert table_row(out, "personal")[header(out).index("metric")] == "personal_accuracy"


def test_simulated_time_gets_a_column_a_plot_and_the_system_a_setting(tmp_path, capsys):
    def timed(rows, per_round):
        clock = 0.0
        for row in rows:
            if row["round"]:
                clock += per_round
            row["sim_time_s"] = clock
        return rows

    make_run(tmp_path / "ideal", rows=timed(make_rows(), 0.5))
    make_run(tmp_path / "phones", rows=timed(make_rows(acc=(0.5, 0.55, 0.6, 0.65)), 4000.0),
             overrides=["system.profile=mobile", "system.deadline_s=600", "system.over_selection=0.3"])
    make_run(tmp_path / "older")  # from before the clock: no sim_time_s, no system section
    assert main(["report", *(str(tmp_path / n) for n in ("ideal", "phones", "older")), "--out",
                 str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert dict(zip(header(out), table_row(out, "phones")))["system"] == "mobile, deadline 600.0 s, over-selection 30%"
    assert dict(zip(header(out), table_row(out, "phones")))["simulated s"] == "12,000.0"
    assert dict(zip(header(out), table_row(out, "ideal")))["simulated s"] == "1.5000"
    assert dict(zip(header(out), table_row(out, "older")))["simulated s"] == "-"
    assert dict(zip(header(out), table_row(out, "older")))["system"] == "ideal"
    with Image.open(tmp_path / "out" / "accuracy_vs_sim_time.png") as image:
        assert image.info["Title"].startswith("accuracy vs simulated time")
    older = plots.plot_run(tmp_path / "older", read_metrics(tmp_path / "older"), "accuracy")
    assert not any("sim_time" in p.path.name for p in older)  # nothing to draw against
