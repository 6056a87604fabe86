"""Buffered asynchronous aggregation (federation.asynchronous): the staleness weights by hand, FedBuff with all
clients arriving together equals synchronous FedAvg, the timeline does not depend on the host, a killed run
resumes to the same result, and what cannot aggregate asynchronously is refused."""

from __future__ import annotations

import json
import math

import pytest
from helpers import crash_at_round, metrics_difference, slow_host, tiny_config, without_timings

from fedpeft.config.asynchronous import staleness_weight
from fedpeft.config.load import ConfigError, load_config
from fedpeft.rundir import read_metrics

SIMULTANEOUS = {"flops_per_s": 1e290, "download_mbps": 1e290, "upload_mbps": 1e290, "latency_s": 0.5}


# -- staleness weights, by hand -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "staleness", "expected"), [
    ("constant", 7, 1.0),
    ("sqrt", 0, 1.0), ("sqrt", 3, 0.5), ("sqrt", 8, 1 / 3),
    ("polynomial", 0, 1.0), ("polynomial", 3, 0.5),  # (1 + 3)^-0.5
    ("hinge", 4, 1.0), ("hinge", 6, 0.5),  # b = 4: 1 / (0.5 x (6 - 4) + 1)
])
def test_staleness_weights(kind, staleness, expected):
    assert staleness_weight(kind, staleness, a=0.5, b=4) == pytest.approx(expected)
    assert staleness_weight("polynomial", 1, a=2.0) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        staleness_weight("sqrt", -1)


# -- the config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "needle"), [
    (["algorithm.name=flora"], "algorithm flora cannot aggregate asynchronously: it merges"),
    (["algorithm.name=headprune"], "algorithm headprune cannot aggregate asynchronously"),
    (["algorithm.dp={noise_multiplier: 1.0}"], "algorithm.dp together are not supported"),
    (["system.deadline_s=10"], "shape synchronous rounds"),
    (["runtime.name=flower", "runtime.flower.secure_aggregation={}", "runtime.flower.num_supernodes=20"],
     "runtime.flower.secure_aggregation together are not supported"),
    (["runtime.name=flower", "system.profile=datacenter"], "on the Flower runtime runs in real time"),
    (["federation.num_clients=5"], "need federation.num_clients >= 6"),
    (["federation.asynchronous={rule: fedasync, buffer_size: 2}"], "rule fedasync aggregates every update"),
    (["algorithm.robust={rule: median}", "federation.min_replies=3", "federation.asynchronous={buffer_size: 2}"],
     "needs at least 3 updates per aggregation"),
    (["runtime.clients_per_pass=auto"], "runtime.clients_per_pass: auto picks its number by timing this machine"),
])
def test_what_cannot_run_asynchronously_is_refused_with_the_reason(overrides, needle):
    base = ["federation.asynchronous={rule: fedbuff}", "federation.num_clients=20", "federation.clients_per_round=3"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*base, *overrides])
    assert needle in str(err.value)


def test_every_built_in_algorithm_declares_whether_it_aggregates_asynchronously():
    """Each built-in's options (or a base of its own below AlgorithmOptions) set asynchronous_unavailable, rather
    than inheriting the default a plugin gets."""
    from fedpeft.algorithms import ALGORITHMS
    from fedpeft.config.schema import AlgorithmOptions

    able = {n for n, e in ALGORITHMS.items() if e.options.asynchronous_unavailable is None}
    assert {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox", "ffa_lora", "fedsa_lora"} <= able
    for name, entry in ALGORITHMS.items():
        if not entry.options.__module__.startswith("fedpeft."):
            continue  # (a plugin another test registered)
        own = [c for c in entry.options.__mro__[:entry.options.__mro__.index(AlgorithmOptions)]
               if "asynchronous_unavailable" in vars(c)]
        assert own, f"{name} does not declare asynchronous_unavailable"
        why = entry.options.asynchronous_unavailable
        assert why is None or (isinstance(why, str) and why), name


def test_the_buffer_defaults():
    cfg = load_config(None, ["federation.asynchronous={rule: fedbuff}", "federation.num_clients=100",
                             "federation.clients_per_round=30"])
    assert cfg.federation.asynchronous.buffer(30) == 10 and cfg.federation.asynchronous.weighting() == "sqrt"
    assert cfg.federation.asynchronous.buffer(4) == 4
    cfg = load_config(None, ["federation.asynchronous={rule: fedasync}", "federation.num_clients=100"])
    assert cfg.federation.asynchronous.buffer(2) == 1 and cfg.federation.asynchronous.weighting() == "polynomial"


# -- runs -----------------------------------------------------------------------------------------------------------
def trace(tmp_path, device=SIMULTANEOUS, n=1):
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": [device] * n}))
    return path


def learning_metrics(rows):
    """The rows without timings, the simulated clock and the asynchronous schedule's own entries."""
    own = ("client_staleness", "async_started")
    return json.loads(json.dumps([{k: v for k, v in r.items() if "sim_" not in k and k not in own}
                                  for r in without_timings(rows)]))


@pytest.mark.needs_data
@pytest.mark.parametrize("per_pass", [1, 2])
def test_fedbuff_with_every_client_arriving_together_is_synchronous_fedavg(tmp_path, per_pass):
    """Also when the clients that start together train in one fused pass (clients_per_pass 2), as they do in the
    synchronous rounds."""
    from fedpeft.runtime.embedded import EmbeddedRuntime

    devices = f"system.trace={trace(tmp_path)}"
    fused = f"runtime.clients_per_pass={per_pass}"
    sync = tiny_config("federation.rounds=3", devices, fused)
    EmbeddedRuntime(sync, tmp_path / "sync").run()
    buffered = tiny_config("federation.rounds=3", devices, fused,
                           "federation.asynchronous={rule: fedbuff, buffer_size: 2, staleness: sqrt}")
    EmbeddedRuntime(buffered, tmp_path / "fedbuff").run()
    a, b = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "fedbuff")
    assert [r["client_staleness"] for r in b[1:]] == [{str(c): 0 for c in r["clients"]} for r in b[1:]]
    assert [sorted(r["clients"]) for r in b[1:]] == [r["clients"] for r in a[1:]]
    assert learning_metrics(a) == learning_metrics(b)  # every loss, score and byte count, exactly
    assert [r["sim_time_s"] for r in b] == pytest.approx([0.0, 1.0, 2.0, 3.0])  # two latencies a round
    assert all((r.get("fused_sub_batches", 0) > 0) == (per_pass > 1) for r in b[1:])  # trained in fused passes


