"""The run: its server, its files, evaluations and checkpoints, driven by a schedule (synchronous rounds,
fedpeft.runtime.synchronous; buffered asynchronous aggregation, fedpeft.runtime.asynchronous) over a transport
(fedpeft.runtime.transport). With the default transport, every client and the server are in one process over one
shared backbone (the embedded runtime, fedpeft.runtime.inprocess); a Flower ServerApp runs the same class over
Flower's Grid (fedpeft.runtime.flower.server_app).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpeft import algorithms, checkpoint, tracking, wire
from fedpeft.algorithms.base import ClientAlgorithm
from fedpeft.config import ConfigError, RunConfig
from fedpeft.durable import is_refused_write, publish_dir, refused_write, staging_dir
from fedpeft.errors import UserError
from fedpeft.metrics.accounting import better_or_equal, metric_key, summarize
from fedpeft.metrics.scores import one_class_advice, one_class_label
from fedpeft.models import bnb_gate
from fedpeft.observer import RunObserver
from fedpeft.rundir import (
    CLIENT_ADAPTERS,
    RunWriter,
    check_run_dir_free,
    config_digest_of,
    new_run_dir,
    remove_leftovers,
    resume_hint,
    rewrite_metrics,
)
from fedpeft.runlock import RunLock
from fedpeft.runtime.asynchronous import BufferedAsync
from fedpeft.runtime.attacks import attacker_ids
from fedpeft.runtime.inprocess import InProcessTransport
from fedpeft.runtime.outcome import RoundOutcome
from fedpeft.runtime.payload_limits import upload_limit
from fedpeft.runtime.personal import personal_row
from fedpeft.runtime.progress import RoundProgress
from fedpeft.runtime.realtime_async import RealTimeBufferedAsync
from fedpeft.runtime.resume import resume_config, resume_point
from fedpeft.runtime.setup import Experiment, build_experiment
from fedpeft.runtime.simclock import SimulatedSystem
from fedpeft.runtime.synchronous import SynchronousRounds
from fedpeft.runtime.transport import Transport
from fedpeft.runtime.workers import WorkerPoolTransport
from fedpeft.training.evaluate import PREDICTIONS, evaluate

log = logging.getLogger("fedpeft")
TIMING_KEYS = ("time_client_s", "time_aggregation_s", "time_evaluation_s", "time_overhead_s", "time_round_s", "wall_s",
               "time_schedule_s")
LAST_ADAPTER, BEST_ADAPTER = "adapter", "best_adapter"
ONE_CLASS = "predicts_one_class"  # a row's note that the scored model predicts (nearly) one class (metrics.scores)
TRAINER_COUNTERS = ("flops_measured", "flops_tokens", "flops_steps")
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_accelerator_mb(device: torch.device) -> float | None:
    """Peak memory allocated on the CUDA device so far (None elsewhere)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def backbone_bytes(tuned) -> int:
    """Bytes of the backbone's parameters, buffers and quantization constants as they are held (quantized layers at
    their packed size), the PEFT method's own tensors included."""
    from fedpeft.metrics.memory import held_bytes

    module = tuned.module
    return held_bytes(module.get_base_model() if hasattr(module, "get_base_model") else module)


def _total_or_unknown(values) -> float | None:
    """The sum, or None (unknown) when any client could not count its part."""
    values = list(values)
    return None if any(v is None for v in values) else sum(float(v) for v in values)


def _check_personal_state(cfg: RunConfig) -> None:
    """eval.save_client_adapters needs the client half to assemble each client's model (before anything loads)."""
    client = algorithms.registered_algorithm(cfg.algorithm.name).client(cfg.algorithm)  # (its own, unwrapped)
    if getattr(type(client), "personal_state", None) is ClientAlgorithm.personal_state:
        raise UserError(f"eval.save_client_adapters: algorithm {cfg.algorithm.name} declares personal_models but its "
                        f"client half ({type(client).__name__}) does not override ClientAlgorithm.personal_state, "
                        "which assembles a client's own model; override it, or remove eval.save_client_adapters")


