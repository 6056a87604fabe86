"""The embedded runtime: every client and the server in one process, over one shared backbone.

Each round, for every selected client: the server's payload is serialized and decoded (so the bytes
counted are the bytes a transport would carry), the client half loads it into the shared model,
trains on the client's partition and returns an update, which is serialized, decoded, checked and
aggregated by the server half. Memory does not grow with the number of clients: a client is an
index list into the tokenised training set plus whatever state its algorithm keeps.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpeft import algorithms, checkpoint, wire
from fedpeft.algorithms.base import ClientContext
from fedpeft.config import RunConfig, load_config
from fedpeft.metrics.accounting import better_or_equal, summarize
from fedpeft.rundir import RunWriter, new_run_dir, read_metrics, rewrite_metrics
from fedpeft.runtime.setup import Experiment, build_experiment
from fedpeft.training.evaluate import evaluate
from fedpeft.training.local import NonFiniteLoss

log = logging.getLogger("fedpeft")
TIMING_KEYS = ("time_client_s", "time_aggregation_s", "time_evaluation_s", "time_overhead_s", "time_round_s", "wall_s")
TRAINER_COUNTERS = ("flops_measured", "flops_tokens", "flops_steps")
# What one client returns for a round: (decoded update or None, bytes down, bytes up, failure reason or None)
ClientResult = tuple[wire.Payload | None, int, int, str | None]


@dataclass
class RoundOutcome:
    """What the clients' work of one round amounted to, before evaluation."""

    metas: dict[int, dict[str, Any]] = field(default_factory=dict)  # accepted clients -> their update's meta
    agg: dict[str, float] = field(default_factory=dict)  # aggregation metrics (empty if nothing was aggregated)
    rejected: dict[int, str] = field(default_factory=dict)  # client -> why its update was not aggregated
    bytes_down: dict[int, int] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    time_client_s: float = 0.0
    time_aggregation_s: float = 0.0
    failed: str | None = None  # why the round aggregated nothing (too few updates), or None


def client_seed(seed: int, rnd: int, cid: int) -> int:
    return int(np.random.SeedSequence([seed, rnd, cid]).generate_state(1)[0])


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def train_client(exp: Experiment, client: algorithms.ClientAlgorithm, rnd: int, cid: int, received: wire.Payload,
                 state: dict[str, Any]) -> wire.Payload:
    """One client's local work for round ``rnd``, the same in every runtime: seeded by (seed, round, client)
    only, so a client gives the same update wherever and whenever it runs. ``state`` is the client's
    algorithm state, updated in place."""
    cfg = exp.cfg
    rng = np.random.default_rng([cfg.seed, rnd, cid])
    torch.manual_seed(client_seed(cfg.seed, rnd, cid))
    data = exp.client_data(cid)

    def train(extra_loss=None, before_step=None, after_step=None, head_fraction=1.0, optimizer_state=None, tuned=None,
              lr=None):
        return exp.trainer.train(tuned or exp.tuned, data, rng, extra_loss=extra_loss, before_step=before_step, lr=lr,
                                 after_step=after_step, head_fraction=head_fraction, optimizer_state=optimizer_state)

    ctx = ClientContext(client_id=cid, round=rnd, tuned=exp.tuned, train=train, num_examples=len(data), state=state,
                        data=data, resources=exp.client_resources)
    return client.fit(received, ctx)


