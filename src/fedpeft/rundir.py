"""The run directory: everything a run leaves behind, written as it goes.

::

    RUN_DIR/
      config.yaml        resolved configuration (every option, defaults included)
      partition.json     client sizes and label histograms
      metrics.jsonl      one JSON row per round (round 0 = initial evaluation)
      events.log         warnings and rejected updates
      summary.json       final / best metrics, rounds and time to target, totals
      checkpoint.safetensors  server state after the last completed round (fedpeft.checkpoint)
      adapter/           the final global adapter (HF PEFT format for peft-backed methods)
      best_adapter/      the global adapter of the best evaluated round (eval.save_best)
      client_adapters/   each client's own model, client_adapters/<id> (eval.save_client_adapters)
      .fedpeft.lock      held by the process writing the directory (fedpeft.runlock)
      plots/             metric vs round, metric vs cumulative MB

Every file is written whole (fedpeft.durable: a temporary file, fsync, rename; an adapter directory is
staged as ``.NAME.new`` and swapped in), except the two logs, which are only appended to: a metrics row is
appended, flushed and fsynced before the round's checkpoint is written (a row cut off by a crash is left
out by :func:`read_metrics`, and a resume rewrites the file whole), and events.log gets one line per event.
config.yaml starts with its SHA-256 (fedpeft.integrity), so a resume refuses a saved config that was cut
short, damaged or edited. What a killed write leaves (``.NAME.<pid>.tmp``, ``.NAME.new``, ``.NAME.old``) is
removed by :func:`remove_leftovers` when the run next opens its directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedpeft.config import ConfigError, RunConfig, dump_config
from fedpeft.config.load import read_yaml
from fedpeft.durable import (
    append_line,
    atomic_write,
    fsync_dir,
    is_refused_write,
    open_log,
    pid_alive,
    refused_write,
)
from fedpeft.errors import unprintable
from fedpeft.integrity import PLACEHOLDER, seal, seal_matches, unsealed_refusal

CONFIG_FILE = "config.yaml"
# config.yaml's first line: its own SHA-256 (with these 64 digits zeroed), checked when the run resumes
CONFIG_SEAL = "# sha256 {digest}: fedpeft's checksum of this file (a resume refuses a changed file)\n"
CONFIG_SEAL_LINE = re.compile(rb"# sha256 ([0-9a-f]{64}):")
# the files written whole at the top of a run directory (the runtimes', the checkpoint's, the trackers', the lock's)
# and the adapter directories: only their leftovers are removed there (a run may share a directory with others)
RUN_FILES = ("config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint.safetensors",
             "tracking.json", ".fedpeft.owner.json")
LEFTOVER_FILE = re.compile(r"^\.(.+)\.(\d+)\.tmp$")  # fedpeft.durable.temp_name: .NAME.<pid>.tmp
LEFTOVER_DIR = re.compile(r"^\.(adapter|best_adapter)\.(new|old|dropped)$")  # fedpeft.durable.publish_dir
CLIENT_ADAPTERS = "client_adapters"  # eval.save_client_adapters: CLIENT_ADAPTERS/<id>, each client's own model
LEFTOVER_CLIENT_DIR = re.compile(r"^\.(\d+)\.(new|old)$")  # the same, in client_adapters/
log = logging.getLogger("fedpeft")


def holds_run(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "config.yaml").exists()


def check_printable_path(path: str | Path, what: str = "run directory") -> None:
    """Refuse a path holding a control character or a line separator (a newline would split every line that
    prints it: the run's messages, events.log, a shell's `fedpeft run --resume` line)."""
    text = str(path)
    bad = unprintable(text)
    if bad is not None:
        raise ConfigError(f"{what} {text!r} holds the unprintable character {bad!r} (a control or format character) at position {text.index(bad) + 1}; "
                          "choose a path of printable characters")


def check_run_dir_free(run_dir: str | Path | None) -> None:
    """Refuse, before any work, a chosen run directory that already holds a run (a new run would mix with it) or
    whose path holds a control character."""
    if run_dir is not None:
        check_printable_path(run_dir)
    if run_dir is not None and holds_run(Path(run_dir)):
        raise FileExistsError(f"run directory {str(run_dir)!r} already holds a run; continue it with fedpeft run "
                              f"--resume {run_dir} (it restarts from round 1 when it has no checkpoint yet), or "
                              "choose another --run-dir")


def new_run_dir(cfg: RunConfig, run_dir: str | Path | None = None) -> Path:
    """Create the run directory (OUTPUT_DIR/NAME-TIMESTAMP unless given). Called once the run's data and model
    have loaded, so that a run refused on its inputs leaves no directory behind."""
    check_run_dir_free(run_dir)
    if run_dir is not None:
        path = Path(run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}-{suffix}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if is_refused_write(exc):
            raise refused_write(path, exc, then="start the run again (or choose another --run-dir or "
                                "output_dir)") from None
        raise
    return path


def resume_hint(run_dir: Path) -> str:
    """What to do once a refused write's cause is fixed: continue the run (or start it, if it holds none)."""
    if (run_dir / CONFIG_FILE).is_file():
        return f"continue with: fedpeft run --resume {run_dir}"
    return "start the run again (the directory holds no run yet)"


