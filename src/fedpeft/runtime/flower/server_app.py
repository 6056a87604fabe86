"""The ServerApp: fedpeft's round loop on Flower's Grid.

It runs fedpeft's run (:class:`fedpeft.runtime.embedded.EmbeddedRuntime`, its synchronous schedule) over
:class:`FlowerTransport`: the selected clients' payloads go out as Flower messages (one per client, each with
its own arrays) to the SuperNodes that serve them, and the replies come back through the same checks. A reply that does not arrive within
``federation.round_timeout_s`` (killed ClientApp or SuperNode) or that is a Flower error counts as a
failed client of that round; the round aggregates what arrived if at least
``federation.min_replies`` updates were accepted. Checkpoints go to the run directory after every
round, and the run config entry ``resume = true`` continues from the last one. Under federation.asynchronous the
run's schedule is buffered asynchronous aggregation in real time (fedpeft.runtime.realtime_async): it starts
clients with :meth:`FlowerTransport.start_clients` and takes their replies from
:meth:`FlowerTransport.poll_arrivals` as they come.

The Grid is polled every ``runtime.flower.poll_interval_s`` rather than with
``Grid.send_and_receive``, which sleeps 3 s between polls. On the deployment engine replies are
pulled by :class:`.bounded_pull.BoundedPull`: a reply larger than its limit (``runtime.max_payload_mb``
for an update) is refused before its data is downloaded, and becomes a rejected update. Which
SuperNode serves which partition, and who may take a partition over, is :mod:`.partitions`' business.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedpeft import wire
from fedpeft.algorithms.base import UpdateRejected, check_update_meta
from fedpeft.config import RunConfig
from fedpeft.errors import first_line
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.flower.bounded_pull import BoundedPull, ReplyTooLarge
from fedpeft.runtime.flower.internals import RECORD_KEY_CONFIGS, ErrorCode, HttpGrid
from fedpeft.runtime.flower.partitions import PartitionTable, node_key_fingerprint
from fedpeft.runtime.flower.records import config_from_run_config, pack, unpack
from fedpeft.runtime.outcome import ClientResult, RoundOutcome
from fedpeft.runtime.progress import RoundProgress

log = logging.getLogger("fedpeft")
app = ServerApp()
DESCRIBE = f"{MessageType.QUERY}.describe"
DESCRIBE_REPLY_BYTES = 64 << 10  # a describe reply holds two integers and no arrays
SECURE_REPLY_FACTOR = 2  # a SecAgg+ masked update is int64: twice the bytes of the float32 update
REPLY_REFUSED = 900  # error code of a reply refused before it was pulled (Flower's own codes are below 100)
# Flower's errors for a message or reply that never arrived (expired, or the SuperNode is gone)
NOT_ANSWERED = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE)
EXPIRED = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)  # the message's or its reply's TTL ran out


@dataclass
class Started:
    """A client's message pushed without waiting for its reply (buffered asynchronous aggregation): its refill,
    bytes sent, when it was pushed (time.time()) and when its time to answer, federation.round_timeout_s, runs out
    (time.monotonic())."""

    client: int
    draw: int
    n_down: int
    message: Message
    pushed_at: float
    expires: float


class FlowerTransport:
    """A run's clients on Flower's Grid (a fedpeft.runtime.transport.Transport): one message per client to the
    SuperNode that serves its partition."""

    fuses_clients = False  # each client trains in its own ClientApp, one per message
    rounds_in_real_time = True  # system.deadline_s and over_selection act on the replies as they arrive

    def __init__(self, grid: Grid, cfg: RunConfig):
        """``cfg``: the run's config (its runtime.flower section: how to poll, which keys serve which partition)."""
        self.grid = grid
        self.cfg = cfg
        # the deployment engine's Grid; the simulation engine's in-memory Grid has nothing to download
        self.puller = BoundedPull(grid, cfg.runtime.flower.poll_interval_s) if isinstance(grid, HttpGrid) else None
        self.partitions = PartitionTable(cfg.runtime.flower.partition_keys)
        self.num_partitions: int = cfg.runtime.flower.num_supernodes  # the config's, never a SuperNode's word
        self.described: set[int] = set()
        self.client_times: dict[str, dict[str, float]] = {}
        self.streaming: dict[str, Started] = {}  # message id -> the client started without waiting for it
        self.given_up: dict[int, float] = {}  # client -> when its unanswered message expires (time.monotonic())

    def bind(self, run: EmbeddedRuntime, checkpoint: dict[str, Any] | None) -> None:
        self.run = run
        self.cfg = run.cfg  # (a resumed run's: its config.yaml with federation.rounds from the launcher)
        self.max_payload = run.max_payload

    def start(self) -> None:
        """Waits for the SuperNodes of every partition (runtime.flower.startup_timeout_s)."""
        self.wait_for_nodes()

    def close(self) -> None:
        """Nothing to stop: the SuperNodes are the deployment's (a local one is stopped by its launcher)."""

    @property
    def exp(self) -> Any:
        return self.run.exp

    def state(self) -> dict[str, Any]:
        return {}

    @property
    def node_of_partition(self) -> dict[int, int]:
        return self.partitions.node_of

    # -- messages and replies --------------------------------------------------------------------------
    def reply_limit(self, message: Message) -> tuple[int, str]:
        """The most bytes the arrays of a reply to ``message`` may hold, and what sets that limit."""
        if message.metadata.message_type == DESCRIBE:
            return DESCRIBE_REPLY_BYTES, "the limit of a describe reply"
        if RECORD_KEY_CONFIGS in message.content.config_records:
            return SECURE_REPLY_FACTOR * self.max_payload, "twice runtime.max_payload_mb in SecAgg+"
        return self.max_payload, "runtime.max_payload_mb"

    def _exchange(self, messages: list[Message], timeout: float,
                  on_reply: Callable[[Message], None] | None = None, enough: int | None = None,
                  usable: Callable[[Message, Message], bool] | None = None,
                  cut_short: bool = False) -> tuple[dict[str, Message], list[str]]:
        """Push messages, poll for their replies; (replies by the id of the message they answer, ids pushed).
        A reply refused before it was pulled (too large) is an error reply with code REPLY_REFUSED. ``on_reply``
        is told each message answered, as its reply arrives. ``enough``: stop once that many replies are
        ``usable(message, reply)`` (default: not an error) (over-selection); a further usable reply pulled with the
        last of them is not kept (error replies are), and whether the exchange stopped so is
        ``self.stopped_with_enough``. ``cut_short``: ``timeout`` is a deadline shorter than the round's timeout, so
        a reply missing or expired then says nothing of its SuperNode (it may be alive and slow)."""
        ids = [i for i in self.grid.push_messages(messages)]
        sent = {mid: msg for mid, msg in zip(ids, messages) if mid}
        pending = set(sent)
        replies: dict[str, Message] = {}
        self.pulled_at: dict[str, float] = {}
        self.stopped_with_enough = False
        good = 0
        deadline = time.monotonic() + timeout
        poll = self.cfg.runtime.flower.poll_interval_s
        while pending and time.monotonic() < deadline and not self.stopped_with_enough:
            for mid, rep in self._pull({m: sent[m] for m in pending}, deadline):
                if mid in pending and (not self.stopped_with_enough or rep.has_error()):
                    pending.discard(mid)
                    replies[mid] = rep
                    self.pulled_at[mid] = time.time()
                    if not self.stopped_with_enough:
                        good += usable(sent[mid], rep) if usable is not None else not rep.has_error()
                        self.stopped_with_enough = enough is not None and good >= enough and bool(pending)
                    if on_reply is not None:
                        on_reply(sent[mid])
            if pending and not self.stopped_with_enough:
                time.sleep(poll)
        for mid, msg in sent.items():
            rep = replies.get(mid)
            if (rep is None and self.stopped_with_enough) or (cut_short and (rep is None or (
                    rep.has_error() and rep.error.code in EXPIRED))):
                continue  # not waited for long enough: says nothing of its SuperNode
            self.partitions.answered(msg.metadata.dst_node_id,
                                     rep is not None and not (rep.has_error() and rep.error.code in NOT_ANSWERED))
        return replies, ids

    def _pull(self, pending: dict[str, Message], deadline: float) -> list[tuple[str, Message]]:
        """The replies available now to the ``pending`` messages (by id), as (id of the message answered, reply)."""
        if self.puller is None:
            return [(rep.metadata.reply_to_message_id, rep) for rep in self.grid.pull_messages(sorted(pending))]
        limits = {mid: self.reply_limit(msg) for mid, msg in pending.items()}
        accepted, refused = self.puller.pull({mid: limit for mid, (limit, _) in limits.items()}, deadline)
        out = list(accepted.items())
        for mid, why in refused.items():
            limit = f" ({limits[mid][1]})" if isinstance(why, ReplyTooLarge) else ""
            reason = f"reply refused before it was pulled: {why}{limit}"
            log.warning("SuperNode %d: %s", pending[mid].metadata.dst_node_id, reason)
            out.append((mid, Message(Error(code=REPLY_REFUSED, reason=reason), reply_to=pending[mid])))
        return out

    # -- which SuperNode serves which clients ---------------------------------------------------------
    def refresh_nodes(self, timeout: float, recheck: bool = True) -> None:
        """Ask SuperNodes not seen before which partition they serve and settle their claims (see
        :mod:`.partitions`). ``recheck``: also ask again the SuperNodes whose partition a refused SuperNode
        claims (new claims are always checked)."""
        online = {int(n.node_id): node_key_fingerprint(bytes(n.public_key)) for n in self.grid.get_nodes()}
        self.partitions.set_online(online)
        self.described &= set(online)  # a SuperNode that went away and came back (same id with auth) is asked again
        answers = self._ask_partitions(sorted(set(online) - self.described), timeout)
        self.described.update(answers)
        claims = {node: a[0] for node, a in answers.items() if a is not None and self._agrees_on_count(node, a[1])}
        serving = dict(claims)  # SuperNode -> the partition it claimed in a reply just now
        contested = {**{n: p for n, p in self.partitions.contenders.items() if n not in answers}, **claims}
        unasked = {self.partitions.incumbent_to_ask(n, p) for n, p in contested.items()} - {None} - set(serving)
        if unasked and (recheck or claims):
            asked = self._ask_partitions(sorted(unasked), min(timeout, self.cfg.federation.round_timeout_s))
            serving.update({node: a[0] for node, a in asked.items() if a is not None})
            unasked = set()
        for node, pid in sorted(contested.items()):
            if self.partitions.incumbent_to_ask(node, pid) not in unasked:  # else: decided at a later refresh
                self.partitions.claim(node, pid, serving)

    def _ask_partitions(self, nodes: list[int], timeout: float) -> dict[int, tuple[int, int] | None]:
        """Send each node a describe message: {node that replied: (partition id, number of partitions) it
        claims, or None if its reply is an error or is refused (logged)}."""
        if not nodes:
            return {}
        msgs = [Message(RecordDict(), dst_node_id=n, message_type=DESCRIBE) for n in nodes]
        replies, ids = self._exchange(msgs, timeout)
        out: dict[int, tuple[int, int] | None] = {}
        for node, mid in zip(nodes, ids):
            rep = replies.get(mid) if mid else None
            if rep is None:
                continue  # asked again at the next refresh
            out[node] = None
            if rep.has_error():
                log.warning("SuperNode %d cannot serve fedpeft clients: %s", node, first_line(rep.error.reason))
                continue
            try:
                out[node] = describe_reply(rep.content, max(self.cfg.federation.num_clients,
                                                            self.cfg.runtime.flower.num_supernodes))
            except ValueError as exc:
                log.warning("SuperNode %d's describe reply is refused: %s", node, exc)
        return out

    def _agrees_on_count(self, node: int, n: int) -> bool:
        """Whether ``node``'s num-partitions is the run's (runtime.flower.num_supernodes); else it is refused."""
        if n != self.num_partitions:
            log.warning("SuperNode %d says num-partitions=%d but the run has runtime.flower.num_supernodes=%d "
                        "partitions: refused (start it with num-partitions=%d, or set num_supernodes)", node, n,
                        self.num_partitions, self.num_partitions)
            return False
        return True

    def forget_node(self, node: int) -> None:
        self.described.discard(node)
        self.partitions.forget(node)

    def wait_for_nodes(self) -> None:
        fl = self.cfg.runtime.flower
        deadline = time.monotonic() + fl.startup_timeout_s
        while True:
            self.refresh_nodes(timeout=max(1.0, deadline - time.monotonic()), recheck=False)
            n = self.num_partitions
            if len(self.node_of_partition) == n:
                log.info("%d SuperNodes serve the %d clients", n, self.cfg.federation.num_clients)
                return
            if time.monotonic() > deadline:
                have = sorted(self.node_of_partition)
                refused = sorted(self.partitions.contenders.items())
                why = f" (refused claims, SuperNode: partition: {dict(refused)}; see the log)" if refused else ""
                raise RuntimeError(f"after {fl.startup_timeout_s:.0f} s only partitions {have} of {n} have a "
                                   f"SuperNode{why}; start the missing SuperNodes or raise "
                                   "runtime.flower.startup_timeout_s")
            time.sleep(0.5)

    # -- a round ---------------------------------------------------------------------------------------
    def round_progress(self, bar: Any) -> RoundProgress | None:
        """Progress inside a round as log lines: events.log, and the launcher's console through
        ``flwr run --stream`` (fedpeft.runtime.progress.Follower)."""
        return RoundProgress(self.cfg.federation.rounds, log.info)

    def round_info(self) -> dict[str, Any]:
        """Per client: seconds from its ClientApp process start to the reply, and to the start of training
        (interpreter, imports, model and data: what a warm client would not pay)."""
        t, self.client_times = self.client_times, {}
        return {"client_process_s": t.get("client_seconds", {}), "client_setup_s": t.get("setup_seconds", {}),
                "client_start_delay_s": t.get("start_delay", {}), "client_return_delay_s": t.get("return_delay", {})}

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        self.refresh_nodes(timeout=30.0)
        self.client_times = {"client_seconds": {}, "setup_seconds": {}, "start_delay": {}, "return_delay": {}}
        results: dict[int, ClientResult] = {}
        system = self.cfg.system
        timeout = self.cfg.federation.round_timeout_s
        deadline = system.deadline_s if system.deadline_s is not None and system.deadline_s < timeout else None
        wait = timeout if deadline is None else deadline
        needed = self.cfg.federation.clients_per_round if system.over_selection else None
        # a message expires with the round (its timeout, or system.deadline_s): a SuperNode does not start it later;
        # one it started trains on, and its reply is refused
        unserved, sent = self._train_messages(rnd, payloads, wait)
        for cid, why in unserved.items():
            results[cid] = (None, 0, 0, why)
            self.run.progress.clients_done([cid])
        pushed_at = time.time()
        client_of = {id(msg): cid for cid, _, msg in sent}
        n_down_of = {cid: n for cid, n, _ in sent}
        decoded: dict[int, ClientResult] = {}

        def decodes(msg: Message, rep: Message) -> bool:  # over-selection counts the updates that decode
            if rep.has_error():
                return False
            cid = client_of[id(msg)]
            decoded[cid] = self._decode_reply(rep, n_down_of[cid])
            return decoded[cid][0] is not None

        replies, ids = self._exchange([m for _, _, m in sent], wait, enough=needed, usable=decodes,
                                      cut_short=deadline is not None,
                                      on_reply=lambda msg: self.run.progress.clients_done([client_of[id(msg)]]))
        if len(ids) != len(sent):  # e.g. HTTP 413: the SuperLink refused the whole push
            ids = [None] * len(sent)
        for (cid, n_down, msg), mid in zip(sent, ids):
            rep = replies.get(mid) if mid else None
            if not mid:
                results[cid] = (None, n_down, 0, "the SuperLink refused the message (too large? see its log)")
            elif rep is None and self.stopped_with_enough:
                why = (f"dropped: the round closed with the first {needed} updates to arrive (system.over_selection "
                       f"{system.over_selection:g}, in real time); not needed")
                self.run.surplus_in_real_time.add(cid)
                self.run.dropped_in_real_time[cid] = why
                results[cid] = (None, n_down, 0, why)
            elif rep is None or (rep.has_error() and rep.error.code in EXPIRED):
                if deadline is not None:
                    why = f"dropped: no update within system.deadline_s={deadline:g} s (in real time)"
                    self.run.dropped_in_real_time[cid] = why
                else:
                    why = (f"no reply within federation.round_timeout_s={timeout:g} s ("
                           + ("the message expired: " if rep is not None else "") + "client stopped or disconnected)")
                results[cid] = (None, n_down, 0, why)
            else:
                results[cid] = self._reply_result(cid, n_down, msg, rep, pushed_at, self.pulled_at.get(mid, 0.0),
                                                  decoded.get(cid))
        self.run.progress.clients_done(results)  # those that timed out or were refused: the round waits no more
        return results

    def _train_messages(self, rnd: int, payloads: dict[int, wire.Payload], ttl: float) -> tuple[
            dict[int, str], list[tuple[int, int, Message]]]:
        """The train message of each client of round (or refill) ``rnd`` to the SuperNode serving its partition,
        expiring after ``ttl`` seconds: ({client no SuperNode serves: why}, [(client, bytes down, message)]). Built
        once every payload is encoded, to be pushed at once: a message's TTL counts from its creation, and one that
        expired before it was pushed would be refused."""
        unserved: dict[int, str] = {}
        encoded: list[tuple[int, bytes, int]] = []  # (client, payload, SuperNode)
        for cid, payload in payloads.items():
            node = self.node_of_partition.get(cid % self.num_partitions)
            if node is None:
                unserved[cid] = f"no SuperNode online serves partition {cid % self.num_partitions}"
                continue
            encoded.append((cid, wire.encode(payload), node))
        return unserved, [(cid, len(data), Message(pack(data, round=rnd, client=cid), dst_node_id=node,
                                                   message_type=MessageType.TRAIN, group_id=str(rnd), ttl=ttl))
                          for cid, data, node in encoded]

    def _reply_result(self, cid: int, n_down: int, msg: Message, rep: Message, pushed_at: float, pulled_at: float,
                      decoded: ClientResult | None = None) -> ClientResult:
        """Client ``cid``'s result from ``rep``, the reply to ``msg`` (pushed and pulled at these times.time()
        readings), when it is not missing or expired; its ClientApp's reported times go to ``client_times``."""
        if rep.has_error() and rep.error.code == REPLY_REFUSED:
            return None, n_down, 0, first_line(rep.error.reason)
        if rep.has_error():
            if rep.error.code == ErrorCode.NODE_UNAVAILABLE:  # gone: the next refresh looks for a replacement
                self.forget_node(msg.metadata.dst_node_id)
            return None, n_down, 0, f"client failed: {first_line(rep.error.reason)}"
        info = rep.content.config_records.get("fedpeft") or {}
        for key in ("client_seconds", "setup_seconds"):
            if (seconds := reported_time(info.get(key))) is not None:
                self.client_times.setdefault(key, {})[str(cid)] = seconds
        started, replied = reported_time(info.get("started_at")), reported_time(info.get("replied_at"))
        if started is not None and replied is not None:
            # Flower's latency around the ClientApp process (same clock only on one machine)
            self.client_times.setdefault("start_delay", {})[str(cid)] = started - pushed_at
            self.client_times.setdefault("return_delay", {})[str(cid)] = pulled_at - replied
        return decoded if decoded is not None else self._decode_reply(rep, n_down)

    # -- clients started without waiting (buffered asynchronous aggregation in real time) ------------------------
    def start_clients(self, draw: int, payloads: dict[int, wire.Payload]) -> tuple[dict[int, int],
                                                                                   dict[int, ClientResult]]:
        """Push each client's message and return at once: (bytes sent to each client started, the results of those
        that could not be: no SuperNode serves their partition, or the SuperLink refused the push). Their replies
        come from :meth:`poll_arrivals`. A client has federation.round_timeout_s to answer; its message lives
        runtime.flower.reply_grace_s longer, so that a reply that came while the server was busy elsewhere
        (aggregating, evaluating, checkpointing) is still there to pull."""
        self.refresh_nodes(timeout=30.0)
        timeout = self.cfg.federation.round_timeout_s
        unserved, sent = self._train_messages(draw, payloads, timeout + self.cfg.runtime.flower.reply_grace_s)
        failed: dict[int, ClientResult] = {cid: (None, 0, 0, why) for cid, why in unserved.items()}
        ids = list(self.grid.push_messages([m for _, _, m in sent])) if sent else []
        if len(ids) != len(sent):
            ids = [""] * len(sent)
        now, started = time.monotonic(), {}
        for (cid, n_down, msg), mid in zip(sent, ids):
            if not mid:
                failed[cid] = (None, n_down, 0, "the SuperLink refused the message (too large? see its log)")
                continue
            self.streaming[mid] = Started(cid, draw, n_down, msg, time.time(), now + timeout)
            started[cid] = n_down
        return started, failed

    def unavailable(self) -> set[int]:
        """The clients given up whose message still lives on the SuperLink (round_timeout_s + reply_grace_s from
        its push): their SuperNode may still run it, and one more message would queue behind it."""
        now = time.monotonic()
        self.given_up = {cid: until for cid, until in self.given_up.items() if until > now}
        return set(self.given_up)

    def poll_arrivals(self) -> list[tuple[int, int, ClientResult]]:
        """(client, draw, result) of each started client whose reply was pulled now, or that had no reply at a poll
        more than federation.round_timeout_s after its push; waits one poll interval first when no reply is there."""
        if not self.streaming:  # (every start failed: wait before the schedule tries again)
            time.sleep(self.cfg.runtime.flower.poll_interval_s)
            return []
        out = self._take_arrivals()
        if not out:
            time.sleep(self.cfg.runtime.flower.poll_interval_s)
            out = self._take_arrivals()
        return out

    def _take_arrivals(self) -> list[tuple[int, int, ClientResult]]:
        now = time.monotonic()
        late = f"no reply within federation.round_timeout_s={self.cfg.federation.round_timeout_s:g} s"
        pending = {mid: s.message for mid, s in self.streaming.items()}
        out: list[tuple[int, int, ClientResult]] = []
        for mid, rep in self._pull(pending, max(s.expires for s in self.streaming.values())):
            s = self.streaming.pop(mid, None)
            if s is None:
                continue
            answered = not (rep.has_error() and rep.error.code in NOT_ANSWERED)
            self.partitions.answered(s.message.metadata.dst_node_id, answered)
            if rep.has_error() and rep.error.code in EXPIRED:
                result: ClientResult = (None, s.n_down, 0, f"{late} (the message expired)")
            else:
                result = self._reply_result(s.client, s.n_down, s.message, rep, s.pushed_at, time.time())
            out.append((s.client, s.draw, result))
        for mid, s in list(self.streaming.items()):
            if now > s.expires:  # no reply, not even the SuperLink's word that the message expired
                del self.streaming[mid]
                self.given_up[s.client] = s.expires + self.cfg.runtime.flower.reply_grace_s
                self.partitions.answered(s.message.metadata.dst_node_id, False)
                out.append((s.client, s.draw, (None, s.n_down, 0, f"{late} (client stopped or disconnected)")))
        return out

    def secure_round(self, rnd: int, selected: list[int], payloads: dict[int, wire.Payload],
                     out: RoundOutcome) -> bool:
        """Under runtime.flower.secure_aggregation, a round whose updates are summed with SecAgg+ (the server sees
        only their weighted mean), into ``out``; False otherwise."""
        if self.cfg.runtime.flower.secure_aggregation is None:
            return False
        from fedpeft.runtime.flower.secure import (
            secure_mean,  # Flower's legacy server stack, only when used
        )

        self.refresh_nodes(timeout=30.0)
        if self.num_partitions != self.cfg.federation.num_clients:
            raise RuntimeError(f"secure aggregation needs one SuperNode per client: {self.num_partitions} partitions "
                               f"for {self.cfg.federation.num_clients} clients")
        self.client_times = {}
        reachable: dict[int, bytes] = {}
        for cid, payload in payloads.items():
            if cid % self.num_partitions in self.node_of_partition:
                reachable[cid] = wire.encode(payload)
            else:
                out.rejected[cid] = f"no SuperNode online serves partition {cid}"
        tc = time.perf_counter()
        mean, replies = None, {}
        if len(reachable) >= 2:
            mean, replies, dropped, out.bytes_down, out.bytes_up = secure_mean(self, rnd, reachable,
                                                                               sorted(self.run.server.expected))
            out.rejected.update(dropped)
        else:
            out.rejected.update({c: "fewer than 2 clients reachable: SecAgg+ needs at least 2" for c in reachable})
        out.time_client_s = time.perf_counter() - tc
        self.run.progress.clients_done(selected)  # (the SecAgg+ protocol's replies come together)
        for cid in selected:
            out.bytes_down.setdefault(cid, 0)
            out.bytes_up.setdefault(cid, 0)
            if cid in out.rejected:
                log.warning("round %d: update of client %d rejected: %s", rnd, cid, out.rejected[cid])
        ta = time.perf_counter()
        for cid, (n, meta) in sorted(replies.items()):
            try:  # the clear-text metadata faces the same checks as any update's
                check_update_meta({**meta, "num_examples": n}, self.run.server.update_meta, client=cid)
            except UpdateRejected as exc:
                log.warning("round %d: client %d's training metrics were unreadable (%s); its masked update is in "
                            "the sum", rnd, cid, exc)
                continue
            out.metas[cid] = {**meta, "num_examples": n}
        if mean is not None and len(replies) >= self.cfg.federation.min_replies:
            try:
                out.agg = self.run.server.aggregate_mean(rnd, mean)
            except UpdateRejected as exc:
                out.failed = f"the secure aggregate was refused: {exc}"
        else:
            out.failed = (f"{len(replies)} of {len(selected)} updates securely aggregated, federation.min_replies "
                          f"is {self.cfg.federation.min_replies}")
        out.time_aggregation_s = time.perf_counter() - ta
        return True

    def _decode_reply(self, rep: Message, n_down: int) -> ClientResult:
        try:
            data, _ = unpack(rep.content, self.max_payload)
        except wire.PayloadError as exc:
            return None, n_down, 0, str(exc)
        try:
            return wire.decode(data, max_bytes=self.max_payload), n_down, len(data), None
        except wire.PayloadError as exc:
            return None, n_down, len(data), str(exc)


