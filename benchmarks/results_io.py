"""What every benchmark script shares: a description of the machine, the results file, a markdown table, the
config of a run (:func:`load_config`), training it or reusing its finished run (:func:`train_or_reuse`) and one
row over several seeds (:func:`seeded_runs`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

import torch


def machine() -> str:
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"


def save(path: str | Path, results: dict[str, Any]) -> None:
    """Write the results as JSON, with the machine they were measured on."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), **results}, indent=2))


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def is_finished_run(run_dir: Path, cfg: Any) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``cfg``; touches nothing."""
    from fedpeft.rundir import sealed_config

    return (run_dir / "summary.json").exists() and (run_dir / "config.yaml").read_bytes() == sealed_config(cfg)


def reuse_or_clear(run_dir: Path, cfg: Any, label: str) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``cfg`` (to be reused). Otherwise an unfinished run there
    is removed (it is trained again from scratch) and False is returned; a finished run of another config stops
    the script rather than being overwritten."""
    if is_finished_run(run_dir, cfg):
        print(f"[{label}] reusing {run_dir}", flush=True)
        return True
    if (run_dir / "summary.json").exists():
        raise SystemExit(f"{run_dir} holds a finished run with another config; move it away or pass --runs DIR")
    if run_dir.exists():
        print(f"[{label}] replacing the unfinished run in {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    return False


def load_config(path: str | Path | None, sets: Iterable[str] = ()) -> Any:
    """A benchmark run's config: ``path`` with the overrides ``sets``, the plugins it lists imported (a benchmark
    runs its config, plugins included) and no progress bar. ``runtime.progress=false`` comes before ``sets``, so
    that a script's --set given in them can still turn the bar back on."""
    from fedpeft.config import load_config as read_config

    return read_config(path, ["runtime.progress=false", *sets], trust_plugins=True)


def train_or_reuse(cfg: Any, run_dir: Path, label: str, train: Callable[[Any, Path], object] | None = None,
                   note: str | None = None) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``cfg``, to be reused (:func:`reuse_or_clear`).
    Otherwise ``train(cfg, run_dir)`` trains it (default: the embedded runtime, in this process) and False is
    returned; before that, a ``note`` is printed as ``[label] training: note`` (an empty one as
    ``[label] training``; None prints nothing)."""
    if reuse_or_clear(run_dir, cfg, label):
        return True
    if note is not None:
        print(f"[{label}] training: {note}" if note else f"[{label}] training", flush=True)
    if train is None:
        from fedpeft.runtime.embedded import run

        train = run
    train(cfg, run_dir)
    return False


def config_digest(cfg: Any) -> str:
    """SHA-256 of the resolved config as fedpeft writes it to a run's config.yaml."""
    from fedpeft.config import dump_config

    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


def earlier_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an earlier results file (none when there is no file)."""
    path = Path(path)
    return json.loads(path.read_text()).get("rows", []) if path.exists() else []


def kept_row(earlier: list[dict[str, Any]], label: dict[str, Any], digest: str, name: str) -> dict[str, Any] | None:
    """The row of an earlier results file measured for ``label`` with the config of SHA-256 ``digest``, if any.
    Lets a script go on after its run directories were lost (another machine, a stopped session) without
    training again what it has measured: a row is kept only when every label field and the config digest match."""
    for row in earlier:
        if row.get("config_digest") == digest and all(row.get(k) == v for k, v in label.items()):
            print(f"[{name}] keeping the row measured earlier (same config digest {digest[:12]})", flush=True)
            return row
    return None


def carried_over(earlier: list[dict[str, Any]], digest_of: Callable[[dict[str, Any]], str | None]
                 ) -> list[dict[str, Any]]:
    """The rows of an earlier results file whose config digest is ``digest_of(row)``, the digest their cell's
    config has now (None: the cell cannot be rebuilt from the script's tables); the others are dropped, with a
    message, rather than mixed with rows of another config."""
    out = []
    for r in earlier:
        if r.get("config_digest") is not None and r.get("config_digest") == digest_of(r):
            out.append(r)
        else:
            print(f"dropping an earlier row measured with another config than its cell has now: "
                  f"{ {k: v for k, v in r.items() if isinstance(v, (str, int, float)) and k != 'config_digest'} }", flush=True)
    return out


def with_earlier(rows: list[dict[str, Any]], carried: list[dict[str, Any]], keys: tuple[str, ...]
                 ) -> list[dict[str, Any]]:
    """``rows`` followed by the carried-over rows (:func:`carried_over`) of cells this invocation did not run
    (told apart by ``keys``), so that a script run on a subset (more seeds for some cells) adds to its results
    file instead of replacing it; a cell run again keeps only its new row."""
    mine = {tuple(r[k] for k in keys) for r in rows}
    return [*rows, *(r for r in carried if tuple(r.get(k) for k in keys) not in mine)]


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds 0,1,2`` -> [0, 1, 2]; None (the option not given) keeps the config's own seed."""
    if not text:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2") from None
    if len(set(seeds)) != len(seeds) or not seeds:
        raise SystemExit(f"--seeds {text!r}: give distinct integers, e.g. --seeds 0,1,2")
    return seeds


def over_seeds(rows: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One table row from the rows of the same run at several seeds: every number is the mean over the
    seeds, with its sample standard deviation (``<key>_std``, n-1) and the per-seed values
    (``<key>_seeds``); a field that is a number at some seeds and None at others keeps only the
    per-seed values (its mean is None); everything else comes from the first seed."""
    if len(rows) == 1:
        return rows[0]
    import numpy as np

    out: dict[str, Any] = {**rows[0], "seeds": seeds, "per_seed": rows}
    for key in rows[0]:
        values = [r.get(key) for r in rows]
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            continue
        if all(v is None for v in values):
            continue
        out[f"{key}_seeds"] = values
        numbers = [float(v) for v in values if v is not None]
        full = len(numbers) == len(values)
        out[key] = float(np.mean(numbers)) if full else None
        out[f"{key}_std"] = float(np.std(numbers, ddof=1)) if full else None
    return out


def seeded_runs(run_one: Callable[[str, list[str]], dict[str, Any] | None], key: str, overrides: list[str],
                seeds: list[int] | None) -> dict[str, Any] | None:
    """One row from ``run_one(key, overrides)`` at the config's own seed (``seeds`` None), or from one run per
    seed of ``seeds`` (``run_one("<key>-seed<s>", [*overrides, "seed=<s>"])``, seed 0 keeping ``key``)
    averaged by :func:`over_seeds`; None if a run gives None."""
    if seeds is None:
        return run_one(key, overrides)
    rows = [run_one(key if s == 0 else f"{key}-seed{s}", [*overrides, f"seed={s}"]) for s in seeds]
    return None if any(r is None for r in rows) else over_seeds(rows, seeds)


def welch_t(a: list[float | None], b: list[float | None]) -> str:
    """Welch's t of mean(a) - mean(b) ('-' when either has fewer than two values or both have no spread)."""
    a, b = [x for x in a if x is not None], [x for x in b if x is not None]
    if len(a) < 2 or len(b) < 2:
        return "-"
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return "-" if se == 0 else f"{(statistics.mean(a) - statistics.mean(b)) / se:+.1f}"


def pm(row: dict[str, Any], key: str, spec: str = ".3f") -> str:
    """``mean ± std`` when ``row`` averages several seeds, else the plain value; '-' for None."""
    value, std = row.get(key), row.get(f"{key}_std")
    if value is None:
        per_seed = row.get(f"{key}_seeds")
        return "/".join("-" if v is None else format(v, spec) for v in per_seed) if per_seed else "-"
    return format(value, spec) + ("" if std is None else f" ± {format(std, spec)}")


class PeakRSS:
    """Largest total RSS of this process and all its descendants, sampled in a thread every ``interval`` s, and
    (``pss=True``, Linux) their largest total PSS: each page counted once, split among the processes that share
    it. RSS counts a page shared by two processes (a backbone forked copy-on-write, a library) twice; PSS is what
    the processes together hold."""

    def __init__(self, interval: float = 0.1, pss: bool = False):
        self.interval, self.peak, self.peak_pss, self._stop = interval, 0, 0, threading.Event()
        self.pss = pss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = shared = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    if self.pss:
                        full = p.memory_full_info()  # (reads /proc/PID/smaps_rollup)
                        total, shared = total + full.rss, shared + full.pss
                    else:
                        total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak, self.peak_pss = max(self.peak, total), max(self.peak_pss, shared)
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