def _alive_elsewhere(pid: int) -> bool:
    """Whether another process with this id is running (its temporary file may be a write in progress)."""
    return pid != os.getpid() and pid_alive(pid)


def remove_leftovers(run_dir: Path) -> list[str]:
    """Remove what killed or failed writes left in ``run_dir``: the temporary files ``.NAME.<pid>.tmp`` of the
    run's files (:data:`RUN_FILES`; any in plots/ and eval/) and the directories of an adapter's replacement,
    ``.NAME.new`` / ``.NAME.old`` / ``.NAME.dropped``; an adapter replaced up to the point where only
    ``.NAME.old`` holds it is put back first. Call it holding the run's lock. Returns one line per thing
    done, for events.log."""
    done = []
    for folder in (run_dir, run_dir / "plots", run_dir / "eval"):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            match = LEFTOVER_FILE.match(entry.name)
            if not (entry.is_file() and match and (folder != run_dir or match.group(1) in RUN_FILES)):
                continue
            if folder != run_dir and _alive_elsewhere(int(match.group(2))):
                continue  # plots/ and eval/ are also written without the run's lock (fedpeft eval): still in use
            size = entry.stat().st_size
            entry.unlink()
            done.append(f"removed the temporary file {entry} ({size} bytes) left by a write that did not finish")
    clients = run_dir / CLIENT_ADAPTERS
    for folder, pattern in ((run_dir, LEFTOVER_DIR), (clients, LEFTOVER_CLIENT_DIR)):
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            match = pattern.match(entry.name)
            if not (entry.is_dir() and match):
                continue
            final = folder / match.group(1)
            if match.group(2) == "old" and not final.exists():
                os.rename(entry, final)
                fsync_dir(folder)
                done.append(f"put {entry.name} back as {final.name}: its replacement was cut off before it was in "
                            "place")
                continue
            shutil.rmtree(entry)
            done.append(f"removed {entry}, left by a replacement of {final.name} that did not finish")
    return done


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN / infinite floats as None (JSON null) and numpy scalars and arrays as Python numbers
    and lists, in nested dicts, lists and tuples too: what strict JSON can hold."""
    if isinstance(obj, (np.ndarray, np.generic)):
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (no NaN / Infinity tokens, which are not JSON): non-finite numbers are written as null."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any, *, then: str = "try again") -> None:
    atomic_write(path, to_json(obj, indent=2).encode(), then=then)


def sealed_config(cfg: RunConfig) -> bytes:
    """config.yaml's bytes: every option (dump_config) under a first line holding the file's SHA-256."""
    data = (CONFIG_SEAL.format(digest=PLACEHOLDER) + dump_config(cfg)).encode("utf-8")
    return seal(data, 0, data.index(b"\n"))


def config_digest(raw: dict[str, Any]) -> str:
    """SHA-256 of a saved config's settings (the parsed YAML), federation.rounds left out: the one setting a
    resume may change. Recorded in every checkpoint; a resume refuses a config.yaml that differs."""
    settings = json.loads(json.dumps(raw, default=str))
    if isinstance(settings, dict) and isinstance(settings.get("federation"), dict):
        settings["federation"].pop("rounds", None)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_digest_of(cfg: RunConfig) -> str:
    return config_digest(yaml.safe_load(dump_config(cfg)))


def read_saved_config(run_dir: str | Path, *, allow_unsealed: bool = False) -> dict[str, Any]:
    """RUN_DIR/config.yaml as written (not validated), refused with a one-line ConfigError when it is empty,
    does not parse or does not match the checksum on its first line. A file without one (written by an older
    fedpeft or by hand, or stripped of it) is refused unless ``allow_unsealed``, and then still refused when it
    lacks a section fedpeft writes: a resume never runs on defaults for what the run saved."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no {CONFIG_FILE})")
    fix = (f"write it again from the config the run was started with (fedpeft config CONFIG [--set ...] > {path}) "
           "and resume with --allow-unsealed, or start a new run")
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"{path} is empty: the run's saved config is lost; {fix}")
    first_line = data.split(b"\n", 1)[0]
    sealed, seal_line = first_line.startswith(b"# sha256"), CONFIG_SEAL_LINE.match(first_line)
    if sealed and (seal_line is None or not seal_matches(data, seal_line.group(1).decode(), 0, len(first_line))):
        raise ConfigError(f"{path} does not match the checksum on its first line: it was cut short, damaged or "
                              f"edited since the run saved it; {fix}")
    if not sealed and not allow_unsealed:
        raise ConfigError(f"{unsealed_refusal(path, 'no # sha256 first line')}; or {fix}")
    try:
        raw = read_yaml(path)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the run's saved config); or {fix}") from None
    if raw is None:
        raise ConfigError(f"{path} holds no settings: the run's saved config is lost; {fix}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a mapping of sections (task:, model:, ...); {fix}")
    if not sealed:
        missing = [name for name in RunConfig.model_fields if name not in raw]
        if missing:
            raise ConfigError(f"{path} lacks {', '.join(missing)}, which fedpeft writes into every saved config: it "
                              f"was cut short or edited, and a resume would run on defaults there; {fix}")
        log.warning("%s has no checksum (allowed by allow_unsealed): used as it is", path)
    return raw


