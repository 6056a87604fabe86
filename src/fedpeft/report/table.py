"""Side-by-side markdown table of several runs, from their run directories, and their comparison plots."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedpeft.config import ConfigError, validate_config
from fedpeft.config.schema import options_for
from fedpeft.metrics.accounting import better_or_equal, summarize
from fedpeft.report.plots import finite, metric_key, plot_curves
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runlock import writer_alive

COLUMNS = (
    ("run", "run"),
    ("model", "model"),
    ("peft", "method"),
    ("algorithm", "algorithm"),
    ("dataset", "dataset"),
    ("clients", "N/K"),
    ("rounds", "rounds"),
    ("metric", "metric"),
    ("initial", "initial"),
    ("final", "final"),
    ("best", "best"),
    ("rounds_to_target", "rounds to target"),
    ("up_mib", "MiB up / client / round"),
    ("total_mib", "total MiB"),
    ("trainable", "trainable params"),
    ("wall_s", "wall s"),
    ("sim_s", "simulated s"),
)
# the settings that tell runs apart, read from each run's config.yaml; a column appears only where the runs differ,
# after the algorithm column
SETTINGS = (
    ("options", "algorithm options"),
    ("peft_options", "PEFT options"),
    ("train_options", "training options"),
    ("robust", "robust rule"),
    ("attack", "attackers"),
    ("quantization", "quantization"),
    ("personalized", "personalized eval"),
    ("partition", "partition"),
    ("system", "system"),
    ("lr", "lr"),
    ("seed", "seed"),
)
NOT_METRICS = {"samples"}  # eval_samples counts the evaluation examples


@dataclass
class Run:
    path: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any]  # summary.json; computed from the rows while the run has none (unfinished)
    config: dict[str, Any]  # config.yaml as written, not validated (an older run's may not validate today)
    primary_metric: str
    state: str | None = None  # None for a finished run (it has summary.json); else "running, ..." or "incomplete: ..."


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def load_run(run_dir: Path) -> Run:
    """A run directory's rows, summary and config; FileNotFoundError without metrics.jsonl, ValueError (or
    yaml.YAMLError) if a file is damaged."""
    rows = read_metrics(run_dir)
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else None
    summary = read_summary(run_dir)
    metric = summary.get("primary_metric")
    config = config if isinstance(config, dict) else {}
    if not metric:
        metric = primary_metric_of(config, path.parent)
    state = None
    if not summary:
        summary = summarize(rows, metric=metric, target=None)
        state = unfinished_state(run_dir, rows, config)
    return Run(run_dir, rows, summary, config, metric, state)


def unfinished_state(run_dir: Path, rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> str:
    """What a run without summary.json is: still running (a live process holds it), or stopped before its end
    (killed, crashed or interrupted: ``fedpeft run --resume`` continues it)."""
    done = max((r.get("round", 0) for r in rows), default=0)
    planned = _section_of(config, "federation").get("rounds")
    if isinstance(planned, int) and done >= planned:
        of = f"all {done} rounds"  # (killed while it wrote its last files)
    else:
        of = f"{done} of {planned} rounds" if isinstance(planned, int) else f"{done} rounds"
    return f"running, {of}" if writer_alive(run_dir) else f"incomplete: {of}, no summary"


def primary_metric_of(config: dict[str, Any], base_dir: Path) -> str:
    """The primary metric of a run's saved config, read without importing the plugins it names (a run directory is
    data): a method only a plugin registers leaves the task's metric (without ``personal_``, which only the method
    could say); a config that does not validate at all, accuracy."""
    try:
        return validate_config(config, base_dir, quiet=True).primary_metric()
    except ConfigError:
        pass
    try:
        methods_left_out = {k: v for k, v in config.items() if k not in ("algorithm", "peft")}
        return validate_config(methods_left_out, base_dir, quiet=True).task_metric()
    except ConfigError:
        return "accuracy"


def available_metrics(rows: Sequence[dict[str, Any]]) -> set[str]:
    """The metrics a run's rows hold: its evaluation metrics of the global model (without ``eval_``), of the
    clients' personalized models (``personal_<name>``, eval.personalized) and ``train_loss``."""
    names = {k[len("eval_"):] for r in rows for k in r if k.startswith("eval_")} - NOT_METRICS
    names |= {k for r in rows for k in r if k.startswith("personal_")} - {"personal_examples"}
    return names | ({"train_loss"} if any("train_loss" in r for r in rows) else set())