def eight_servers(asynchronous: str):
    """8 data-centre clients, 4 training at once, 4 aggregations."""
    return tiny_config("federation.num_clients=8", "federation.clients_per_round=4", "federation.rounds=4",
                       "system.profile=datacenter", "task.max_train_examples=96",
                       f"federation.asynchronous={asynchronous}")


@pytest.mark.needs_data
def test_stale_updates_are_weighted_and_the_timeline_does_not_depend_on_the_host(tmp_path, monkeypatch):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = eight_servers("{rule: fedbuff, buffer_size: 2}")
    EmbeddedRuntime(cfg, tmp_path / "fast").run()
    fast = read_metrics(tmp_path / "fast")
    stale = [s for r in fast[1:] for s in r["client_staleness"].values()]
    assert max(stale) >= 1  # slots are refilled from the model current then: later updates are stale
    assert all(len(r["clients"]) == 2 for r in fast[1:])
    clock = [r["sim_time_s"] for r in fast]
    assert clock == sorted(clock) and all(r["sim_round_s"] > 0 for r in fast[1:])
    for row in fast[1:]:
        assert row["sim_time_s"] == pytest.approx(clock[fast.index(row) - 1] + row["sim_round_s"])
    added = slow_host(monkeypatch)
    EmbeddedRuntime(cfg, tmp_path / "slow").run()
    slow = read_metrics(tmp_path / "slow")
    # every training of the slow run waited, and the host-timed column shows it (in-flight clients train too)
    assert len(added) >= sum(len(r["client_flops"]) for r in slow[1:])
    assert sum(r["time_client_s"] for r in slow[1:]) >= sum(added) > 0.2 * len(added)
    assert metrics_difference(without_timings(slow), without_timings(fast)) is None


@pytest.mark.needs_data
def test_a_killed_asynchronous_run_resumes_to_the_same_result(tmp_path, monkeypatch):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = eight_servers("{rule: fedbuff, buffer_size: 2, staleness: hinge, staleness_b: 0}")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    monkeypatch.undo()
    resumed = EmbeddedRuntime.resume(tmp_path / "cut")
    # the clients that were training when it was killed, with their updates and the model they started from
    assert resumed.schedule.in_flight and set(resumed.schedule.starts) >= {t.version for t in resumed.schedule.in_flight}
    resumed.run()
    full, cut = without_timings(read_metrics(tmp_path / "full")), without_timings(read_metrics(tmp_path / "cut"))
    assert metrics_difference(cut, full) is None
    assert any(s > 0 for r in full[3:] for s in r["client_staleness"].values())  # stale updates after the resume


@pytest.mark.needs_data
def test_fedasync_on_phones_that_come_and_go(tmp_path):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("federation.num_clients=12", "federation.clients_per_round=3", "federation.rounds=4",
                      "system.profile=mobile", "task.max_train_examples=96", "eval.every=0",
                      "federation.asynchronous={rule: fedasync}")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")[1:]
    assert all(len(r["clients"]) == 1 for r in rows)  # every update on its own
    clock = [r["sim_time_s"] for r in rows]
    assert clock == sorted(clock) and clock[-1] > 0 and all(r["sim_online_wait_s"] >= 0 for r in rows)


