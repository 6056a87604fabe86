"""The ClientApp: a SuperNode's share of fedpeft's clients.

A SuperNode started with ``--node-config "partition-id=I num-partitions=N"`` serves every fedpeft
client id c with c mod N == I (with N = federation.num_clients each node is one client). For a train
message it decodes the server's payload, runs the algorithm's client half through
:func:`fedpeft.runtime.embedded.train_client` (the same code and seeds as the embedded runtime), and
replies with the encoded update. Per-client algorithm state is kept in Flower's ``context.state``
(one ConfigRecord per client id), so it lasts as long as the SuperNode does.

Flower 1.41 starts a fresh process for every message, so the model and data are built per message;
the module-level cache only helps where Flower reuses the process (the simulation engine).
"""

from __future__ import annotations

import logging
import os
import time

import psutil
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedpeft import algorithms, checkpoint, wire
from fedpeft.runtime.flower.records import config_from_run_config, pack, unpack

log = logging.getLogger("fedpeft")
app = ClientApp()
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


@app.query("describe")
def describe(msg: Message, context: Context) -> Message:
    pid, n = node_partition(context)
    return Message(RecordDict({"fedpeft": ConfigRecord({"partition-id": pid, "num-partitions": n})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedpeft.runtime.embedded import train_client

    # when this message's work started: the process start for a fresh ClientApp process (Flower starts one
    # per message), the handler call in a warm worker that already served messages
    born = time.time() if _cache.get("served") else psutil.Process().create_time()
    _cache["served"] = True
    pid, n = node_partition(context)
    data, info = unpack(msg.content)
    rnd, cid = int(info["round"]), int(info["client"])
    if cid % n != pid:
        raise ValueError(f"client {cid} belongs to partition {cid % n}, this SuperNode serves partition {pid}")
    exp, client = _experiment(context)
    if cid >= exp.cfg.federation.num_clients:
        raise ValueError(f"client {cid} does not exist (federation.num_clients={exp.cfg.federation.num_clients})")
    t_setup = time.time() - born  # interpreter start, imports, model and data
    received = wire.decode(data, max_bytes=int(exp.cfg.runtime.max_payload_mb * 2**20))
    key = f"fedpeft.client.{cid}"
    stored = context.state.config_records.get(key)
    state = checkpoint.decode_tree(stored["state"]) if stored is not None else {}
    update = train_client(exp, client, rnd, cid, received, state)
    if state:
        context.state[key] = ConfigRecord({"state": checkpoint.encode_tree(state)})
    reply = pack(wire.encode(update), round=rnd, client=cid, setup_seconds=t_setup,
                 client_seconds=time.time() - born, started_at=born, replied_at=time.time())
    return Message(reply, reply_to=msg)