def metric_values(rows: Sequence[dict[str, Any]], metric: str) -> dict[str, Any]:
    """initial (round 0), final and best value of ``metric`` (a loss is best lowest); null / NaN values
    are never the best."""
    key = metric_key(metric)
    having = [r for r in rows if key in r]
    best = None
    for value in (r[key] for r in having if finite(r[key])):
        if best is None or not better_or_equal(metric, best, value):
            best = value
    return {
        "initial": having[0][key] if having and having[0].get("round") == 0 else None,
        "final": having[-1][key] if having else None,
        "best": best,
    }


def _section_of(cfg: dict[str, Any], *path: str) -> dict[str, Any]:
    for key in path:
        cfg = cfg.get(key) if isinstance(cfg, dict) else None  # type: ignore[assignment]
    return cfg if isinstance(cfg, dict) else {}


def _value(v: Any) -> str:
    """A config value in a table cell: null as '-', a nested section compactly."""
    if v is None:
        return "-"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _params(values: dict[str, Any], skip: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in values.items() if k not in skip and v is not None)


def _peft_label(cfg: dict[str, Any], summary: dict[str, Any]) -> Any:
    """The method's name, with the options its options model shows in a label (``label_options``: LoRA's rank,
    "lora r16"); a method not registered in this process (a plugin's: reports import none) shows its name."""
    peft = _section_of(cfg, "peft")
    method = peft.get("method") or summary.get("peft_method")
    try:
        shown = options_for("peft", str(method)).label_options
    except ValueError:
        shown = ()
    parts = [f"{key}{peft[key]}" for key in shown if peft.get(key) is not None]
    return " ".join([str(method), *parts]) if parts else method


def settings(cfg: dict[str, Any]) -> dict[str, str]:
    """The settings of a run (config.yaml as written) that the report can tell runs apart by, in words."""
    robust = _section_of(cfg, "algorithm", "robust")
    attackers = _section_of(cfg, "federation", "attackers")
    quant = _section_of(cfg, "model", "quantization")
    part = _section_of(cfg, "federation", "partition")
    scheme = part.get("scheme", "iid")
    part_args = {"alpha": part.get("alpha")} if str(scheme).startswith("dirichlet") else {}
    if scheme in ("column", "dirichlet_column"):
        part_args["column"] = part.get("column")
    if part.get("size_alpha") is not None:
        part_args["size_alpha"] = part["size_alpha"]
    attack = (f"{attackers.get('attack')} {float(attackers.get('fraction', 0)):.0%}"
              + (f" ({_params(attackers, ('attack', 'fraction'))})" if _params(attackers, ('attack', 'fraction'))
                 else "")) if attackers else "-"
    return {
        "robust": (f"{robust.get('rule')}" + (f" ({_params(robust, ('rule',))})" if _params(robust, ("rule",)) else "")
                   if robust else "-"),
        "attack": attack,
        "quantization": (f"{quant.get('bits')}-bit" + (f" {quant.get('quant_type')}" if quant.get("bits") == 4 else "")
                         if quant else "-"),
        "personalized": "yes" if _section_of(cfg, "eval").get("personalized") else "no",
        "partition": _value(scheme) + (f" ({_params(part_args, ())})" if part_args else ""),
        "lr": _value(_section_of(cfg, "train").get("lr")),
        "seed": _value(cfg.get("seed")),
        "system": system_label(_section_of(cfg, "system")),
    }