def seal_saved_config(run_dir: str | Path) -> bool:
    """Seal an unsealed RUN_DIR/config.yaml in place (its text kept, under the seal line), after the checks of
    :func:`read_saved_config` with ``allow_unsealed``; False if it was sealed already."""
    path = Path(run_dir) / CONFIG_FILE
    read_saved_config(run_dir, allow_unsealed=True)
    data = path.read_bytes()
    if data.startswith(b"# sha256"):
        return False
    text = (CONFIG_SEAL.format(digest=PLACEHOLDER)).encode("utf-8") + data
    atomic_write(path, seal(text, 0, text.index(b"\n")), then=resume_hint(Path(run_dir)))
    return True


class _EventsLog(logging.FileHandler):
    """events.log. A line the disk refuses is dropped without a traceback on the console: the next run file
    written (a metrics row, the checkpoint) fails with the one-line reason. Any other failure is logging's
    usual report."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not is_refused_write(sys.exc_info()[1]):
            super().handleError(record)


def _end_with_newline(path: Path) -> None:
    """Finish a last line a crash cut off, so that the next line starts on its own."""
    try:
        with open(path, "rb+") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except FileNotFoundError:
        pass


class RunWriter:
    def __init__(self, path: Path, cfg: RunConfig):
        self.path = path
        self._metrics: int | None = None
        self._handler: _EventsLog | None = None
        self._level: int | None = None  # the fedpeft logger's own level, while the run raises it to INFO
        self._showwarning = warnings.showwarning
        self.then = resume_hint(path)  # what to do after a refused write: start the run again, ...
        atomic_write(path / CONFIG_FILE, sealed_config(cfg), then=self.then)
        self.then = resume_hint(path)  # ... or, once config.yaml is there, continue it
        self._metrics = open_log(path / "metrics.jsonl", then=self.then)
        try:
            _end_with_newline(path / "events.log")
            self._handler = _EventsLog(path / "events.log", encoding="utf-8")
        except OSError as exc:
            self.close()
            if is_refused_write(exc):
                raise refused_write(path / "events.log", exc, then=self.then) from None
            raise
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger = logging.getLogger("fedpeft")
        logger.addHandler(self._handler)
        # the run's informational lines (what clients_per_pass auto measured, a chat format, ...) reach events.log,
        # and a console that shows INFO (the CLI's); a level the user set lower (DEBUG) stays
        if logger.getEffectiveLevel() > logging.INFO:
            self._level = logger.level
            logger.setLevel(logging.INFO)
        # Python warnings raised during the run (scikit-learn's undefined scores on a small slice, a library's
        # deprecations) are nothing a user of the run can act on: they go to events.log, not the console
        warnings.showwarning = self._warning_to_log

    def _warning_to_log(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                        file: Any = None, line: str | None = None) -> None:
        if self._handler is None:
            self._showwarning(message, category, filename, lineno, file, line)
            return
        text = f"{category.__name__} ({Path(filename).name}:{lineno}): {message}"
        self._handler.handle(logging.LogRecord("fedpeft", logging.WARNING, filename, lineno, text, None, None))

    def note(self, message: str) -> None:
        """An informational line in events.log, whatever the logging level."""
        record = logging.LogRecord("fedpeft", logging.INFO, __file__, 0, message, None, None)
        self._handler.handle(record)

    def partition(self, stats: dict[str, Any]) -> None:
        write_json(self.path / "partition.json", stats, then=self.then)

    def row(self, row: dict[str, Any]) -> None:
        """Append a row to metrics.jsonl, durably (before the round's checkpoint is written)."""
        # the row in memory keeps its floats; null on disk
        append_line(self._metrics, to_json(row) + "\n", self.path / "metrics.jsonl", then=self.then)

    def summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / "summary.json", summary, then=self.then)

    def close(self) -> None:
        """Close metrics.jsonl and events.log (safe to call twice)."""
        if self._metrics is not None:
            os.close(self._metrics)
            self._metrics = None
        if self._handler is not None:
            logger = logging.getLogger("fedpeft")
            logger.removeHandler(self._handler)
            if self._level is not None and logger.level == logging.INFO:  # (unless someone set another since)
                logger.setLevel(self._level)
            if warnings.showwarning == self._warning_to_log:  # (unless someone replaced it since)
                warnings.showwarning = self._showwarning
            self._handler.close()
            self._handler = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl. A last line without its newline that is not JSON is a row cut off by a
    crash: it is left out with a warning (a resumed run writes that round again). Files written before
    non-finite numbers were written as null hold NaN / Infinity tokens: they are read as None, as null is."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line, parse_constant=lambda _: None))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logging.getLogger("fedpeft").warning("%s: left out a last row cut off mid-write (%d characters)",
                                                     path, len(line))
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
    return rows


def rewrite_metrics(run_dir: str | Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with these rows, atomically (used when a run resumes from a checkpoint)."""
    atomic_write(Path(run_dir) / "metrics.jsonl", "".join(to_json(r) + "\n" for r in rows).encode(),
                 then=resume_hint(Path(run_dir)))


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}