def reported_time(value: Any) -> float | None:
    """A time a ClientApp reports beside its update (seconds, or a clock reading): a finite number, else None
    (it is only shown, never used: a wrong one is dropped, not refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)  # Flower's integers are 64-bit
    return seconds if math.isfinite(seconds) else None


def describe_reply(content: RecordDict, max_partitions: int) -> tuple[int, int]:
    """(partition id, number of partitions) of a SuperNode's describe reply; ValueError (one line) unless both
    are integers with 0 <= id < n <= max_partitions (the larger of federation.num_clients and
    runtime.flower.num_supernodes)."""
    try:
        info = content.config_records["fedpeft"]
    except (KeyError, AttributeError):
        raise ValueError("it holds no 'fedpeft' config record") from None
    values = []
    for key in ("partition-id", "num-partitions"):
        value = info.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key} must be an integer, got {str(value)[:40]!r}")  # noqa: TRY004 (one error type per refusal)
        values.append(value)
    pid, n = values
    if not 0 < n <= max_partitions:
        raise ValueError(f"num-partitions {n} is not in [1, {max_partitions}] (federation.num_clients, "
                         "runtime.flower.num_supernodes)")
    if not 0 <= pid < n:
        raise ValueError(f"partition-id {pid} is not in [0, num-partitions={n})")
    return pid, n


def run_dir_from(run_config: dict[str, Any]) -> Path:
    value = run_config.get("run-dir")
    if not isinstance(value, str) or not value:
        raise ValueError("the Flower run config lacks 'run-dir' (where the ServerApp writes results)")
    return Path(value)


@app.main()
def main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_config = dict(context.run_config)
    cfg = config_from_run_config(run_config)
    run_dir = run_dir_from(run_config)
    # lock=False: fedpeft.runtime.flower.launch.run_flower holds the run directory's lock for the whole run
    if run_config.get("resume", False):
        runtime = EmbeddedRuntime.resume(run_dir, rounds=cfg.federation.rounds, transport=FlowerTransport(grid, cfg),
                                         lock=False)
    else:
        runtime = EmbeddedRuntime(cfg, run_dir, transport=FlowerTransport(grid, cfg), lock=False)
    runtime.cfg.runtime.progress = False
    summary = runtime.run()
    log.info("fedpeft run finished: %s", {k: summary.get(k) for k in ("final", "best", "rounds", "total_bytes")})