def system_label(system: dict[str, Any]) -> str:
    """The simulated devices in words: "mobile, deadline 600 s, over-selection 30%" ("ideal" for an older run)."""
    trace = system.get("trace")
    label = f"trace {Path(str(trace)).name}" if trace else _value(system.get("profile") or "ideal")
    if system.get("deadline_s") is not None:
        label += f", deadline {_value(system['deadline_s'])} s"
    if system.get("over_selection"):
        label += f", over-selection {float(system['over_selection']):.0%}"
    return label


def differing_options(configs: Sequence[dict[str, Any]], section: str, tag: str | None,
                      skip: tuple[str, ...]) -> list[str]:
    """Per run, the options of ``section`` whose values differ between the runs of the same method (``tag``
    names it: the algorithm's name, the PEFT method; other methods have other options), e.g. "sparsity=0.9,
    selection=loss"; a key one of those runs lacks (an older config) counts as differing."""
    sections = [_section_of(c, section) for c in configs]
    differing: dict[Any, list[str]] = {}
    for name in {s.get(tag) if tag else None for s in sections}:
        same = [s for s in sections if (s.get(tag) if tag else None) == name]
        keys = sorted({k for s in same for k in s} - {tag, *skip})
        differing[name] = [k for k in keys if len({repr(s.get(k)) for s in same}) > 1]
    return [", ".join(f"{k}={_value(s.get(k))}" for k in differing[s.get(tag) if tag else None]) or "-"
            for s in sections]


def run_record(run: Run, metric: str | None = None) -> dict[str, Any]:
    """One table row; ``metric`` (default: the run's primary metric) fills initial / final / best."""
    summary, cfg = run.summary, run.config
    metric = metric or run.primary_metric
    primary = metric == run.primary_metric and "final" in summary
    values = {k: summary.get(k) for k in ("initial", "final", "best")} if primary else metric_values(run.rows, metric)
    fed = cfg.get("federation") if isinstance(cfg.get("federation"), dict) else {}
    up = summary.get("mean_bytes_up_per_client_round")
    total = summary.get("total_bytes")
    return {
        "run": run.path.name + (f" ({run.state})" if run.state else ""),
        "model": _section_of(cfg, "model").get("name") or summary.get("model"),
        "peft": _peft_label(cfg, summary),
        "algorithm": _section_of(cfg, "algorithm").get("name") or summary.get("algorithm"),
        **settings(cfg),
        "dataset": _section_of(cfg, "task").get("dataset") or summary.get("dataset"),
        "clients": f"{fed.get('num_clients', summary.get('num_clients'))}/"
                   f"{fed.get('clients_per_round', summary.get('clients_per_round'))}",
        "rounds": summary.get("rounds"),
        "metric": metric,
        **values,
        "final_sample": final_sample(summary) if primary else None,
        "rounds_to_target": summary.get("rounds_to_target") if metric == run.primary_metric else None,
        "up_mib": up / 2**20 if finite(up) else None,
        "total_mib": total / 2**20 if finite(total) else None,
        "trainable": summary.get("trainable_parameters"),
        "wall_s": summary.get("wall_s"),
        "sim_s": summary.get("sim_time_s"),
    }


def final_sample(summary: dict[str, Any]) -> str | None:
    """The rows (and clients) a personalized final score stands on, with accuracy's 95% interval."""
    if not summary.get("final_rows"):
        return None
    interval = summary.get("final_interval")
    return (f"{summary['final_rows']} rows of {summary.get('final_clients')} clients"
            + (f", 95% {interval[0]:.2f}-{interval[1]:.2f}" if interval else ""))