class EmbeddedRuntime:
    """A run: its server, its files, its evaluations and checkpoints. Its schedule (synchronous rounds, or buffered
    asynchronous aggregation under federation.asynchronous) decides who trains from which global version and when
    updates are aggregated; its transport (fedpeft.runtime.transport: in this process by default, or Flower's
    Grid) trains the clients."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None, *, experiment: Experiment | None = None,
                 resume: bool = False, lock: bool = True, observers: Sequence[RunObserver] = (),
                 transport: Transport | None = None):
        """A new run (in a new directory, created once the data and model have loaded), or with ``resume`` the
        run in ``run_dir`` continued with ``cfg`` (its saved config, where only federation.rounds may differ).
        ``lock``: hold RUN_DIR's lock while writing (fedpeft.runlock); a launcher that holds it for us passes
        False. ``observers``: fedpeft.RunObserver instances that watch the run. ``transport``: where the clients
        train (default: in this process, fedpeft.runtime.inprocess)."""
        self.cfg = cfg
        self.experiment_given = experiment is not None  # (spawned workers build their own from the config)
        if transport is not None and cfg.runtime.workers != 1 and not isinstance(transport, WorkerPoolTransport):
            raise ConfigError(f"runtime.workers {cfg.runtime.workers} with a transport of its own "
                              f"({type(transport).__name__}), which decides where the clients train: set "
                              "runtime.workers: 1 or leave out transport=")
        self.transport: Transport = transport if transport is not None else (
            WorkerPoolTransport(cfg.runtime.workers) if cfg.runtime.workers != 1 else InProcessTransport())
        if cfg.eval.save_client_adapters:
            _check_personal_state(cfg)
        self.observers = list(observers)
        self.lock: RunLock | None = None
        self.writer: RunWriter | None = None
        self.trackers: list[tracking.Tracker] = []
        try:
            self._open(run_dir, experiment, resume, lock)
        except BaseException:
            self.close()
            raise

    def _open(self, run_dir: str | Path | None, experiment: Experiment | None, resume: bool, lock: bool) -> None:
        cfg = self.cfg
        restored: tuple[int, dict[str, Any]] | None = None
        kept: list[dict[str, Any]] = []
        cleaned: list[str] = []
        if resume:
            self.run_dir = Path(run_dir)  # type: ignore[arg-type]
            self.lock = RunLock.acquire(self.run_dir) if lock else None  # before reading or rewriting anything
            cleaned = remove_leftovers(self.run_dir)  # an adapter's replacement cut off is put back first
            restored, kept = resume_point(self.run_dir, cfg.federation.rounds)
        else:
            check_run_dir_free(run_dir)  # before the slow part
        tracking.check_available(cfg.runtime.loggers)  # a missing extra is refused before the slow part too
        self.exp = experiment or build_experiment(cfg)
        if not resume:
            self.run_dir = new_run_dir(cfg, run_dir)
            self.lock = RunLock.acquire(self.run_dir) if lock else None
            check_run_dir_free(run_dir)  # another process may have started one meanwhile
            cleaned = remove_leftovers(self.run_dir)
        self.config_digest = config_digest_of(cfg)  # recorded in every checkpoint: a resume checks config.yaml
        self.server = algorithms.make_server(
            cfg.algorithm, self.exp.tuned.state(), num_clients=cfg.federation.num_clients,
            clients_per_round=cfg.system.selected(cfg.federation.clients_per_round), seed=cfg.seed, layout=self.exp.layout, client_lr=cfg.train.lr,
            server_model=self.exp.server_model,
        )
        self.client = algorithms.make_client(cfg.algorithm)
        self.client_states: dict[int, dict[str, Any]] = {}
        self.attackers = attacker_ids(cfg)
        self.max_payload = upload_limit(cfg, self.server.global_state)
        self.rows: list[dict[str, Any]] = kept
        self.cum_up = self.cum_down = 0
        self.metric = cfg.primary_metric()
        # no single adapter is the method's model when each client keeps its own part (personal_models)
        self.keeps_best = cfg.eval.save_best and type(cfg.algorithm).personal_models is None
        self.start_round = 1
        self.wall_offset = 0.0  # wall seconds already spent before a resume
        self.stopped_early: str | None = None  # why the run ended before federation.rounds (server.stop_reason)
        self.one_class_warned = False  # whether a round's one-class model was warned of (later ones: events.log)
        # the virtual clock and the clients' devices (system)
        self.system = SimulatedSystem(cfg, decides_rounds=not self.transport.rounds_in_real_time)
        # client -> why, in the round run now, and of those the over-selected clients not waited for: filled by a
        # transport whose rounds_in_real_time
        self.dropped_in_real_time: dict[int, str] = {}
        self.surplus_in_real_time: set[int] = set()
        self.schedule: SynchronousRounds | BufferedAsync = SynchronousRounds(self)
        if cfg.federation.asynchronous is not None:  # on the simulated clock, or on the wall clock (Flower)
            self.schedule = RealTimeBufferedAsync(self) if self.transport.rounds_in_real_time else BufferedAsync(self)
        if restored is not None:
            self._restore(*restored)
        if resume:  # only now that the checkpoint has loaded: a failure above leaves the directory as it was
            rewrite_metrics(self.run_dir, kept)  # rounds after the checkpoint are run again
            (self.run_dir / "summary.json").unlink(missing_ok=True)  # an extended run writes it again at the end
            self._drop_best_after(restored[0] if restored is not None else 0)
        self.writer = RunWriter(self.run_dir, cfg)  # events.log: logged from here on
        for line in cleaned:
            self.writer.note(line)
        self.trackers = tracking.open_trackers(cfg, self.run_dir, resume=resume, start_round=self.start_round)
        self.observers += self.trackers
        self.writer.partition(self.exp.partition_stats)
        self.writer.note(self.system.describe())
        if cfg.federation.attackers is not None:
            self.writer.note(f"simulated attackers ({cfg.federation.attackers.attack}): clients {sorted(self.attackers)}")
        t = cfg.train
        self.backbone_bytes = backbone_bytes(self.exp.tuned)
        self.writer.note(f"local training: batches of {t.batch_size} x {t.gradient_accumulation_steps} accumulated = "
                         f"effective batch {t.batch_size * t.gradient_accumulation_steps} per optimizer step; "
                         f"gradient checkpointing {'on' if t.gradient_checkpointing else 'off'}; backbone "
                         f"{self.backbone_bytes / 2**20:.1f} MiB ({cfg.model.dtype}"
                         + (f", quantized {cfg.model.quantization.described()}" if cfg.model.quantization else "")
                         + ")")
        self.progress = RoundProgress(cfg.federation.rounds, self.writer.note)  # run() adds the bar
        self.transport.bind(self, restored[1] if restored is not None else None)
        if cfg.runtime.clients_per_pass != 1 and not self.transport.fuses_clients:
            log.warning("runtime.clients_per_pass %s applies to the embedded runtime; runtime %s trains one client "
                        "per message", cfg.runtime.clients_per_pass, cfg.runtime.name)
        if restored is not None:
            log.warning("resumed %s after round %d (checkpoint %s)", self.run_dir, restored[0], checkpoint.FILENAME)
        self.transport.start()

    def _drop_best_after(self, rnd: int) -> None:
        """Forget a best adapter saved after round ``rnd`` (those rounds run again and may save it again), or any
        when the run keeps none (an older fedpeft kept one by the global score of a personal-models run)."""
        meta_path = self.run_dir / BEST_ADAPTER / "fedpeft_adapter.json"
        if not meta_path.is_file():
            return
        if type(self.cfg.algorithm).personal_models is not None:
            log.warning("%s/%s dropped: %s keeps no best adapter (its model is each client's own)", self.run_dir,
                        BEST_ADAPTER, self.cfg.algorithm.name)
            self._remove_best()
            return
        try:
            saved_round = int(json.loads(meta_path.read_text(encoding="utf-8")).get("round", 0))
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            log.warning("%s is unreadable (%s): the best adapter is left as it is (fedpeft eval refuses it)",
                        meta_path, exc)
            return
        if saved_round > rnd:
            log.warning("%s/%s was saved after the checkpoint of round %d: dropped (the rounds after it run again "
                        "and save it again when they are still the best)", self.run_dir, BEST_ADAPTER, rnd)
            self._remove_best()

    def _remove_best(self) -> None:
        dropped = self.run_dir / f".{BEST_ADAPTER}.dropped"  # renamed away at once, removed at leisure
        shutil.rmtree(dropped, ignore_errors=True)
        os.rename(self.run_dir / BEST_ADAPTER, dropped)
        shutil.rmtree(dropped)

    def close(self) -> None:
        """Close the run's files and give up its directory's lock (the end of :meth:`run` does; safe to call
        twice)."""
        self.transport.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 (any backend failure: it must not hide the run's own outcome)
                log.warning("closing the %s tracker failed: %s", tracker.name, exc)
        if self.writer is not None:
            self.writer.close()
        if self.lock is not None:
            self.lock.release()
        bnb_gate.restore()  # hidden for a run that does not quantize; the process is the caller's again

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        trainer = self.exp.trainer
        return {
            "server": self.server.state_dict(),
            "clients": self.client_states,
            "cum_bytes_up": self.cum_up,
            "cum_bytes_down": self.cum_down,
            "wall_s": self.rows[-1].get("wall_s", 0.0) if self.rows else 0.0,
            "trainer": {k: getattr(trainer, k) for k in TRAINER_COUNTERS},
            "system": self.system.state(),
            **({"asynchronous": schedule} if (schedule := self.schedule.state()) is not None else {}),
            "config_sha256": self.config_digest,  # fedpeft.runtime.resume.check_config_unchanged
            **self.transport.state(),
        }

    def _restore(self, rnd: int, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state["server"])
        self.client_states = {int(c): s for c, s in state["clients"].items()}
        self.cum_up, self.cum_down = int(state["cum_bytes_up"]), int(state["cum_bytes_down"])
        self.wall_offset = float(state["wall_s"])
        for k, v in state["trainer"].items():
            setattr(self.exp.trainer, k, v)
        if "system" in state:
            self.system.load_state(state["system"])
        else:
            log.warning("the checkpoint of round %d is from a fedpeft without the simulated clock: the clock restarts "
                        "at 0 s, so sim_time_s counts the resumed rounds only", rnd)
        self.schedule.load_state(state.get("asynchronous"))
        self.start_round = rnd + 1

    @classmethod
    def resume(cls, run_dir: str | Path, *, rounds: int | None = None, allow_unsealed: bool = False,
               **kwargs: Any) -> EmbeddedRuntime:
        """Continue the run in RUN_DIR from its last checkpoint (from round 1 if it has none yet), with the config
        it was started with; ``rounds`` changes federation.rounds, which also extends a finished run;
        ``allow_unsealed`` as in fedpeft.resume."""
        return cls(resume_config(run_dir, rounds, allow_unsealed=allow_unsealed), run_dir, resume=True, **kwargs)

    # -- pieces of a round -------------------------------------------------------------------------
    def evaluate_global(self) -> dict[str, Any]:
        exp = self.exp
        exp.tuned.load_state(self.server.global_state)
        result = evaluate(
            exp.tuned.module, exp.data, tokenizer=exp.tokenizer, device=exp.device, batch_size=self.cfg.eval.batch_size,
            encoder_decoder=exp.encoder_decoder, max_new_tokens=self.cfg.task.generation_max_new_tokens,
            precision=self.cfg.runtime.precision,
        )
        out = {}
        for k, v in result.items():
            if k == "_examples":
                out["eval_samples"] = v
            elif k == PREDICTIONS:
                continue  # per-example predictions are not a round metric (fedpeft eval writes them)
            else:
                out[k if k.startswith("eval_") else f"eval_{k}"] = v
        if exp.data.task_type in ("classification", "image_classification"):
            found = one_class_label(result[PREDICTIONS], exp.data.eval.labels, exp.data.label_names)
            if found is not None:
                out[ONE_CLASS] = {"class": found[0], "share": found[1], "rows": len(result[PREDICTIONS])}
        return out

    def run_round(self, rnd: int, wall_start: float) -> dict[str, Any]:
        """One round of the schedule (synchronous: a round; asynchronous: one aggregation) and its metrics row."""
        t0 = time.perf_counter()
        out = RoundOutcome()
        own = self.schedule.step(rnd, out)
        row: dict[str, Any] = {"round": rnd, "clients": own.pop("clients")}
        return self.round_row(rnd, row, out, own, t0, wall_start)

    def round_row(self, rnd: int, row: dict[str, Any], out: RoundOutcome, timing: dict[str, Any], t0: float,
                  wall_start: float) -> dict[str, Any]:
        """The metrics row of round (or aggregation) ``rnd`` from what its clients' work amounted to; ``timing``: its
        simulated time (and the schedule's own entries)."""
        selected = row["clients"]
        if self.cfg.federation.attackers is not None:
            row["adversarial_clients"] = [c for c in selected if c in self.attackers]
        if out.failed is not None:
            row["round_failed"] = f"{out.failed}: the global model is unchanged"
            log.warning("round %d failed: %s", rnd, row["round_failed"])
        metas, bytes_down, bytes_up = out.metas, out.bytes_down, out.bytes_up
        reported = [m for m in metas.values() if m.get("train_loss") is not None]
        if reported:
            n = np.array([m["num_examples"] for m in reported], dtype=np.float64)
            losses = np.array([m["train_loss"] for m in reported], dtype=np.float64)
            row["train_loss"] = float((n * losses).sum() / n.sum())
        row["client_train_loss"] = {str(c): m.get("train_loss") for c, m in metas.items()}
        row["client_num_examples"] = {str(c): m["num_examples"] for c, m in metas.items()}
        row.update(personal_row(metas))
        row.update({f"agg_{k}": v for k, v in out.agg.items()})
        row.update(self.server.round_info())
        self.cum_up += sum(bytes_up.values())
        self.cum_down += sum(bytes_down.values())
        row.update({
            "bytes_down": {str(c): b for c, b in bytes_down.items()},
            "bytes_up": {str(c): b for c, b in bytes_up.items()},
            "bytes_down_total": sum(bytes_down.values()),
            "bytes_up_total": sum(bytes_up.values()),
            "cum_bytes_up": self.cum_up,
            "cum_bytes_down": self.cum_down,
            "cum_bytes": self.cum_up + self.cum_down,
            "flops": sum(wire.clock_seconds(m, "train_flops") or 0.0 for m in metas.values()) or None,
            "ops_analytic": _total_or_unknown(m.get("train_ops_analytic", 0.0) for m in metas.values()),
            "client_flops": {str(c): wire.clock_seconds(m, "train_flops") for c, m in metas.items()},
            "client_ops_analytic": {str(c): m.get("train_ops_analytic") for c, m in metas.items()},
            "client_train_seconds": {str(c): wire.clock_seconds(m, "train_seconds") for c, m in metas.items()},
            "rejected": {str(c): r for c, r in out.rejected.items()},
        })
        row.update(timing)
        t_eval = 0.0
        if self._eval_due(rnd):
            te = time.perf_counter()
            evaluation = self.evaluate_global()
            self.server.observe_evaluation(rnd, evaluation)
            row.update(evaluation)
            t_eval = time.perf_counter() - te
        t_round = time.perf_counter() - t0
        t_client, t_agg = out.time_client_s, out.time_aggregation_s
        row.update({
            "time_client_s": t_client,
            "time_aggregation_s": t_agg,
            "time_evaluation_s": t_eval,
            "time_overhead_s": max(0.0, t_round - t_client - t_agg - t_eval),
            "time_round_s": t_round,
            "wall_s": time.perf_counter() - wall_start,
        })
        row.update(self.memory_info())
        row.update(self.runtime_round_info())
        return row

    def memory_info(self) -> dict[str, Any]:
        """The memory figures of a metrics row: this process's peak RSS so far (a Flower run's: the
        ServerApp's), the backbone's bytes and, on CUDA, the peak allocated accelerator memory."""
        out: dict[str, Any] = {"peak_rss_mb": peak_rss_mb(), "backbone_bytes": self.backbone_bytes}
        accelerator = peak_accelerator_mb(self.exp.device)
        if accelerator is not None:
            out["peak_accelerator_mb"] = accelerator
        return out

    def runtime_round_info(self) -> dict[str, Any]:
        """Extra per-round entries the transport reports about itself (e.g. client process times; the fused passes'
        padded-token shares)."""
        return self.transport.round_info()

    def _eval_due(self, rnd: int) -> bool:
        """Every eval.every rounds, and after the last round (the configured last, or one the algorithm ends
        the run after, e.g. when the privacy budget is spent)."""
        every = self.cfg.eval.every
        last = rnd == self.cfg.federation.rounds or self.server.stop_reason() is not None
        return last or (every > 0 and rnd % every == 0)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall_start = time.perf_counter() - self.wall_offset
        target = cfg.eval.target
        key = metric_key(self.metric)
        bar = None
        if cfg.runtime.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.federation.rounds, initial=self.start_round - 1, desc=cfg.name, unit="round",
                       dynamic_ncols=True)
        self.progress = self.round_progress(bar)
        self.exp.trainer.on_step = self.progress.step
        every = cfg.runtime.checkpoint_every
        summary: dict[str, Any] | None = None
        quiet_console = contextlib.ExitStack()
        if bar is not None:  # log lines printed above the bar, not through it
            from tqdm.contrib.logging import logging_redirect_tqdm

            quiet_console.enter_context(logging_redirect_tqdm())
        try:
            if cfg.eval.at_start and self.start_round == 1:
                te = time.perf_counter()
                row = {"round": 0, **self.evaluate_global()}
                self.server.observe_evaluation(0, row)
                t_eval = time.perf_counter() - te
                row.update({"time_evaluation_s": t_eval, "wall_s": time.perf_counter() - wall_start,
                            "cum_bytes": 0, "cum_bytes_up": 0, "cum_bytes_down": 0, "sim_time_s": 0.0,
                            **self.memory_info()})
                self._record(row, key, target)
            for rnd in range(self.start_round, cfg.federation.rounds + 1):
                stop = self.server.stop_reason()
                if stop is not None:
                    log.warning("run ends before round %d: %s", rnd, stop)
                    self.stopped_early = stop
                    break
                row = self.run_round(rnd, wall_start)
                self._record(row, key, target)
                last = rnd == cfg.federation.rounds or self.server.stop_reason() is not None
                if every and (rnd % every == 0 or last):
                    checkpoint.save(self.run_dir, rnd, self.checkpoint_state())
                post = {"loss": f"{row.get('train_loss', float('nan')):.3f}", "MiB": f"{row['cum_bytes'] / 2**20:.1f}"}
                if row.get(key) is not None:
                    post[self.metric] = f"{row[key]:.4f}"
                self.progress.round_ended(post)
            summary = self.finish()
        finally:
            self.exp.trainer.on_step = None
            quiet_console.close()
            if bar is not None:
                bar.close()
            self.close()
        return summary

    def round_progress(self, bar: Any) -> RoundProgress:
        """Progress inside a round: on ``bar`` (None without runtime.progress) and in events.log, unless the
        transport has its own (a Flower ServerApp's: log lines the launcher follows)."""
        return self.transport.round_progress(bar) or RoundProgress(self.cfg.federation.rounds, self.writer.note, bar)

    def _warn_one_class(self, row: dict[str, Any], key: str) -> None:
        """A round whose model predicts (nearly) one class: the first one warned of, later ones in events.log."""
        found = row.get(ONE_CLASS)
        if found is None:
            return
        what = (f"round {row['round']}: the global model predicts {found['class']!r} for {found['share']:.0%} of "
                f"the {found['rows']} eval rows, while the data has several classes")
        if self.one_class_warned or row["round"] == 0:  # (an untrained head often does at round 0)
            self.writer.note(what)
            return
        self.one_class_warned = True
        score = f" ({self.metric} {row[key]:.4f})" if row.get(key) is not None else ""
        log.warning("%s%s: %s", what, score, one_class_advice(self.metric))

    def _record(self, row: dict[str, Any], key: str, target: float | None) -> None:
        self._warn_one_class(row, key)
        if key in row and target is not None:
            row["reached_target"] = better_or_equal(self.metric, row[key], target)
        if key in row and not math.isfinite(row[key]):
            log.warning("round %d: %s is not finite", row["round"], key)
        if key in row and self.keeps_best and self._is_best(row[key]):
            self._save_adapter(BEST_ADAPTER, {"round": row["round"], key: row[key]})
        self.rows.append(row)
        self.writer.row(row)
        for observer in self.observers:
            observer.on_round_end(row["round"], dict(row))

    def _is_best(self, value: float | None) -> bool:
        """Whether ``value`` beats every earlier evaluation of the primary metric (the first one wins a tie)."""
        if value is None or not math.isfinite(value):
            return False
        key = metric_key(self.metric)
        earlier = [r[key] for r in self.rows if r.get(key) is not None and math.isfinite(r[key])]
        lower = self.metric.endswith("loss")
        return not earlier or (value < min(earlier) if lower else value > max(earlier))

    def _save_adapter(self, name: str, extra: dict[str, Any] | None = None, state: Any = None) -> None:
        """The global state (or ``state``) as RUN_DIR/``name``: written aside (``.NAME.new``), fsynced, then swapped
        in (fedpeft.durable.publish_dir). A refused write removes what was staged and leaves the old one."""
        exp = self.exp
        exp.tuned.load_state(self.server.global_state if state is None else state)
        final = self.run_dir / name
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_dir(final)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            exp.tuned.save_adapter(staging, base_model=self.cfg.model.name,
                                   extra={"num_labels": exp.data.num_labels, "label_names": exp.data.label_names,
                                          "label_kind": exp.data.label_kind, "template": exp.data.template,
                                          "seed": self.cfg.seed, "dtype": self.cfg.model.dtype,
                                          "incomplete": type(self.cfg.algorithm).adapter_incomplete,
                                          "plugins": self.cfg.plugins,
                                          "attn_implementation": self.cfg.model.attn_implementation,
                                          "quantization": (self.cfg.model.quantization.described()
                                                           if self.cfg.model.quantization is not None else None),
                                          **(extra or {})})
            publish_dir(staging, final)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if is_refused_write(exc):
                raise refused_write(final, exc, needed=self._adapter_size(), then=resume_hint(self.run_dir)) from None
            raise

    def _save_client_adapters(self, rnd: int) -> None:
        """eval.save_client_adapters: every client's own model (ClientAlgorithm.personal_state: the global part with
        what the client kept) as RUN_DIR/client_adapters/<id>; a client that never trained gets the global model,
        marked ``trained: false``."""
        for cid in range(self.cfg.federation.num_clients):
            own = self.client.personal_state(self.server.global_state, self.client_states.get(cid, {}))
            self._save_adapter(f"{CLIENT_ADAPTERS}/{cid}", {"round": rnd, "client": cid, "trained": own is not None},
                               state=own)

    def _adapter_size(self) -> int:
        """Bytes an adapter directory takes: as much as one already saved, else about its tensors' bytes."""
        for name in (LAST_ADAPTER, BEST_ADAPTER):
            saved = [p.stat().st_size for p in (self.run_dir / name).glob("*") if p.is_file()]
            if saved:
                return sum(saved)
        return sum(p.numel() * p.element_size() for p in self.exp.tuned.params.values())

    def finish(self) -> dict[str, Any]:
        exp = self.exp
        summary = summarize(self.rows, metric=self.metric, target=self.cfg.eval.target)
        best = next((r for r in self.rows if r["round"] == summary.get("best_round")), {})
        if self.keeps_best and best.get(ONE_CLASS) is not None:
            found = best[ONE_CLASS]
            summary["best_" + ONE_CLASS] = found
            log.warning("%s (round %d, %s %s) predicts %r for %.0f%% of the eval rows: %s", BEST_ADAPTER,
                        best["round"], self.metric, summary["best"], found["class"], 100 * found["share"],
                        one_class_advice(self.metric))
        self._save_adapter(LAST_ADAPTER, {"round": summary.get("rounds", 0)})
        if self.cfg.eval.save_client_adapters:
            self._save_client_adapters(summary.get("rounds", 0))
        for row in reversed(self.rows):  # privacy spent by the whole run (differential privacy only)
            if "dp_epsilon" in row:
                summary.update({k: row[k] for k in ("dp_epsilon", "dp_delta", "dp_releases")})
                break
        summary.update({
            "name": self.cfg.name,
            "run_dir": str(self.run_dir),
            "model": self.cfg.model.name,
            "peft_method": self.cfg.peft.method,
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.task.dataset,
            "num_clients": self.cfg.federation.num_clients,
            "clients_per_round": self.cfg.federation.clients_per_round,
            "trainable_parameters": exp.tuned.num_trainable(),
            "total_parameters": exp.tuned.num_total(),
            "peak_rss_mb": peak_rss_mb(),
            "peak_accelerator_mb": peak_accelerator_mb(exp.device),
            "backbone_bytes": self.backbone_bytes,
            "trainable_bytes": sum(p.numel() * p.element_size() for p in exp.tuned.params.values()),
            "effective_batch_size": self.cfg.train.batch_size * self.cfg.train.gradient_accumulation_steps,
            "device": str(exp.device),
            "torch_threads": torch.get_num_threads(),
            "adapter": LAST_ADAPTER,
            "best_adapter": BEST_ADAPTER if self.keeps_best and (self.run_dir / BEST_ADAPTER).is_dir() else None,
            "personal_models": type(self.cfg.algorithm).personal_models,
            "client_adapters": CLIENT_ADAPTERS if self.cfg.eval.save_client_adapters else None,
            "stopped_early": self.stopped_early,
        })
        if self.cfg.federation.attackers is not None:
            summary["adversarial_clients"] = sorted(self.attackers)
        self.writer.summary(summary)
        for observer in self.observers:
            observer.on_run_end(dict(summary))
        return summary


def run(cfg: RunConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    return EmbeddedRuntime(cfg, run_dir).run()


def resume(run_dir: str | Path, *, allow_unsealed: bool = False) -> dict[str, Any]:
    return EmbeddedRuntime.resume(run_dir, allow_unsealed=allow_unsealed).run()


def launch(cfg: RunConfig, run_dir: str | Path | None, *, resume: bool, observers: Sequence[RunObserver],
           log: Callable[[str], None] | None, on_run_dir: Callable[[Path], None] | None) -> dict[str, Any]:
    """The embedded runtime's launch (``runtime.name: embedded``, see :class:`fedpeft.launchers.Launch`): every
    client in this process; the run directory is named on ``log`` once it exists (none by default)."""
    runtime = EmbeddedRuntime(cfg, run_dir, resume=resume, observers=observers)
    if on_run_dir is not None:
        on_run_dir(runtime.run_dir)
    if log is not None:
        log(f"run directory: {runtime.run_dir}")
    return runtime.run()
