"""The ClientApp: a SuperNode's share of fedpeft's clients.

A SuperNode started with ``--node-config "partition-id=I num-partitions=N"`` serves every fedpeft
client id c with c mod N == I (with N = federation.num_clients each node is one client). For a train
message it decodes the server's payload, runs the algorithm's client half through
:func:`fedpeft.runtime.local_work.train_client` (the same code and seeds as the embedded runtime), and
replies with the encoded update. Per-client algorithm state is kept in Flower's ``context.state``
(one ConfigRecord per client id), so it lasts as long as the SuperNode does.

The model and data are built once per process and kept in a module-level cache: Flower's default
SuperNode starts a fresh ClientApp process for every message (so it pays that every time), while
fedpeft's warm worker (process isolation) and the simulation engine's Ray actors keep the process.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import psutil
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from fedpeft import algorithms, checkpoint, wire
from fedpeft.runtime.flower.internals import (
    RECORD_KEY_CONFIGS,
    ClientAppCallable,
    recorddict_compat,
)
from fedpeft.runtime.flower.records import (
    ARRAY_NAMES_KEY,
    META_KEY,
    SECURE_FIT_KEY,
    config_from_run_config,
    pack,
    unpack,
)
from fedpeft.runtime.payload_limits import download_limit

log = logging.getLogger("fedpeft")
_cache: dict[str, object] = {}


def node_partition(context: Context) -> tuple[int, int]:
    cfg = context.node_config
    try:
        pid, n = int(cfg["partition-id"]), int(cfg["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("start the SuperNode with --node-config \"partition-id=I num-partitions=N\"") from None
    if not 0 <= pid < n:
        raise ValueError(f"partition-id {pid} is not in [0, num-partitions={n})")
    return pid, n


def _experiment(context: Context):
    from fedpeft.runtime.setup import build_experiment

    key = context.run_config.get("fedpeft-config")
    if _cache.get("key") != key:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        cfg = config_from_run_config(context.run_config)
        _cache.update(key=key, exp=build_experiment(cfg), client=algorithms.make_client(cfg.algorithm))
    return _cache["exp"], _cache["client"]


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ client mod, for the train messages of a secure-aggregation round only."""
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_aggregation_mod])


@app.query("describe")
def describe(msg: Message, context: Context) -> Message:
    """Which clients this SuperNode serves. Also builds the model and data, so a long-lived ClientApp (warm
    worker, simulation actor) is ready before round 1 rather than loading inside it."""
    pid, n = node_partition(context)
    _experiment(context)
    return Message(RecordDict({"fedpeft": ConfigRecord({"partition-id": pid, "num-partitions": n})}), reply_to=msg)


def fit(context: Context, data: bytes, rnd: int, cid: int) -> tuple[wire.Payload, wire.Payload, dict[str, float]]:
    """Decode the server's payload and run the client's round: (received, update, timings)."""
    from fedpeft.runtime.local_work import train_client

    # when this message's work started: the process start for a fresh ClientApp process (Flower starts one
    # per message), the handler call in a warm worker that already served messages
    born = time.time() if _cache.get("served") else psutil.Process().create_time()
    _cache["served"] = True
    pid, n = node_partition(context)
    if cid % n != pid:
        raise ValueError(f"client {cid} belongs to partition {cid % n}, this SuperNode serves partition {pid}")
    exp, client = _experiment(context)
    if cid >= exp.cfg.federation.num_clients:
        raise ValueError(f"client {cid} does not exist (federation.num_clients={exp.cfg.federation.num_clients})")
    t_setup = time.time() - born  # interpreter start, imports, model and data
    received = wire.decode(data, max_bytes=download_limit(exp.cfg))
    key = f"fedpeft.client.{cid}"
    stored = context.state.config_records.get(key)
    state = checkpoint.decode_tree(stored["state"]) if stored is not None else {}
    update = train_client(exp, client, rnd, cid, received, state)
    if state:
        context.state[key] = ConfigRecord({"state": checkpoint.encode_tree(state)})
    now = time.time()
    return received, update, {"setup_seconds": t_setup, "client_seconds": now - born, "started_at": born,
                              "replied_at": now}


@app.train()
def train(msg: Message, context: Context) -> Message:
    if SECURE_FIT_KEY in msg.content.array_records:
        return train_secure(msg, context)
    data, info = unpack(msg.content)
    rnd, cid = int(info["round"]), int(info["client"])
    _, update, timings = fit(context, data, rnd, cid)
    return Message(pack(wire.encode(update), round=rnd, client=cid, **timings), reply_to=msg)


def train_secure(msg: Message, context: Context) -> Message:
    """A SecAgg+ round: reply with the update x_c - x as a legacy FitRes, which the mod masks."""
    ins = recorddict_compat.recorddict_to_fitins(msg.content, keep_input=False)
    (data,) = parameters_to_ndarrays(ins.parameters)
    rnd, cid = int(ins.config["round"]), int(ins.config["client"])
    received, update, _ = fit(context, np.asarray(data, dtype=np.uint8).tobytes(), rnd, cid)
    names = json.loads(str(ins.config[ARRAY_NAMES_KEY]))
    limit = float(ins.config["clipping_range"])
    if sorted(update.arrays) != names or sorted(received.arrays) != names:
        raise ValueError("the update's parameters are not the ones the server aggregates")
    delta = [update.arrays[k].astype(np.float32) - received.arrays[k].astype(np.float32) for k in names]
    for name, d in zip(names, delta):
        if not np.all(np.isfinite(d)):
            raise ValueError(f"update of {name} is not finite: not sent")
        if d.size and float(np.max(np.abs(d))) > limit:
            raise ValueError(f"update of {name} has an entry of magnitude {float(np.max(np.abs(d))):.4g} > "
                             f"runtime.flower.secure_aggregation.clipping_range={limit:g}: raise it")
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(delta), int(update.meta["num_examples"]),
                 {META_KEY: json.dumps(update.meta)})
    return Message(recorddict_compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
