"""Command line: ``fedpeft run | eval | report | data | partition | model | config | flower``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from fedpeft.config import ConfigError, apply_overrides, dump_config, load_config, validate_config
from fedpeft.config.schema import options_for
from fedpeft.errors import UserError
from fedpeft.plugins import load_built_ins

# errors about the user's input: printed as one line, exit code 2 (the classes load without torch)
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, FileExistsError)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def _resume_rounds(sets: list[str]) -> int | None:
    """The one setting a resumed run may change: ``--set federation.rounds=N`` (more rounds extend it)."""
    rounds = None
    for item in sets:
        key, sep, value = item.partition("=")
        if key.strip() != "federation.rounds" or not sep:
            raise ConfigError(f"--set {item!r} with --resume: a resumed run keeps the config saved in RUN_DIR/config.yaml; "
                              "only federation.rounds may change (e.g. --set federation.rounds=20 to add rounds)")
        try:
            rounds = int(value)
        except ValueError:
            raise ConfigError(f"--set {item!r}: federation.rounds must be a whole number of rounds") from None
    return rounds


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.run_dir or args.plugin:
            raise ConfigError("--resume RUN_DIR continues a run with the config saved in RUN_DIR/config.yaml (its "
                              "plugins included); give no config file, --run-dir or --plugin with it")
        from fedpeft.runtime.resume import resume_config

        cfg = resume_config(args.resume, _resume_rounds(args.set), allow_unsealed=args.allow_unsealed)
    else:
        if not args.config:
            raise ConfigError("give a YAML config (fedpeft run CONFIG) or a run to continue (fedpeft run --resume RUN_DIR)")
        if args.allow_unsealed:
            raise ConfigError("--allow-unsealed goes with --resume RUN_DIR (a run whose files carry no seal); a new run "
                              "writes sealed files")
        # running a config runs the plugins it lists (docs/guide/configuration.md: a config is code)
        cfg = load_config(args.config, args.set, plugins=args.plugin, trust_plugins=True)
    if args.no_progress:
        cfg.runtime.progress = False
    from fedpeft.data.sources import check_available
    from fedpeft.models import registry

    registry.check_available(cfg.model.name)  # an unknown name fails here, in milliseconds, before the
    check_available(cfg.task.dataset, cfg.task.data_dir, cfg.task.dataset_config)  # libraries load
    _quiet_libraries()
    from fedpeft.launchers import run_config

    run_dir = args.resume or args.run_dir
    started: list[Path] = []  # the run directory, once it exists
    try:
        summary = run_config(cfg, run_dir, resume=bool(args.resume), log=lambda m: print(m, file=sys.stderr),
                             on_run_dir=started.append)
        run_dir = summary["run_dir"]
    except KeyboardInterrupt:
        where = started[-1] if started else run_dir
        if where is None or not (Path(where) / "config.yaml").is_file():
            print("\ninterrupted before the run started; nothing was written", file=sys.stderr)
        else:
            print(f"\ninterrupted; {_resume_hint(Path(where))}", file=sys.stderr)
        return 130
    from fedpeft.api import plotted

    plotted(summary)
    print(end_of_run_line(cfg.name, summary))
    if summary.get("personal_models"):
        print(personal_models_line(summary, run_dir, cfg.runtime.name))
    print(f"results: {run_dir}")
    return 1 if _every_round_failed(summary, run_dir) else 0


def personal_models_line(summary: dict, run_dir: str | Path, runtime: str = "embedded") -> str:
    """What `fedpeft run` prints after the headline of a run whose model is each client's own."""
    if summary.get("client_adapters"):
        saved = f"each in {Path(run_dir) / summary['client_adapters']}/<id> (fedpeft eval {run_dir} --client ID)"
    elif runtime == "embedded":
        saved = "save each with --set eval.save_client_adapters=true"
    else:
        saved = f"each client's part stays in its SuperNode ({runtime} runtime)"
    return (f"model: each client's own, the global part with {summary['personal_models']}, so no best_adapter; "
            f"{saved}")


def _every_round_failed(summary: dict, run_dir: str | Path) -> bool:
    """Whether no round of the run aggregated anything (printed as an error: the model never changed)."""
    rounds, failed = summary.get("rounds") or 0, summary.get("failed_rounds") or 0
    if rounds == 0 or failed < rounds:
        return False
    print(f"error: all {rounds} rounds failed, so the global model is the initial one: see why in "
          f"{Path(run_dir) / 'events.log'} (the rejected updates of each round are in metrics.jsonl)", file=sys.stderr)
    return True


def _resume_hint(run_dir: Path) -> str:
    from fedpeft import checkpoint

    try:
        done = f"the last checkpoint is after round {checkpoint.load(run_dir)[0]}"
    except checkpoint.CheckpointError:
        done = "no checkpoint yet, so it restarts from round 1"
    return f"{done}; continue with: fedpeft run --resume {run_dir}"


