"""Secure aggregation of FedAvg-family rounds with Flower's SecAgg+ (``runtime.flower.secure_aggregation``).

Flower ships SecAgg+ as a legacy workflow (:class:`flwr.server.workflow.SecAggPlusWorkflow`) that
drives a legacy ``Strategy`` through a ``LegacyContext``, and as a client mod
(:func:`flwr.client.mod.secaggplus_mod`). Both are used unchanged; this module adapts one fedpeft
round to them:

* :class:`OneRoundStrategy` hands the workflow one ``FitIns`` per selected client (the client's fedpeft
  payload bytes as a uint8 array, plus the round's info) and captures what the workflow passes to
  ``aggregate_fit``: the unmasked sample-weighted mean of the clients' updates and the clear-text
  part of each reply (number of examples, training metrics).
* :class:`CountingGrid` gives the workflow ``send_and_receive`` over the runtime's fast poll loop
  (Flower's Grid sleeps 3 s between polls; the protocol makes four round trips), counts the bytes of
  every message each client sends and receives, remembers why a client dropped out, and refuses a
  masked-vector reply that carries arrays in the clear.

Each client sends ``x_c - x`` (its parameters minus the global ones) rather than ``x_c``: updates are
small, so they fit the quantization range with less error, and the mean of the updates is FedAvg's
pseudo-gradient. Quantization: entries in [-clipping_range, clipping_range] map to integers in
[0, Q] with stochastic rounding, where Q is the largest power of two up to 2^30 with K * Q < 2^32
(Flower's modulus) for K clients in the round (Flower's default is 2^22); the rounding error per
entry of the mean is below 2 * clipping_range / Q.

What the server cannot do under SecAgg+: check one client's update (shapes, finiteness, size) before
it is summed. Clients check their own update instead (a non-finite update or an entry beyond
``clipping_range`` makes the client fail the round), the server checks the aggregate, and Flower's
mod clips every entry to the range, so one client can move each entry of the mean by at most
``clipping_range`` times its sample weight.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerConfig
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow

from fedpeft.algorithms.base import UpdateRejected, finite_number
from fedpeft.errors import first_line
from fedpeft.runtime.flower.internals import (
    MAIN_CONFIGS_RECORD,
    MAIN_PARAMS_RECORD,
    RECORD_KEY_CONFIGS,
    GridClientProxy,
    Key,
    LegacyContext,
    Stage,
    WorkflowKey,
    recorddict_to_proto,
)
from fedpeft.runtime.flower.records import ARRAY_NAMES_KEY, META_KEY

log = logging.getLogger("fedpeft")


def quantization_range(clients: int) -> int:
    """The largest power of two Q <= 2**30 with clients * Q < 2**32: the sum of the clients' quantized
    entries stays below Flower's modulus (so it unmasks exactly) and each entry fits Flower's int32 rounding."""
    return 1 << min(30, math.floor(math.log2((2**32 - 1) / clients)))


def message_bytes(msg: Message) -> int:
    """The size of a message's content as Flower serializes it (protobuf)."""
    return recorddict_to_proto(msg.content).ByteSize()


def readable_meta(text: Any) -> dict[str, Any]:
    """A client's clear-text training metadata, or {} when it is not a JSON object with a finite train_loss
    (its masked update is in the sum regardless: SecAgg+ cannot leave one out)."""
    try:
        meta = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):  # not JSON, an integer of > 4300 digits, nesting too deep
        meta = None
    loss = meta.get("train_loss") if isinstance(meta, dict) else None
    try:
        finite_number(loss, "train_loss")
    except UpdateRejected:
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}


class CountingGrid:
    """``send_and_receive`` for the SecAgg+ workflow over a FlowerTransport's push/poll loop."""

    def __init__(self, runtime: Any, timeout: float):
        self.runtime = runtime
        self.timeout = timeout
        self.bytes_down: dict[int, int] = defaultdict(int)  # by node id
        self.bytes_up: dict[int, int] = defaultdict(int)
        self.dropped: dict[int, str] = {}  # node id -> why it left the protocol

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        stage = messages[0].content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        for msg in messages:
            self.bytes_down[msg.metadata.dst_node_id] += message_bytes(msg)
        replies, ids = self.runtime._exchange(messages, self.timeout if timeout is None else timeout)
        answered: list[Message] = []
        for msg, mid in zip(messages, ids):
            node = msg.metadata.dst_node_id
            rep = replies.get(mid) if mid else None
            if rep is None:
                self.dropped.setdefault(node, f"no reply in SecAgg+ stage {stage!r} within "
                                              f"federation.round_timeout_s={self.timeout:g} s")
                continue
            if rep.has_content():
                self.bytes_up[node] += message_bytes(rep)
            if rep.has_error():
                self.dropped.setdefault(node, f"client failed in SecAgg+ stage {stage!r}: {first_line(rep.error.reason)}")
            elif stage == Stage.COLLECT_MASKED_VECTORS and any(len(r) for r in rep.content.array_records.values()):
                self.dropped.setdefault(node, "sent arrays in the clear in SecAgg+ (its ClientApp lacks the "
                                              "secaggplus mod): refused")
                continue  # never summed, and the workflow treats the client as dropped
            answered.append(rep)
        return answered


class SecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, forgetting clients lost before they shared their keys.

    Flower 1.41 keeps every sampled client in the protocol's client set, so a client lost in the setup
    or share-keys stage is later treated as a dropped client whose pairwise masks must be removed: the
    other clients are asked for key shares they never received (the round fails) and the server would
    remove masks that were never added. In the protocol (Bell et al. 2020, as Bonawitz et al. 2017) such
    a client simply takes no part: nobody masks with it. So after those two stages the client set and
    every neighbour set shrink to the clients still active; clients lost after sharing keys are the
    dropouts whose masks are rebuilt from shares, as in Flower.
    """

    _before_masking = True

    def setup_stage(self, grid, context, state) -> bool:
        self._before_masking = True
        return super().setup_stage(grid, context, state)

    def share_keys_stage(self, grid, context, state) -> bool:
        self._before_masking = True
        return super().share_keys_stage(grid, context, state)

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        self._before_masking = False
        return super().collect_masked_vectors_stage(grid, context, state)

    def _check_threshold(self, state) -> bool:
        if self._before_masking:
            kept = set(state.active_node_ids)
            state.sampled_node_ids = kept
            state.nid_to_neighbours = {n: nb & kept for n, nb in state.nid_to_neighbours.items() if n in kept}
        return super()._check_threshold(state)


class OneRoundStrategy(Strategy):
    """The legacy Strategy face of one fedpeft round: fixed FitIns out, the secure mean captured."""

    def __init__(self, fitins: dict[int, FitIns], grid: CountingGrid):
        self.proxies = {node: GridClientProxy(node, grid, run_id=0) for node in fitins}  # type: ignore[arg-type]
        self.fitins = fitins
        self.mean: list[np.ndarray] | None = None
        self.replies: dict[int, tuple[int, dict[str, Any]]] = {}  # node -> (num_examples, fedpeft meta)

    def configure_fit(self, server_round, parameters, client_manager):
        return [(self.proxies[node], ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)  # the same unmasked mean in every result
        for proxy, res in results:
            self.replies[proxy.node_id] = (int(res.num_examples), readable_meta(res.metrics.get(META_KEY)))
        return None, {}

    # the workflow uses only the two methods above
    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def secure_mean(runtime: Any, rnd: int, payloads: dict[int, bytes], names: list[str]) -> tuple[
        dict[str, np.ndarray] | None, dict[int, tuple[int, dict[str, Any]]], dict[int, str], dict[int, int],
        dict[int, int]]:
    """Run SecAgg+ over the clients of ``payloads`` (client -> encoded fedpeft payload).

    Returns (mean update by array name or None if the protocol did not complete, client -> (num_examples,
    meta) for the clients whose masked update was summed, client -> why it dropped out, bytes down and up
    by client)."""
    opts = runtime.cfg.runtime.flower.secure_aggregation
    node_of = {cid: runtime.node_of_partition[cid % runtime.num_partitions] for cid in payloads}
    client_of = {node: cid for cid, node in node_of.items()}
    grid = CountingGrid(runtime, runtime.cfg.federation.round_timeout_s)
    fitins = {
        node_of[cid]: FitIns(ndarrays_to_parameters([np.frombuffer(data, dtype=np.uint8)]),
                             {"round": rnd, "client": cid, "clipping_range": float(opts.clipping_range),
                              ARRAY_NAMES_KEY: json.dumps(names)})
        for cid, data in payloads.items()
    }
    strategy = OneRoundStrategy(fitins, grid)
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    sizes = [len(runtime.exp.parts[cid]) for cid in payloads]
    workflow = SecAggPlus(
        opts.num_shares, opts.reconstruction_threshold, max_weight=float(max(sizes)),
        clipping_range=opts.clipping_range, quantization_range=quantization_range(len(payloads)),
        timeout=runtime.cfg.federation.round_timeout_s,
    )
    try:
        workflow(grid, context)  # type: ignore[arg-type]
    except Exception as exc:  # a broken protocol run fails this round, not the server
        log.exception("round %d: SecAgg+ failed", rnd)
        strategy.mean, strategy.replies = None, {}
        for node in list(client_of):
            grid.dropped.setdefault(node, f"the SecAgg+ protocol failed: {type(exc).__name__}: {exc}")
    replies = {client_of[node]: rep for node, rep in strategy.replies.items()}
    dropped = {client_of[node]: why for node, why in grid.dropped.items() if client_of[node] not in replies}
    for cid in payloads:
        if cid not in replies and cid not in dropped:
            dropped[cid] = "the SecAgg+ protocol halted (too few clients left to unmask the sum; see the log)"
    mean = None
    if strategy.mean is not None:
        if len(strategy.mean) != len(names):
            raise RuntimeError(f"SecAgg+ returned {len(strategy.mean)} arrays for {len(names)} parameters")
        mean = {name: np.asarray(a, dtype=np.float32) for name, a in zip(names, strategy.mean)}
    down = {client_of[n]: b for n, b in grid.bytes_down.items()}
    up = {client_of[n]: b for n, b in grid.bytes_up.items()}
    return mean, replies, dropped, down, up