def columns(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The table's columns: the fixed ones, with the settings in which the runs differ after the algorithm (and
    the sample of a personalized final score after it, where a run has one)."""
    differing = [(k, label) for k, label in SETTINGS if len({r.get(k) for r in records}) > 1]
    at = [k for k, _ in COLUMNS].index("algorithm") + 1
    cols = [*COLUMNS[:at], *differing, *COLUMNS[at:]]
    if any(r.get("final_sample") for r in records):
        final = [k for k, _ in cols].index("final") + 1
        cols.insert(final, ("final_sample", "final scored on"))
    return cols


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    metrics = sorted({r["metric"] for r in records})
    cols = columns(records)
    head = [label for _, label in cols]
    lines = [f"metric: {', '.join(metrics)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        lines.append("| " + " | ".join(_fmt(r.get(key)) for key, _ in cols) + " |")
    return "\n".join(lines)


def _labels(paths: Sequence[Path]) -> list[str]:
    """Plot legend labels: the directory names, or the paths where two runs share a name."""
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def _common(records: Sequence[dict[str, Any]], key: str) -> str | None:
    values = {r[key] for r in records}
    return str(values.pop()) if len(values) == 1 and None not in values else None


def report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None, metric: str | None = None) -> str:
    """The markdown table of the runs among ``run_dirs`` (paths without a run are skipped and listed under
    it); with ``out_dir``, also report.md and the plots of ``metric`` there. FileNotFoundError if no path
    holds a run, ConfigError if ``metric`` is in none of the runs."""
    runs, skipped, damaged = [], [], []
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").is_file():
            skipped.append(str(d))
            continue
        try:
            runs.append(load_run(d))
        except (ValueError, yaml.YAMLError) as exc:
            damaged.append(f"{d} ({str(exc).splitlines()[0]})")
    if not runs:
        raise FileNotFoundError(f"no run directory (with a metrics.jsonl) among {', '.join(map(str, run_dirs))}"
                                + (f"; unreadable: {', '.join(damaged)}" if damaged else ""))
    if metric is not None:
        known = set().union(*(available_metrics(r.rows) for r in runs))
        if metric not in known:
            raise ConfigError(f"--metric {metric!r}: the runs have no such metric; choose from "
                              f"{', '.join(sorted(known))}")
    records = [run_record(r, metric) for r in runs]
    configs = [r.config for r in runs]
    for key, section, tag, skip in (("options", "algorithm", "name", ("robust",)),
                                    ("peft_options", "peft", "method", ("r",)),  # the rank is in the method column
                                    ("train_options", "train", None, ("lr",))):
        for record, options in zip(records, differing_options(configs, section, tag, skip)):
            record[key] = options
    text = markdown_table(records)
    if skipped:
        text += f"\n\nskipped (no run): {', '.join(skipped)}"
    if damaged:
        text += f"\n\nskipped (unreadable): {', '.join(damaged)}"
    groups = task_groups(runs, records)
    if len(groups) > 1:
        text += ("\n\nplotted apart (runs of different datasets or tasks do not share an axis): "
                 + "; ".join(f"{prefix.rstrip('-')}: {', '.join(r['run'] for _, r in members)}"
                             for prefix, members in groups.items()))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(text + "\n")
        labels = _labels([r.path for r in runs])
        for prefix, members in groups.items():
            chosen = [r for _, r in members]
            about = ", ".join(v for v in (_common(chosen, "dataset"), _common(chosen, "model")) if v)
            rows = {labels[i] + (f" ({runs[i].state})" if runs[i].state else ""): runs[i].rows for i, _ in members}
            prefix = prefix if len(groups) > 1 else ""
            if metric:
                plot_curves(rows, metric, out, prefix=prefix, about=about)
            else:  # each primary metric, for the runs judged by it (FedSA-LoRA's eval_accuracy is not its score)
                for name in sorted({r["metric"] for r in chosen}):
                    plot_curves({k: v for (k, v), r in zip(rows.items(), chosen) if r["metric"] == name}, name, out,
                                prefix=prefix, about=about)
    return text


def task_groups(runs: Sequence[Run], records: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """The runs by dataset and task type (a plot's file-name prefix -> (index, table record) of each member): runs
    of different data are not drawn on one axis."""
    groups: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, (run, record) in enumerate(zip(runs, records)):
        task = _section_of(run.config, "task").get("type") or "classification"
        name = f"{record.get('dataset') or 'unknown'}-{task}"  # (a local dataset by its whole path)
        groups.setdefault(re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") + "-", []).append((i, record))
    return groups