def _figure(value) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def end_of_run_line(name: str, summary: dict) -> str:
    """One line: the primary metric before -> after (best, at which round), rounds, traffic, time."""
    best_round = summary.get("best_round")
    stopped = f" (stopped early: {summary['stopped_early']})" if summary.get("stopped_early") else ""
    return (f"{name}: {summary['primary_metric']} {_figure(summary.get('initial'))} -> {_figure(summary.get('final'))}"
            f"{sample_note(summary)} (best {_figure(summary.get('best'))}{f' at round {best_round}' if best_round is not None else ''}) "
            f"in {summary.get('rounds') or 0} rounds{stopped}; {summary.get('total_bytes', 0) / 2**20:.2f} MiB "
            f"exchanged; rounds to target: {_figure(summary.get('rounds_to_target'))}; {summary.get('wall_s', 0):.1f} s")


def sample_note(summary: dict) -> str:
    """How many rows a personalized final score stands on (and its 95% interval for accuracy), or ""."""
    if not summary.get("final_rows"):
        return ""
    interval = summary.get("final_interval")
    within = f", 95% interval {interval[0]:.2f}-{interval[1]:.2f}" if interval else ""
    return f" [on {summary['final_rows']} held-out rows of {summary.get('final_clients')} clients{within}]"


def cmd_eval(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from fedpeft.adapters import load_adapter
    from fedpeft.data.prepare import prepare_eval
    from fedpeft.durable import atomic_write, is_refused_write, refused_write
    from fedpeft.runtime.resume import saved_config
    from fedpeft.runtime.setup import pick_device
    from fedpeft.training.evaluate import PREDICTIONS, evaluate

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    trust = {"plugins": args.plugin, "trust_plugins": args.trust_plugins, "allow_unsealed": args.allow_unsealed}
    # checked as a resume does; the run's plugins are imported only when named or trusted
    cfg = saved_config(run_dir, [f"task.dataset={args.dataset}"] if args.dataset else [], **trust)
    adapter_name = _eval_adapter(run_dir, args.adapter, args.client, cfg)
    adapter_dir = run_dir / adapter_name
    split = args.split or cfg.task.eval_split
    device = pick_device(args.device or cfg.runtime.device)
    loaded = load_adapter(adapter_dir, dtype=cfg.model.dtype, device=device, **trust)
    meta = loaded.meta
    model = _scored_model(adapter_name, meta, cfg)
    encdec = bool(getattr(loaded.model.config, "is_encoder_decoder", False))
    data = prepare_eval(cfg.task, split, loaded.tokenizer, encoder_decoder=encdec, seed=cfg.seed,
                        max_examples=args.max_examples, label_names=meta.get("label_names"),
                        label_kind=meta.get("label_kind"), template=meta.get("template"))
    result = evaluate(loaded.model, data, tokenizer=loaded.tokenizer, device=device, batch_size=cfg.eval.batch_size,
                      encoder_decoder=encdec, max_new_tokens=cfg.task.generation_max_new_tokens,
                      precision=cfg.runtime.precision)
    out = Path(args.out) if args.out else run_dir / "eval" / f"{adapter_name.replace('/', '_')}-{split.replace('/', '_')}.jsonl"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if is_refused_write(exc):
            raise refused_write(out.parent, exc, then="run fedpeft eval again (or give --out elsewhere)") from None
        raise
    lines = prediction_lines(data, result[PREDICTIONS], instruction=cfg.task.instruction)
    atomic_write(out, "".join(json.dumps(line) + "\n" for line in lines).encode("utf-8"),
                 then="run fedpeft eval again (or give --out elsewhere)")
    scores = {(k if k.startswith("eval_") else f"eval_{k}"): v for k, v in result.items() if not k.startswith("_")}
    summary = {"run_dir": str(run_dir), "adapter": adapter_name, "model": model, "round": meta.get("round"),
               "dataset": cfg.task.dataset, "split": split, "examples": len(data.rows), **scores, "predictions": str(out)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        shown = ", ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in scores.items() if isinstance(v, float))
        print(f"model: {model}")
        print(f"{run_dir} {adapter_name} (round {meta.get('round')}) on {cfg.task.dataset} {split} "
              f"({len(data.rows)} rows): {shown}")
        print(f"predictions: {out}")
    if data.task_type in ("classification", "image_classification"):
        from fedpeft.metrics.scores import one_class_advice, one_class_label

        found = one_class_label(result[PREDICTIONS], data.eval.labels, data.label_names)
        if found is not None:
            print(f"warning: the model predicts {found[0]!r} for {found[1]:.0%} of the rows, while the data has several "
                  f"classes: {one_class_advice(cfg.task_metric())}", file=sys.stderr)
    return 0


def _eval_adapter(run_dir: Path, adapter: str | None, client: int | None, cfg) -> str:
    """The adapter directory (relative to the run) ``fedpeft eval`` scores: ``--client``'s own, ``--adapter``'s,
    else best_adapter when the run kept one, else adapter."""
    kept = type(cfg.algorithm).personal_models
    if client is None:
        if adapter == "best" and not (run_dir / "best_adapter").is_dir():
            why = (f"its model is each client's own ({cfg.algorithm.name}): score one with --client ID"
                   if kept is not None else "eval.save_best was off" if not cfg.eval.save_best
                   else "no evaluation was finite")
            raise UserError(f"{run_dir}: no best_adapter ({why}); --adapter last scores the last round's global model")
        if kept is None or adapter is not None:
            return {"best": "best_adapter", "last": "adapter"}[adapter or ("best" if (run_dir / "best_adapter").is_dir()
                                                                           else "last")]
        return "adapter"  # a best_adapter an older fedpeft kept by the global score is not the method's either
    if adapter is not None:
        raise UserError(f"fedpeft eval: --client {client} and --adapter {adapter} name two models; give one of them")
    from fedpeft.rundir import CLIENT_ADAPTERS

    name = f"{CLIENT_ADAPTERS}/{client}"
    if not (run_dir / name).is_dir():
        saved = sorted(int(p.name) for p in (run_dir / CLIENT_ADAPTERS).glob("*") if p.name.isdigit())
        if saved:
            hint = f"the run saved clients {saved[0]}..{saved[-1]}"
        elif kept is None:
            hint = (f"under {cfg.algorithm.name} every client's model is the global one: drop --client (it scores "
                    "RUN_DIR/best_adapter or adapter)")
        elif cfg.runtime.name != "embedded":
            hint = f"in a {cfg.runtime.name} run each client's part stays in its SuperNode"
        else:
            hint = "the run saved no client's model: run it with --set eval.save_client_adapters=true"
        raise UserError(f"{run_dir}: no {name}; {hint}")
    return name


def _scored_model(adapter_name: str, meta: dict, cfg) -> str:
    """Which model ``fedpeft eval`` scores, in words (printed above the scores)."""
    kept = type(cfg.algorithm).personal_models
    rnd = meta.get("round")
    if "client" in meta:
        if not meta.get("trained", True):
            return f"client {meta['client']}'s own model: it never trained, so the global model after round {rnd}"
        return f"client {meta['client']}'s own model after round {rnd}: the global part with {kept}"
    by = next((k for k in meta if k.startswith(("eval_", "personal_")) or k == "train_loss"), None)
    what = (f"the global model of round {rnd}, the best by {by or 'the primary metric'}"
            if adapter_name == "best_adapter" else f"the global model after round {rnd}")
    if kept is not None:
        what += (f" (not the method's model: under {cfg.algorithm.name} each client keeps {kept}; score one client's "
                 "with --client ID, from a run with eval.save_client_adapters)")
    return what


def prediction_lines(data, predictions: list, instruction: str | None = None) -> list[dict]:
    """One JSON object per evaluated row: where it is (1-based row of its split part), its input, the gold
    answer and the prediction (a class name, a generated text, or the index of the chosen choice).
    ``instruction``: task.instruction, for instruction rows that carry none."""
    lines = []
    for row, (source, part, number), pred in zip(data.rows, data.origins, predictions):
        line = {"row": number, "split": part, "source": source}
        if data.task_type == "classification":
            line.update({"text": row["text"], "label": row["label"],
                         "prediction": data.label_names[pred], "prediction_id": int(pred)})
            if row.get("text_pair") is not None:
                line["text_pair"] = row["text_pair"]
        elif data.task_type == "image_classification":  # the image itself stays where it is (row and source)
            image = row["image"]
            path = image if isinstance(image, str) else image.get("path") if isinstance(image, dict) else None
            line.update({"image": path, "label": row["label"], "prediction": data.label_names[pred],
                         "prediction_id": int(pred)})
        elif data.task_type == "generation":
            line.update({"input": row["input"], "target": row["target"], "prediction": pred})
        elif data.task_type == "instruction":
            from fedpeft.data.chat import to_messages

            messages, references = to_messages(row, instruction)
            line.update({"messages": messages[:-1], "target": messages[-1]["content"], "references": references,
                         "prediction": pred})
        else:
            line.update({"question": row["question"], "choices": row["choices"], "label": row["label"],
                         "prediction": int(pred)})
        lines.append(line)
    return lines


def cmd_flower_credentials(args: argparse.Namespace) -> int:
    from fedpeft.runtime.flower.credentials import (
        PARTITION_KEYS_FILE,
        make_credentials,
        partition_keys,
        partition_keys_setting,
    )

    if args.supernodes < 1 or args.days < 1:
        raise ConfigError(f"--supernodes {args.supernodes} --days {args.days}: give at least one SuperNode key pair "
                          "and a validity of at least one day")
    out = make_credentials(args.out_dir, hosts=args.host, supernodes=args.supernodes, days=args.days)
    print(f"wrote ca.crt, server.pem / server.key (for localhost, 127.0.0.1{''.join(', ' + h for h in args.host)}) "
          f"and {args.supernodes} SuperNode key pairs to {out}")
    print(f"pin partition I to the key of supernode-I (also in {out / PARTITION_KEYS_FILE}); add to `fedpeft run`:")
    print(f"  {partition_keys_setting(partition_keys(out, args.supernodes))}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fedpeft.report.table import report

    print(report(args.run_dirs, args.out, args.metric))
    if args.out:
        print(f"\nwritten: {Path(args.out) / 'report.md'} and plots in {args.out}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set, plugins=args.plugin, trust_plugins=args.trust_plugins)
    print(dump_config(cfg), end="")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    """Splits, sizes, fields and labels, and every row a run would refuse (``problem:`` lines, exit code 2)."""
    from fedpeft.data import validate
    from fedpeft.data.catalog import dataset_entry, prompt_template
    from fedpeft.data.images import image_report
    from fedpeft.data.sources import describe_splits, load_rows
    from fedpeft.plugins import load_installed_plugins

    load_installed_plugins()  # an installed package's datasets are named datasets here too
    # the task options a run takes, checked as a run checks them (the name as given: not read as YAML)
    task = validate_config(apply_overrides({"task": {"dataset": args.dataset}}, args.set)).task
    if task.dataset != args.dataset:
        raise ConfigError(f"--set task.dataset: give the dataset as the command's argument ({args.dataset!r} here)")
    data_dir = args.data_dir or task.data_dir
    chosen_type = "type" in task.model_fields_set

    info = describe_splits(args.dataset, data_dir, task.dataset_config)
    print(f"dataset: {args.dataset}  source: {info['source']}")
    for note in info["notes"]:
        print(f"  note: {note}")
    entry = dataset_entry(args.dataset)
    splits = [args.split] if args.split else info["splits"]
    found = 0
    for split in splits:
        origins: list[validate.Origin] = []
        rows = load_rows(args.dataset, split, dataset_config=task.dataset_config, data_dir=data_dir,
                         columns=task.columns or None, origins=origins)
        fields = sorted({k for r in rows[:100] for k in r})
        print(f"  {split}: {len(rows)} rows; fields: {', '.join(fields)}")
        labels = validate.label_histogram(rows)
        if labels:
            print(f"    labels: {labels}")
        text_field = next((f for f in ("text", "input", "question") if rows and f in rows[0]), None)
        lengths = sorted(len(r[text_field]) for r in rows if isinstance(r.get(text_field), str)) if text_field else []
        if lengths:
            print(f"    {text_field} characters: median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
        task_type = task.type if chosen_type else entry.task if entry else validate.infer_task_type(rows)
        template = prompt_template(task_type, args.dataset, rows, task.prompt_template) if task_type and rows else None
        problems, notes = validate.report(task_type, rows, origins, template, split)
        if task_type == "image_classification" and not problems:
            images, problems = image_report(rows, [validate.at(o) for o in origins],
                                            max_pixels=task.max_image_pixels)
            print(f"    {images}")
        for line in [f"note: {n}" for n in notes] + [f"problem: {p}" for p in problems[:10]]:
            print(f"    {line}")
        if len(problems) > 10:
            print(f"    ... and {len(problems) - 10} more problems")
        found += len(problems)
    if found:
        print(f"error: {found} problem{'' if found == 1 else 's'} in dataset {args.dataset!r} (listed above): a run that "
              "reads these rows refuses them; fix or drop them", file=sys.stderr)
        return 2
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from fedpeft.data.partition import format_stats

    target = Path(args.source)
    if target.is_dir():
        path = target / "partition.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(target)!r} has no partition.json")
        stats = json.loads(path.read_text())
    else:
        cfg = load_config(target, args.set, plugins=args.plugin, trust_plugins=args.trust_plugins)
        _quiet_libraries()
        from fedpeft.data.partition import partition_stats
        from fedpeft.data.prepare import prepare_task
        from fedpeft.models import registry
        from fedpeft.runtime.setup import build_partition, partition_column

        tok = registry.load_tokenizer(cfg.model.name)
        encdec = bool(getattr(registry.load_config(cfg.model.name), "is_encoder_decoder", False))
        data = prepare_task(cfg.task, tok, encoder_decoder=encdec, seed=cfg.seed, eval_max_examples=cfg.eval.max_examples)
        values = partition_column(cfg)  # the column schemes: each client's values are shown
        stats = partition_stats(build_partition(cfg, data, values)[0], data.train_labels, values,
                                column=cfg.federation.partition.column, label_names=data.label_names)
    print(format_stats(stats, args.rows))
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """List the registered algorithms, PEFT methods and robust rules (built-in and the given plugins')."""
    from fedpeft import listing
    from fedpeft.plugins import load_plugins, resolve_plugin

    load_plugins([resolve_plugin(x) for x in args.plugin])
    kinds = listing.KINDS if args.kind is None else (args.kind,)
    if args.markdown:
        print("\n\n".join(listing.markdown_table(kind) for kind in kinds))
    else:
        print(listing.text_table(kinds), end="")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from fedpeft.config.schema import TaskConfig
    from fedpeft.footprint import footprint
    from fedpeft.models import registry
    from fedpeft.models.architectures import architecture_config
    from fedpeft.models.layout import image_sequence_length, is_image_model, uniform_shape

    config = architecture_config(args.name)
    image = is_image_model(config)
    task = args.task or ("image_classification" if image else "classification"
                         if config.model_type in ("bert", "roberta", "distilbert") else "generation")
    kind = registry.model_kind(TaskConfig(type=task).type, config)
    shape = uniform_shape(config)  # None: stages of different widths (Swin) or no attention (ConvNeXt)
    if args.tokens is None:
        args.tokens = image_sequence_length(config) if image else 128
    if image and (args.memory or args.device_memory is not None):
        raise ConfigError(f"--memory: the training-memory estimate feeds token ids, which {args.name} (a vision "
                          "transformer) does not take; leave out --memory and --device-memory")
    from fedpeft.plugins import load_plugins, resolve_plugin
    from fedpeft.tuners import PEFT_METHODS

    load_plugins([resolve_plugin(x) for x in args.plugin])
    every = list(PEFT_METHODS)
    methods = args.methods.split(",") if args.methods else every
    unknown = [m for m in methods if m not in every]
    if unknown:
        raise ConfigError(f"--methods: unknown peft method {unknown[0]!r}; choose from {', '.join(every)}")
    if args.sparsity is not None and not 0.0 <= args.sparsity < 1.0:
        raise ConfigError(f"--sparsity {args.sparsity}: give the pruned fraction of heads in [0, 1), e.g. 0.9")
    if args.tokens < 1:
        raise ConfigError(f"--tokens {args.tokens}: give the tokens of one training sequence (at least 1), e.g. 512")
    options = _peft_sets(args.set)
    unused = sorted(set(options) - {k for m in methods for k in _option_names(m)})
    if unused:
        raise ConfigError(f"--set peft.{unused[0]}: none of the methods {', '.join(methods)} has that option; "
                          "`fedpeft config` lists each method's options")
    rows, skipped = [], {}
    # full fine-tuning (the method that trains every weight): what paper 004's Eq. 1 compares with
    baseline = next((m for m in every if options_for("peft", m).trains_every_weight), None)
    for m in dict.fromkeys([*methods, *([baseline] if baseline else [])]):
        # validated as `fedpeft run` validates them (one-line errors naming the key and the allowed values)
        opts = load_config(None, [f"peft={{method: {m}}}", *(f"peft.{k}={v}" for k, v in options.items()
                                                            if k in _option_names(m))], plugins=args.plugin).peft
        try:
            rows.append(footprint(args.name, config, opts, kind, num_labels=args.num_labels, sparsity=args.sparsity,
                                  tokens=args.tokens))
        except ValueError as exc:  # the method cannot drive this model (e.g. prompts on an encoder-decoder classifier)
            skipped[m] = str(exc).splitlines()[0]
    full = next((r for r in rows if r.method == baseline), None)
    rows, skipped = [r for r in rows if r.method in methods], {m: why for m, why in skipped.items() if m in methods}
    reduction = {r.method: 1.0 - r.run_bytes / full.run_bytes for r in rows} if full is not None else {}
    dims = ({"layers": shape.num_layers, "attention_modules": shape.num_attention_modules, "heads": shape.num_heads,
             "kv_heads": shape.num_kv_heads, "hidden": shape.hidden, "feed_forward": shape.intermediate,
             "encoder_decoder": shape.encoder_decoder} if shape is not None else {})
    about = {"model": args.name, "model_type": config.model_type, **dims, "task_head": kind, "num_labels": args.num_labels if kind == "classification" else None,
             "tokens": args.tokens, "sparsity": args.sparsity}
    if args.device_memory is not None:
        args.memory = True  # (how many clients fit is part of the memory estimate)
    memory = _memory_rows(args, config, kind, task, {r.method: r for r in rows}) if args.memory else None
    if args.json:
        print(json.dumps({**about, "methods": [{**r.as_dict(), "reduction_vs_full": reduction.get(r.method)}
                                               for r in rows], "not_available": skipped,
                          **({"memory": memory} if memory is not None else {})}, indent=2))
        return 0
    if shape is None:
        print(f"{args.name}: {config.model_type}, stages of different widths or no attention heads (no analytic OPs)")
    else:
        print(f"{args.name}: {config.model_type}, {shape.num_layers} layers ({shape.num_attention_modules} attention "
              f"modules), {shape.num_heads} heads ({shape.num_kv_heads} key/value), hidden {shape.hidden}, "
              f"feed-forward {shape.intermediate}, encoder-decoder: {shape.encoder_decoder}")
    print(f"task head: {kind}" + (f" ({args.num_labels} labels)" if kind == "classification" else "")
          + f"; OPs per training sequence of {args.tokens} tokens")
    print("upload per client and round: 'paper MiB' = the method's tensors only (no task head), float32, MiB; "
          "'run bytes' = what a client sends (task head, kept-head ids, metadata); 'vs full' = 1 - run bytes / "
          "full fine-tuning's, the transmission saved (paper 004's Eq. 1 ratio)")
    header = ["method", "trainable", "PEFT params", "paper MiB", "run bytes", "vs full",
              *(f"GOPs {c}" for c in _conventions(rows))]
    if args.sparsity is not None:
        header += ["kept heads", f"paper MiB @{args.sparsity:g}", f"run bytes @{args.sparsity:g}",
                   *(f"GOPs {c} @{args.sparsity:g}" for c in _conventions(rows))]
    lines = []
    for r in rows:
        line = [r.method, f"{r.trainable:,}", f"{r.peft_parameters:,}", f"{r.paper_mib:.4f}", f"{r.run_bytes:,}",
                f"{100 * reduction[r.method]:.2f}%" if r.method in reduction else "-",
                *(_gops(r.ops[c]) for c in _conventions(rows))]
        if args.sparsity is not None:
            pruned = r.kept_heads is not None
            line += [f"{r.kept_heads}/{r.num_heads}" if pruned else "-",
                     f"{r.paper_mib_pruned:.4f}" if pruned else "-", f"{r.run_bytes_pruned:,}" if pruned else "-",
                     *((_gops(r.ops_pruned[c]) if pruned else "-") for c in _conventions(rows))]
        lines.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
    for r in rows:
        if args.sparsity is not None and r.pruning_note:
            print(f"{r.method}: no head pruning ({r.pruning_note})")
    for m, why in skipped.items():
        print(f"{m}: not available ({why})")
    if memory is not None:
        _print_memory(args, memory)
    return 0


def _memory_rows(args: argparse.Namespace, config, kind: str, kind_task: str, rows: dict) -> list[dict]:
    """One client's estimated training memory per method, precision and checkpointing (metrics/memory.py)."""
    from fedpeft.metrics.memory import PRECISIONS, estimate_training
    from fedpeft.tuners.registry import registered_peft_method

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: give the sequences of one training step (at least 1)")
    if args.device_memory is not None and not args.device_memory > 0:
        raise ConfigError(f"--device-memory {args.device_memory}: give the device's memory in GiB (e.g. 80)")
    out = []
    as_config = {"float32": ["model.dtype=float32"], "bfloat16": ["model.dtype=bfloat16"],
                 "int8": ["model.quantization={bits: 8}"], "nf4": ["model.quantization={bits: 4}"]}
    for method in rows:
        peft_sets = [f"peft={{method: {method}}}", *(f"peft.{k}={v}" for k, v in _peft_sets(args.set).items()
                                                     if k in _option_names(method))]
        opts = load_config(None, peft_sets, plugins=args.plugin).peft
        for precision in PRECISIONS:
            for checkpointing in (False, True):
                try:  # a combination a run would refuse gets the run's reason, not a number
                    load_config(None, [f"model.name={args.name}", f"task.type={kind_task}", *peft_sets,
                                       *as_config[precision], f"train.gradient_checkpointing={checkpointing}"],
                                plugins=args.plugin)
                except ConfigError as exc:
                    out.append({"method": method, "precision": precision, "gradient_checkpointing": checkpointing,
                                "error": "refused: " + str(exc).split(": ", 1)[-1].splitlines()[0][:200]})
                    continue
                try:
                    est = estimate_training(args.name, config, opts, kind, precision, batch_size=args.batch_size,
                                            tokens=args.tokens, gradient_checkpointing=checkpointing,
                                            num_labels=args.num_labels)
                except (ValueError, RuntimeError, NotImplementedError) as exc:
                    out.append({"method": method, "precision": precision, "gradient_checkpointing": checkpointing,
                                "error": str(exc).splitlines()[0][:200]})
                    continue
                row = {"method": method, **est.as_dict()}
                if args.device_memory is not None:  # (None: the method's clients train one at a time)
                    row["clients_per_pass_fit"] = (est.clients_per_pass(int(args.device_memory * 2**30))
                                                   if registered_peft_method(method).trains_batched else None)
                out.append(row)
    return out


def _print_memory(args: argparse.Namespace, memory: list[dict]) -> None:
    print(f"\none client's training memory, estimated (GiB; batch {args.batch_size} x {args.tokens} tokens, AdamW; "
          "without the allocator's slack and the CUDA context; see fedpeft.metrics.memory)")
    header = ["method", "precision", "backbone", "trainable state", "activations (ckpt off / on)",
              "total (ckpt off / on)", "each client in a pass (off / on)"]
    if args.device_memory is not None:
        header.append(f"clients per pass in {args.device_memory:g} GiB (off / on)")
    lines, reasons = [], []

    def gib(row: dict, key: str, digits: int = 2) -> str:
        if "error" in row:
            reasons.append(f"{row['method']} {row['precision']} checkpointing "
                           f"{'on' if row['gradient_checkpointing'] else 'off'}: {row['error']}")
            return f"({len(reasons)})"
        return f"{row[key] / 2**30:.{digits}f}"

    for i in range(0, len(memory), 2):
        off, on = memory[i], memory[i + 1]
        first = off if "error" not in off else on
        if "error" in off and "error" in on and off["error"] == on["error"]:
            reasons.append(f"{off['method']} {off['precision']}: {off['error']}")
            lines.append([off["method"], off["precision"], *[f"({len(reasons)})"] * (len(header) - 2)])
            continue
        lines.append([off["method"], off["precision"], gib(first, "backbone_bytes"),
                      gib(first, "trainable_state_bytes", 3),
                      f"{gib(off, 'activation_bytes')} / {gib(on, 'activation_bytes')}",
                      *(" / ".join("-" if "error" in r else f"{r[key] / 2**30:.2f}" for r in (off, on))
                        for key in ("total_bytes", "per_client_bytes"))])
        if args.device_memory is not None:
            lines[-1].append(" / ".join("-" if "error" in r else "alone" if r["clients_per_pass_fit"] is None
                                        else str(r["clients_per_pass_fit"]) for r in (off, on)))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
    for n, reason in enumerate(reasons, 1):
        print(f"({n}) {reason}")


def _gops(ops: float | None) -> str:
    return "unknown" if ops is None else f"{ops / 1e9:,.2f}"


def _conventions(rows) -> list[str]:
    return list(rows[0].ops) if rows else []


def _option_names(method: str) -> set[str]:
    from fedpeft.tuners import method_options

    return set(type(method_options(method)).model_fields) - {"method"}


def _peft_sets(sets: list[str]) -> dict[str, str]:
    """``--set peft.KEY=VALUE`` (the syntax of ``fedpeft run``) -> {KEY: VALUE} (the value as typed)."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("peft.") or key == "peft.method" or "." in key[5:]:
            raise ConfigError(f"--set {item!r}: give a peft option as peft.KEY=VALUE, e.g. --set peft.r=8 "
                              "(the methods are chosen with --methods)")
        out[key[5:]] = value
    return out


def _trust_arguments(parser: argparse.ArgumentParser, files: str) -> None:
    """--plugin and --trust-plugins of a command that reads a config, run directory or adapter (no code runs)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                        help="load a plugin (a .py file or a module) first, e.g. the one that registers the run's "
                        "method (repeatable)")
    parser.add_argument("--trust-plugins", action="store_true", help=f"import the plugins {files} names (they are "
                        "code: trust them as you would a Python script); off by default")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpeft", description="Federated parameter-efficient fine-tuning.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a federated fine-tuning from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint (from "
                   "round 1 if it saved none), or a finished one with more rounds (--set federation.rounds=N)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.lr=1e-3")
    r.add_argument("--run-dir", help="directory for the results (default: OUTPUT_DIR/NAME-TIMESTAMP)")
    r.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="load a plugin (a .py file or a module) that registers algorithms or PEFT methods; kept in "
                   "the run's config.yaml, so --resume and Flower apps load it too (repeatable)")
    r.add_argument("--allow-unsealed", action="store_true", help="with --resume: accept (and seal) a config.yaml and "
                   "checkpoint that carry no SHA-256 seal, as a fedpeft from before seals wrote them")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    fl = sub.add_parser("flower", help="Flower deployment helpers")
    fl_sub = fl.add_subparsers(dest="flower_command", required=True)
    cr = fl_sub.add_parser("credentials", help="test TLS certificates and SuperNode keys for a secured deployment")
    cr.add_argument("out_dir")
    cr.add_argument("--host", action="append", default=[], help="SuperLink host name or IP the certificate must be "
                    "valid for (repeatable; localhost and 127.0.0.1 are always included)")
    cr.add_argument("--supernodes", type=int, default=2, help="SuperNode key pairs to make")
    cr.add_argument("--days", type=int, default=365, help="validity of the certificates")
    cr.set_defaults(func=cmd_flower_credentials)

    rep = sub.add_parser("report", help="markdown table (and plots) comparing run directories")
    rep.add_argument("run_dirs", nargs="+", help="run directories (paths without a run, e.g. from runs/*, are "
                     "skipped and listed under the table)")
    rep.add_argument("--out", help="also write report.md and comparison plots here (METRIC vs round, vs cumulative "
                     "MiB up + down, vs cumulative upload MiB)")
    rep.add_argument("--metric", help="metric of the initial / final / best columns and of the plots: an evaluation "
                     "metric (accuracy, loss, ...) or train_loss (default: each run's primary metric)")
    rep.set_defaults(func=cmd_report)

    ev = sub.add_parser("eval", help="score a run's adapter on any split and write its predictions")
    ev.add_argument("run_dir")
    ev.add_argument("--adapter", choices=["best", "last"], help="best_adapter (the default, when the run kept one) "
                    "or adapter (the last round)")
    ev.add_argument("--client", type=int, metavar="ID", help="client ID's own model, RUN_DIR/client_adapters/ID (runs "
                    "of an algorithm whose model is each client's, with eval.save_client_adapters)")
    ev.add_argument("--split", help="split to score, sliceable as in task.eval_split (default: the run's eval split)")
    ev.add_argument("--dataset", help="another dataset with the run's schema and classes (default: the run's)")
    ev.add_argument("--max-examples", type=int, help="the run's seeded subset of this many rows (default: every row)")
    ev.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: the run's runtime.device")
    ev.add_argument("--out", help="predictions file (default: RUN_DIR/eval/<adapter>-<split>.jsonl)")
    ev.add_argument("--json", action="store_true", help="print the scores as JSON")
    _trust_arguments(ev, "the run's config and adapter")
    ev.add_argument("--allow-unsealed", action="store_true", help="accept a config.yaml and adapter that carry no "
                    "SHA-256 seal (saved by a fedpeft from before seals)")
    ev.set_defaults(func=cmd_eval)

    c = sub.add_parser("config", help="validate a config and print it with every default filled in")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _trust_arguments(c, "the config")
    c.set_defaults(func=cmd_config)

    d = sub.add_parser("data", help="show a dataset's splits, sizes, fields and labels")
    d.add_argument("dataset", help="catalog name, local path or Hub id")
    d.add_argument("--split")
    d.add_argument("--data-dir")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option, as in `fedpeft run`: task.columns.text=question, task.dataset_config=..., "
                        "task.type=... (the other sections are ignored here)")
    d.set_defaults(func=cmd_data)

    pa = sub.add_parser("partition", help="print partition statistics of a config or a run directory")
    pa.add_argument("source", help="config YAML or run directory")
    pa.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pa.add_argument("--rows", type=int, default=20, help="clients to list")
    _trust_arguments(pa, "the config")
    pa.set_defaults(func=cmd_partition)

    me = sub.add_parser("methods", help="list the registered algorithms, PEFT methods and robust rules (with "
                        "--plugin: a "
                        "plugin's too): name, what it is, where it lives")
    me.add_argument("--kind", choices=["peft", "algorithm", "robust"],
                    help="only PEFT methods, only algorithms or only robust rules")
    me.add_argument("--markdown", action="store_true", help="print markdown tables (as the docs show them)")
    me.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                    help="load a plugin first; its methods are listed too (repeatable)")
    me.set_defaults(func=cmd_methods)

    m = sub.add_parser("model", help="a backbone's layout and, per PEFT method, trainable parameters, upload per "
                       "client and round, and analytic OPs, from its architecture config alone (offline, no weights)")
    m.add_argument("name", help="a bundled architecture (t5-small, t5-base, bart-base, distilbert, roberta-base, "
                   "roberta-large, gpt2, gpt2-large, gpt2-xl, opt-1.3b, open-llama-3b, llama-7b, llama-3.2-1b, llama-3.2-3b, "
                   "llama-3.1-8b, vit-base-patch16-224, or their Hub ids), a bundled "
                   "alias with weights, a local directory or a Hub id")
    m.add_argument("--task", choices=["classification", "generation", "multiple_choice", "image_classification"])
    m.add_argument("--methods", help="comma-separated PEFT methods (default: all)")
    m.add_argument("--num-labels", type=int, default=2)
    m.add_argument("--set", action="append", default=[], metavar="peft.KEY=VALUE",
                   help="a PEFT option, as in `fedpeft run` (e.g. peft.r=8, peft.num_virtual_tokens=100)")
    m.add_argument("--sparsity", type=float, help="also show head pruning at this sparsity (paper 000)")
    m.add_argument("--tokens", type=int, help="tokens per training sequence for the OPs and the memory estimate "
                   "(default 128; a vision transformer's patches and class token, 197 for ViT-B/16; paper 000: 512)")
    m.add_argument("--memory", action="store_true", help="also estimate one client's training memory in float32, "
                   "bfloat16, int8 and nf4, with and without gradient checkpointing")
    m.add_argument("--batch-size", type=int, default=4, help="sequences per training step for --memory")
    m.add_argument("--device-memory", type=float, metavar="GIB", help="also (implies --memory) how many clients "
                   "train together in one pass (runtime.clients_per_pass) within this many GiB, all of it for "
                   "tensors ('alone': the method trains one client at a time)")
    m.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="load a plugin first; its PEFT methods are listed too (repeatable)")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        load_built_ins()  # every command reads the registries: fedpeft's own methods, datasets, runtimes, ...
        return args.func(args)
    except EXPECTED_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a run catches its own and says how to resume; other commands just stop
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