@pytest.mark.needs_data
def test_a_window_in_which_every_update_fails_is_a_failed_round(tmp_path):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("federation.num_clients=6", "federation.clients_per_round=2", "federation.rounds=2",
                      "federation.asynchronous={rule: fedbuff, buffer_size: 2}")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    before = {k: v.copy() for k, v in rt.server.global_state.items()}
    rt.transport.run_client = lambda rnd, cid, payload, **kw: (None, 100, 0, "client failed: out of battery")
    rt.run()
    rows = read_metrics(tmp_path / "run")[1:]
    assert all("round_failed" in r and "6 arrivals in a row" in r["round_failed"] for r in rows)
    assert all("out of battery" in why for r in rows for why in r["rejected"].values())
    assert all((rt.server.global_state[k] == v).all() for k, v in before.items())


@pytest.mark.needs_data
def test_an_update_carried_over_from_a_failed_window_counts_its_upload_once(tmp_path):
    """The one update that arrived in a window that then failed waits for the next window (and arrives there
    again); its bytes went up once, in the first window's row, and the server checked it once."""
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("federation.num_clients=3", "federation.clients_per_round=1", "federation.rounds=2",
                      "federation.asynchronous={rule: fedbuff, buffer_size: 2}")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    trained, uploads = rt.transport.run_client, []

    def first_only(rnd, cid, payload, **kw):
        if uploads:
            return None, 100, 0, "client failed: out of battery"
        result = trained(rnd, cid, payload, **kw)
        uploads.append(result[2])
        return result

    checked, accept = [], rt.server.accept

    def counted_accept(rnd, updates):
        checked.extend(updates)
        return accept(rnd, updates)

    rt.transport.run_client, rt.server.accept = first_only, counted_accept
    rt.run()
    rows = read_metrics(tmp_path / "run")[1:]
    assert len(rows) == 2 and all("round_failed" in r for r in rows) and uploads[0] > 0
    assert len(checked) == 1  # the server checked it once, when it first arrived
    assert [r["bytes_up_total"] for r in rows] == [uploads[0], 0]
    assert rows[-1]["cum_bytes_up"] == uploads[0]
    # a failed window aggregated no one: no client, no staleness, no split of a client's time; its clock moved on
    assert all(r["clients"] == [] and r["client_staleness"] == {} and r["sim_compute_s"] is None for r in rows)
    assert 0 < rows[0]["sim_time_s"] <= rows[1]["sim_time_s"]


def schedule_and_task(tmp_path, asynchronous: str, version: int, arrays):
    """A tiny run's schedule (not run), and a task of client 0 that started from version ``version`` with
    ``arrays`` as its update."""
    from fedpeft.runtime.asynchronous import Task
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.wire import Payload

    cfg = tiny_config("federation.num_clients=8", "federation.clients_per_round=2", "federation.rounds=1",
                      f"federation.asynchronous={asynchronous}")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    task = Task(client=0, draw=1, version=version, start_s=0.0, arrival_s=1.0, bytes_down=0,
                update=Payload(arrays(rt.server.global_state), {"round": 1, "num_examples": 4}))
    return rt, task


@pytest.mark.needs_data
def test_fedasync_mixes_the_client_model_by_its_weight(tmp_path):
    """One aggregation of one update under fedasync: x = (1 - a) x + a x_client, checked on the arrays."""
    import numpy as np

    rt, task = schedule_and_task(tmp_path, "{rule: fedasync, mixing: 0.25, staleness: sqrt}", 0,
                                 lambda now: {k: v + 1.0 for k, v in now.items()})
    rt.schedule.version = 3  # the client started 3 aggregations ago: weight 1/sqrt(4) = 0.5
    moved = rt.schedule._rebased(task).arrays
    for k, was in rt.server.global_state.items():
        assert np.allclose(moved[k], was + 0.25 * 0.5 * 1.0, atol=1e-6)
    rt.close()


@pytest.mark.needs_data
def test_fedbuff_moves_a_stale_change_onto_the_current_model_by_its_weight(tmp_path):
    import numpy as np

    rt, task = schedule_and_task(tmp_path, "{rule: fedbuff, buffer_size: 2, staleness: sqrt}", 0,
                                 lambda now: {k: v - 1.0 for k, v in now.items()})  # the start, -3, changed by +2
    now = rt.server.global_state
    rt.schedule.starts[0] = {k: v - 3.0 for k, v in now.items()}  # the model it started from, 2 aggregations ago
    rt.schedule.version = 2  # weight 1/sqrt(3)
    moved = rt.schedule._rebased(task).arrays
    for k, was in now.items():
        assert moved[k].dtype == np.float32 and np.allclose(moved[k], was + 2.0 / math.sqrt(3), atol=1e-5)
    task.version = 2  # started from the current model: the update is aggregated as it came
    assert rt.schedule._rebased(task) is task.update
    rt.close()


def test_an_unknown_weighting_is_refused():
    assert math.isclose(staleness_weight("hinge", 0), 1.0)
    with pytest.raises(ValueError, match="unknown staleness weighting"):
        staleness_weight("linear", 1)
