"""The in-process transport: every client trains in this process over the one shared backbone, one after another or
``runtime.clients_per_pass`` at a time in one fused pass (fedpeft.runtime.cohort). The server's payload is
serialized and decoded, and so is the update (the bytes counted are the bytes a transport would carry), then
checked against runtime.max_payload_mb. Memory does not grow with the number of clients: a client is an index list
into the tokenised training set plus whatever state its algorithm keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedpeft import wire
from fedpeft.runtime import local_work
from fedpeft.runtime.cohort import Cohort, make_cohort, pass_row
from fedpeft.runtime.outcome import ClientResult, RoundOutcome
from fedpeft.training.local import NonFiniteLoss

if TYPE_CHECKING:
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.progress import RoundProgress


class InProcessTransport:
    """The clients of a round, trained in this process (see the module's text)."""

    fuses_clients = True
    rounds_in_real_time = False

    def __init__(self) -> None:
        self.cohort: Cohort | None = None
        self.pass_info: dict[str, Any] = {}  # the fused passes of the round run now (round_info)

    def bind(self, run: EmbeddedRuntime, checkpoint: dict[str, Any] | None) -> None:
        self.run = run
        self.cohort = make_cohort(run.exp, run.client)
        if self.cohort is not None and checkpoint is not None and "clients_per_pass" in checkpoint:
            kept = checkpoint["clients_per_pass"]  # auto's measured number and an out-of-memory halving
            self.cohort.chosen, self.cohort.limit = kept["chosen"], kept["limit"]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        """auto's measured number and an out-of-memory halving: a resumed run groups its clients as before."""
        if self.cohort is None:
            return {}
        return {"clients_per_pass": {"chosen": self.cohort.chosen, "limit": self.cohort.limit}}

    def round_info(self) -> dict[str, Any]:
        """The fused passes' padded-token shares and clients per pass."""
        info, self.pass_info = self.pass_info, {}
        return info

    def round_progress(self, bar: Any) -> RoundProgress | None:
        return None

    def secure_round(self, rnd: int, selected: list[int], payloads: dict[int, wire.Payload],
                     out: RoundOutcome) -> bool:
        return False

    def run_client(self, rnd: int, cid: int, payload: wire.Payload, *, tuned: Any = None,
                   trainer: Callable[..., Any] | None = None) -> ClientResult:
        """(decoded update or None, bytes down, bytes up, failure reason); ``tuned`` and ``trainer`` as
        :func:`fedpeft.runtime.local_work.train_client` takes them."""
        run = self.run
        down = wire.encode(payload)
        received = wire.decode(down)
        state = run.client_states.get(cid, {})
        try:
            report = None
            if run.observers:
                def report(name: str, value: Any) -> None:
                    for observer in run.observers:
                        observer.on_client_report(rnd, cid, name, value)
            update = local_work.train_client(run.exp, run.client, rnd, cid, received, state, report, tuned=tuned,
                                             trainer=trainer)
        except NonFiniteLoss as exc:
            return None, len(down), 0, str(exc)
        if state:
            run.client_states[cid] = state
        try:
            up = wire.encode(update)
        except wire.PayloadError as exc:  # what the client half returned cannot travel (non-JSON metadata)
            return None, len(down), 0, str(exc)
        try:
            decoded = wire.decode(up, max_bytes=run.max_payload)
        except wire.PayloadError as exc:
            return None, len(down), len(up), str(exc)
        return decoded, len(down), len(up), None

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        """Every client's result: one after another, or ``runtime.clients_per_pass`` at a time in one fused pass."""
        run = self.run
        if self.cohort is None:
            return self.one_at_a_time(rnd, payloads)
        cids = list(payloads)
        configured = run.cfg.runtime.clients_per_pass
        if configured == "auto":  # measured once, on this round's clients
            if self.cohort.chosen is None:
                self.cohort.chosen = self.cohort.probe(run.exp.client_data, cids, run.cfg.seed)
            configured = self.cohort.chosen
        k = min(int(configured), self.cohort.limit or int(configured))
        if k == 1:  # (auto measured no gain, or memory ran out at 2): one after another, as without a cohort
            self.pass_info = {"clients_per_pass": 1}
            return self.one_at_a_time(rnd, payloads)
        out: dict[int, ClientResult] = {}
        before = dataclasses.replace(self.cohort.stats)
        for i in range(0, len(cids), k):
            if len(cids[i:i + k]) == 1:  # (a last client alone trains as without a cohort)
                out.update(self.one_at_a_time(rnd, {cids[i]: payloads[cids[i]]}))
                continue
            run.progress.clients_training(cids[i:i + k])
            out.update(self.cohort.run(cids[i:i + k], lambda cid, tuned, train: self.run_client(
                rnd, cid, payloads[cid], tuned=tuned, trainer=train), seed=(run.cfg.seed, rnd)))
            run.progress.clients_done(cids[i:i + k])
        self.pass_info = {"clients_per_pass": min(k, len(cids)), **pass_row(before, self.cohort.stats)}
        return out

    def one_at_a_time(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        out = {}
        for cid, payload in payloads.items():
            self.run.progress.clients_training([cid])
            out[cid] = self.run_client(rnd, cid, payload)
            self.run.progress.clients_done([cid])
        return out
