"""Command line: ``fedpeft run | report | data | partition | model | config | flower``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from fedpeft.config import ConfigError, dump_config, load_config

EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError, FileExistsError)


def _expected_errors() -> tuple[type[BaseException], ...]:
    from fedpeft.data.partition import PartitionError
    from fedpeft.data.sources import DataError
    from fedpeft.models.registry import ModelError
    from fedpeft.checkpoint import CheckpointError
    from fedpeft.tuners import StateError

    return EXPECTED_ERRORS + (DataError, PartitionError, ModelError, StateError, CheckpointError)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.set or args.run_dir:
            raise ConfigError("--resume RUN_DIR continues a run with the config saved in RUN_DIR/config.yaml; "
                              "give no config file, --set or --run-dir with it")
        config_path = Path(args.resume) / "config.yaml"
        if not config_path.is_file():
            raise FileNotFoundError(f"{args.resume!r} is not a run directory (no config.yaml)")
        cfg = load_config(config_path)
    else:
        if not args.config:
            raise ConfigError("give a YAML config (fedpeft run CONFIG) or a run to continue (fedpeft run --resume RUN_DIR)")
        cfg = load_config(args.config, args.set)
    if args.no_progress:
        cfg.runtime.progress = False
    _quiet_libraries()
    run_dir = args.resume or args.run_dir
    if cfg.runtime.name == "flower":
        from fedpeft.runtime.flower.launch import run_flower

        summary = run_flower(cfg, run_dir, resume=bool(args.resume), log=lambda m: print(m, file=sys.stderr))
        run_dir = summary["run_dir"]
    else:
        from fedpeft.runtime.embedded import EmbeddedRuntime

        runtime = EmbeddedRuntime.resume(run_dir) if args.resume else EmbeddedRuntime(cfg, run_dir)
        if args.resume:
            runtime.cfg.runtime.progress = cfg.runtime.progress
        print(f"run directory: {runtime.run_dir}", file=sys.stderr)
        summary = runtime.run()
        run_dir = runtime.run_dir
    metric = summary["primary_metric"]
    print(
        f"{cfg.name}: {metric} {summary.get('initial')} -> {summary.get('final')} (best {summary.get('best')}) "
        f"in {summary.get('rounds')} rounds; {summary.get('total_bytes', 0) / 2**20:.2f} MiB exchanged; "
        f"rounds to target: {summary.get('rounds_to_target')}; {summary.get('wall_s', 0):.1f} s"
    )
    print(f"results: {run_dir}")
    return 0


def cmd_flower_credentials(args: argparse.Namespace) -> int:
    from fedpeft.runtime.flower.credentials import make_credentials

    out = make_credentials(args.out_dir, hosts=args.host, supernodes=args.supernodes, days=args.days)
    print(f"wrote ca.crt, server.pem / server.key (for localhost, 127.0.0.1{''.join(', ' + h for h in args.host)}) "
          f"and {args.supernodes} SuperNode key pairs to {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fedpeft.report.table import report

    print(report(args.run_dirs, args.out, args.metric))
    if args.out:
        print(f"\nwritten: {Path(args.out) / 'report.md'} and plots in {args.out}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.set)
    print(dump_config(cfg), end="")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from collections import Counter

    from fedpeft.data.sources import describe_splits, load_rows

    info = describe_splits(args.dataset, args.data_dir)
    print(f"dataset: {args.dataset}  source: {info['source']}")
    splits = [args.split] if args.split else info["splits"]
    for split in splits:
        rows = load_rows(args.dataset, split, data_dir=args.data_dir)
        fields = sorted({k for r in rows[:100] for k in r})
        line = f"  {split}: {len(rows)} rows; fields: {', '.join(fields)}"
        if rows and "label" in rows[0]:
            counts = Counter(r["label"] for r in rows)
            names = {r["label"]: r.get("label_text") for r in rows if r.get("label_text")}
            hist = ", ".join(f"{k}{'=' + str(names[k]) if k in names else ''}: {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))
            line += f"\n    labels: {hist}"
        text_field = next((f for f in ("text", "input", "question") if rows and f in rows[0]), None)
        if text_field:
            lengths = sorted(len(str(r[text_field])) for r in rows)
            line += f"\n    {text_field} characters: median {lengths[len(lengths) // 2]}, max {lengths[-1]}"
        print(line)
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
        cfg = load_config(target, args.set)
        _quiet_libraries()
        from fedpeft.data.partition import partition_stats
        from fedpeft.data.prepare import prepare_task
        from fedpeft.models import registry
        from fedpeft.runtime.setup import build_partition

        tok = registry.load_tokenizer(cfg.model.name)
        encdec = bool(getattr(registry.load_config(cfg.model.name), "is_encoder_decoder", False))
        data = prepare_task(cfg.task, tok, encoder_decoder=encdec, seed=cfg.seed, eval_max_examples=cfg.eval.max_examples)
        stats = partition_stats(build_partition(cfg, data)[0], data.train_labels)
    print(format_stats(stats, args.rows))
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from fedpeft.config.schema import TaskConfig
    from fedpeft.footprint import footprint
    from fedpeft.models import registry
    from fedpeft.models.architectures import architecture_config
    from fedpeft.models.layout import model_shape

    config = architecture_config(args.name)
    shape = model_shape(config)
    task = args.task or ("classification" if config.model_type in ("bert", "roberta", "distilbert") else "generation")
    kind = registry.model_kind(TaskConfig(type=task).type, config)
    every = ["full", "lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "houlsby", "pfeiffer", "bitfit"]
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
    for m in methods:
        # validated as `fedpeft run` validates them (one-line errors naming the key and the allowed values)
        opts = load_config(None, [f"peft={{method: {m}}}", *(f"peft.{k}={v}" for k, v in options.items()
                                                            if k in _option_names(m))]).peft
        try:
            rows.append(footprint(args.name, config, opts, kind, num_labels=args.num_labels, sparsity=args.sparsity,
                                  tokens=args.tokens))
        except ValueError as exc:  # the method cannot drive this model (e.g. prompts on an encoder-decoder classifier)
            skipped[m] = str(exc).splitlines()[0]
    about = {"model": args.name, "model_type": config.model_type, "layers": shape.num_layers,
             "attention_modules": shape.num_attention_modules, "heads": shape.num_heads, "kv_heads": shape.num_kv_heads,
             "hidden": shape.hidden, "feed_forward": shape.intermediate, "encoder_decoder": shape.encoder_decoder,
             "task_head": kind, "num_labels": args.num_labels if kind == "classification" else None,
             "tokens": args.tokens, "sparsity": args.sparsity}
    if args.json:
        print(json.dumps({**about, "methods": [r.as_dict() for r in rows], "not_available": skipped}, indent=2))
        return 0
    print(f"{args.name}: {config.model_type}, {shape.num_layers} layers ({shape.num_attention_modules} attention modules), "
          f"{shape.num_heads} heads ({shape.num_kv_heads} key/value), hidden {shape.hidden}, feed-forward "
          f"{shape.intermediate}, encoder-decoder: {shape.encoder_decoder}")
    print(f"task head: {kind}" + (f" ({args.num_labels} labels)" if kind == "classification" else "")
          + f"; OPs per training sequence of {args.tokens} tokens")
    print("upload per client and round: 'paper MiB' = the method's tensors only (no task head), float32, MiB; "
          "'run bytes' = what a client sends (task head, kept-head ids, metadata)")
    header = ["method", "trainable", "PEFT params", "paper MiB", "run bytes", *(f"GOPs {c}" for c in _conventions(rows))]
    if args.sparsity is not None:
        header += ["kept heads", f"paper MiB @{args.sparsity:g}", f"run bytes @{args.sparsity:g}",
                   *(f"GOPs {c} @{args.sparsity:g}" for c in _conventions(rows))]
    lines = []
    for r in rows:
        line = [r.method, f"{r.trainable:,}", f"{r.peft_parameters:,}", f"{r.paper_mib:.4f}", f"{r.run_bytes:,}",
                *(f"{r.ops[c] / 1e9:,.2f}" for c in _conventions(rows))]
        if args.sparsity is not None:
            pruned = r.kept_heads is not None
            line += [f"{r.kept_heads}/{r.num_heads}" if pruned else "-",
                     f"{r.paper_mib_pruned:.4f}" if pruned else "-", f"{r.run_bytes_pruned:,}" if pruned else "-",
                     *((f"{r.ops_pruned[c] / 1e9:,.2f}" if pruned else "-") for c in _conventions(rows))]
        lines.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(line, widths))))
    for r in rows:
        if args.sparsity is not None and r.pruning_note:
            print(f"{r.method}: no head pruning ({r.pruning_note})")
    for m, why in skipped.items():
        print(f"{m}: not available ({why})")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpeft", description="Federated parameter-efficient fine-tuning.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a federated fine-tuning from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. train.lr=1e-3")
    r.add_argument("--run-dir", help="directory for the results (default: OUTPUT_DIR/NAME-TIMESTAMP)")
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
    rep.add_argument("run_dirs", nargs="+")
    rep.add_argument("--out", help="also write report.md and comparison plots here")
    rep.add_argument("--metric", help="metric to plot (default: the runs' primary metric)")
    rep.set_defaults(func=cmd_report)

    c = sub.add_parser("config", help="validate a config and print it with every default filled in")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(func=cmd_config)

    d = sub.add_parser("data", help="show a dataset's splits, sizes, fields and labels")
    d.add_argument("dataset", help="catalog name, local path or Hub id")
    d.add_argument("--split")
    d.add_argument("--data-dir")
    d.set_defaults(func=cmd_data)

    pa = sub.add_parser("partition", help="print partition statistics of a config or a run directory")
    pa.add_argument("source", help="config YAML or run directory")
    pa.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pa.add_argument("--rows", type=int, default=20, help="clients to list")
    pa.set_defaults(func=cmd_partition)

    m = sub.add_parser("model", help="a backbone's layout and, per PEFT method, trainable parameters, upload per "
                       "client and round, and analytic OPs, from its architecture config alone (offline, no weights)")
    m.add_argument("name", help="a bundled architecture (t5-small, t5-base, bart-base, distilbert, roberta-base, "
                   "roberta-large, gpt2, gpt2-large, gpt2-xl, opt-1.3b, llama-7b, or their Hub ids), a bundled "
                   "alias with weights, a local directory or a Hub id")
    m.add_argument("--task", choices=["classification", "generation", "multiple_choice"])
    m.add_argument("--methods", help="comma-separated PEFT methods (default: all)")
    m.add_argument("--num-labels", type=int, default=2)
    m.add_argument("--set", action="append", default=[], metavar="peft.KEY=VALUE",
                   help="a PEFT option, as in `fedpeft run` (e.g. peft.r=8, peft.num_virtual_tokens=100)")
    m.add_argument("--sparsity", type=float, help="also show head pruning at this sparsity (paper 000)")
    m.add_argument("--tokens", type=int, default=128, help="tokens per training sequence for the OPs (paper 000: 512)")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except _expected_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