class EmbeddedRuntime:
    """Runs the rounds; a subclass changes where clients run by overriding :meth:`run_clients`."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None, *, experiment: Experiment | None = None,
                 resume: bool = False):
        self.cfg = cfg
        restored: tuple[int, dict[str, Any]] | None = None
        if resume:
            self.run_dir = Path(run_dir)  # type: ignore[arg-type]
            restored = checkpoint.load(self.run_dir)  # fails before any work if there is nothing to resume
            kept = [r for r in read_metrics(self.run_dir) if r["round"] <= restored[0]]
            rewrite_metrics(self.run_dir, kept)  # rounds after the checkpoint are run again
        else:
            self.run_dir = new_run_dir(cfg, run_dir)  # fails fast if the directory already holds a run
            kept = []
        self.exp = experiment or build_experiment(cfg)
        self.writer = RunWriter(self.run_dir, cfg)
        self.writer.partition(self.exp.partition_stats)
        self.server = algorithms.make_server(
            cfg.algorithm, self.exp.tuned.state(), num_clients=cfg.federation.num_clients,
            clients_per_round=cfg.federation.clients_per_round, seed=cfg.seed, layout=self.exp.algorithm_layout, client_lr=cfg.train.lr,
            server_model=self.exp.server_model,
        )
        self.client = algorithms.make_client(cfg.algorithm)
        self.client_states: dict[int, dict[str, Any]] = {}
        self.max_payload = int(cfg.runtime.max_payload_mb * 2**20)
        self.rows: list[dict[str, Any]] = kept
        self.cum_up = self.cum_down = 0
        self.metric = cfg.primary_metric()
        self.start_round = 1
        self.wall_offset = 0.0  # wall seconds already spent before a resume
        if restored is not None:
            self._restore(*restored)

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
        }

    def _restore(self, rnd: int, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state["server"])
        self.client_states = {int(c): s for c, s in state["clients"].items()}
        self.cum_up, self.cum_down = int(state["cum_bytes_up"]), int(state["cum_bytes_down"])
        self.wall_offset = float(state["wall_s"])
        for k, v in state["trainer"].items():
            setattr(self.exp.trainer, k, v)
        self.start_round = rnd + 1
        log.warning("resumed %s after round %d (checkpoint %s)", self.run_dir, rnd, checkpoint.FILENAME)

    @classmethod
    def resume(cls, run_dir: str | Path, **kwargs: Any) -> "EmbeddedRuntime":
        """Continue the run in RUN_DIR from its last checkpoint, with the config it was started with."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
        if (run_dir / "summary.json").is_file():
            raise FileExistsError(f"the run in {str(run_dir)!r} has already finished (summary.json exists)")
        return cls(load_config(run_dir / "config.yaml"), run_dir, resume=True, **kwargs)

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
            else:
                out[k if k.startswith("eval_") else f"eval_{k}"] = v
        return out

    def run_client(self, rnd: int, cid: int, payload: wire.Payload) -> ClientResult:
        """(decoded update or None, bytes down, bytes up, failure reason)."""
        down = wire.encode(payload)
        received = wire.decode(down)
        state = self.client_states.get(cid, {})
        try:
            update = train_client(self.exp, self.client, rnd, cid, received, state)
        except NonFiniteLoss as exc:
            return None, len(down), 0, str(exc)
        if state:
            self.client_states[cid] = state
        up = wire.encode(update)
        try:
            decoded = wire.decode(up, max_bytes=self.max_payload)
        except wire.PayloadError as exc:
            return None, len(down), len(up), str(exc)
        return decoded, len(down), len(up), None

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        """Every selected client's result for the round; here one after another in this process."""
        return {cid: self.run_client(rnd, cid, payload) for cid, payload in payloads.items()}

    def train_round(self, rnd: int, selected: list[int], payloads: dict[int, wire.Payload]) -> RoundOutcome:
        """Send the payloads, collect and check the updates, aggregate the accepted ones."""
        out = RoundOutcome()
        updates: dict[int, wire.Payload] = {}
        tc = time.perf_counter()
        results = self.run_clients(rnd, payloads)
        out.time_client_s = time.perf_counter() - tc
        for cid in selected:
            update, n_down, n_up, failure = results[cid]
            out.bytes_down[cid] = n_down
            out.bytes_up[cid] = n_up
            if failure is not None:
                out.rejected[cid] = failure
                log.warning("round %d: update of client %d rejected: %s", rnd, cid, failure)
            else:
                updates[cid] = update
        ta = time.perf_counter()
        accepted, refused = self.server.accept(rnd, updates)
        out.rejected.update(refused)
        self.server.observe_failures(rnd, out.rejected)
        out.metas = {c: p.meta for c, p in accepted.items()}
        if len(accepted) >= self.cfg.federation.min_replies:
            out.agg = self.server.aggregate(rnd, accepted)
        else:
            out.failed = (f"{len(accepted)} of {len(selected)} updates accepted, federation.min_replies is "
                          f"{self.cfg.federation.min_replies}")
        out.time_aggregation_s = time.perf_counter() - ta
        return out

    def run_round(self, rnd: int, wall_start: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        selected = self.server.select(rnd)
        payloads = self.server.configure(rnd, selected)
        out = self.train_round(rnd, selected, payloads)
        row: dict[str, Any] = {"round": rnd, "clients": selected}
        if out.failed is not None:
            row["round_failed"] = f"{out.failed}: the global model is unchanged"
            log.warning("round %d failed: %s", rnd, row["round_failed"])
        metas, bytes_down, bytes_up = out.metas, out.bytes_down, out.bytes_up
        if metas:
            n = np.array([m["num_examples"] for m in metas.values()], dtype=np.float64)
            losses = np.array([m["train_loss"] for m in metas.values()])
            row["train_loss"] = float((n * losses).sum() / n.sum())
        row["client_train_loss"] = {str(c): m["train_loss"] for c, m in metas.items()}
        row["client_num_examples"] = {str(c): m["num_examples"] for c, m in metas.items()}
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
            "ops_analytic": sum(m.get("train_ops_analytic", 0.0) for m in metas.values()),
            "client_flops": {str(c): wire.clock_seconds(m, "train_flops") for c, m in metas.items()},
            "client_ops_analytic": {str(c): m.get("train_ops_analytic") for c, m in metas.items()},
            "client_train_seconds": {str(c): wire.clock_seconds(m, "train_seconds") for c, m in metas.items()},
            "rejected": {str(c): r for c, r in out.rejected.items()},
        })
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
        row.update(self.runtime_round_info())
        return row

    def runtime_round_info(self) -> dict[str, Any]:
        """Extra per-round entries a runtime reports about itself (e.g. client process times)."""
        return {}

    def _eval_due(self, rnd: int) -> bool:
        every = self.cfg.eval.every
        return rnd == self.cfg.federation.rounds or (every > 0 and rnd % every == 0)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wall_start = time.perf_counter() - self.wall_offset
        target = cfg.eval.target
        key = f"eval_{self.metric}"
        bar = None
        if cfg.runtime.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.federation.rounds, initial=self.start_round - 1, desc=cfg.name, unit="round",
                       dynamic_ncols=True)
        every = cfg.runtime.checkpoint_every
        try:
            if cfg.eval.at_start and self.start_round == 1:
                te = time.perf_counter()
                row = {"round": 0, **self.evaluate_global()}
                self.server.observe_evaluation(0, row)
                t_eval = time.perf_counter() - te
                row.update({"time_evaluation_s": t_eval, "wall_s": time.perf_counter() - wall_start,
                            "cum_bytes": 0, "cum_bytes_up": 0, "cum_bytes_down": 0})
                self._record(row, key, target)
            for rnd in range(self.start_round, cfg.federation.rounds + 1):
                stop = self.server.stop_reason()
                if stop is not None:
                    log.warning("run ends before round %d: %s", rnd, stop)
                    break
                row = self.run_round(rnd, wall_start)
                self._record(row, key, target)
                if every and (rnd % every == 0 or rnd == cfg.federation.rounds):
                    checkpoint.save(self.run_dir, rnd, self.checkpoint_state())
                if bar is not None:
                    bar.update(1)
                    post = {"loss": f"{row.get('train_loss', float('nan')):.3f}", "MB": f"{row['cum_bytes'] / 2**20:.1f}"}
                    if key in row:
                        post[self.metric] = f"{row[key]:.4f}"
                    bar.set_postfix(post)
        finally:
            if bar is not None:
                bar.close()
        return self.finish()

    def _record(self, row: dict[str, Any], key: str, target: float | None) -> None:
        if key in row and target is not None:
            row["reached_target"] = better_or_equal(self.metric, row[key], target)
        if key in row and not math.isfinite(row[key]):
            log.warning("round %d: %s is not finite", row["round"], key)
        self.rows.append(row)
        self.writer.row(row)

    def finish(self) -> dict[str, Any]:
        exp = self.exp
        exp.tuned.load_state(self.server.global_state)
        exp.tuned.save_adapter(self.run_dir / "adapter", base_model=self.cfg.model.name,
                               extra={"num_labels": exp.data.num_labels, "label_names": exp.data.label_names})
        summary = summarize(self.rows, metric=self.metric, target=self.cfg.eval.target)
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
            "device": str(exp.device),
            "torch_threads": torch.get_num_threads(),
        })
        self.writer.summary(summary)
        try:
            from fedpeft.report.plots import plot_run

            plot_run(self.run_dir, self.rows, self.metric)
        except Exception as exc:  # a plotting problem must not lose a finished run; it is logged
            log.warning("plots not written: %s", exc)
        self.writer.close()
        return summary


def run(cfg: RunConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    return EmbeddedRuntime(cfg, run_dir).run()


def resume(run_dir: str | Path) -> dict[str, Any]:
    return EmbeddedRuntime.resume(run_dir).run()
