"""The simulated system (``system``): device profiles and traces, the virtual clock of a round (by hand), the
config's checks, selection among online clients, and runs whose timeline does not depend on the host."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import slow_host, tiny_config

from fedpeft.algorithms.base import random_selection
from fedpeft.algorithms.headprune.halves import loss_difference_selection
from fedpeft.config.load import ConfigError, load_config
from fedpeft.errors import UserError
from fedpeft.rundir import read_metrics
from fedpeft.system.clock import ClientTime, client_time, close_round
from fedpeft.system.devices import DAY_S, MBIT, REFERENCE_FLOPS_PER_S, daily_windows, draw_profile
from fedpeft.system.traces import TraceError, load_trace

SIM_KEYS = ("sim_round_s", "sim_time_s", "sim_download_s", "sim_compute_s", "sim_upload_s", "sim_wait_s",
            "sim_online_wait_s", "client_sim_s", "sim_dropped")


# -- devices ------------------------------------------------------------------------------------------------------
def test_the_ideal_profile_is_the_reference_speed_with_free_transfers_and_always_online():
    d = draw_profile("ideal", 5, seed=3)
    assert (d.flops_per_s == REFERENCE_FLOPS_PER_S).all() and d.availability is None
    t = client_time(d, 2, bytes_down=10**9, flops=3e12, bytes_up=10**9)
    assert t == ClientTime(0.0, 3.0, 0.0)


@pytest.mark.parametrize("profile", ["datacenter", "mobile"])
def test_profiles_are_a_pure_function_of_the_seed(profile):
    a, b, c = draw_profile(profile, 1000, 7), draw_profile(profile, 1000, 7), draw_profile(profile, 1000, 8)
    assert np.array_equal(a.flops_per_s, b.flops_per_s) and np.array_equal(a.latency_s, b.latency_s)
    assert not np.array_equal(a.flops_per_s, c.flops_per_s)
    assert (a.flops_per_s > 0).all() and (a.upload_bytes_per_s > 0).all() and (a.latency_s > 0).all()


def test_the_mobile_profile_is_heavy_tailed_slower_and_comes_and_goes():
    mobile, dc = draw_profile("mobile", 10_000, 0), draw_profile("datacenter", 10_000, 0)
    p5, p50, p95 = np.percentile(mobile.flops_per_s, [5, 50, 95])
    assert p95 / p5 > 20  # lognormal sigma 1: 5-95% spans e^(2 x 1.645) = 27x
    assert math.isclose(p50, 5e10, rel_tol=0.05)
    assert np.median(mobile.upload_bytes_per_s) < np.median(mobile.download_bytes_per_s)
    assert np.median(dc.flops_per_s) > 100 * p50 and dc.availability is None
    share = mobile.availability.online(0.0).mean()
    assert 0.05 < share < 0.3  # one window of ~3 h (median) a day
    assert mobile.availability.online(0.0).tolist() == mobile.availability.online(DAY_S).tolist()  # daily


def test_daily_windows_wrap_past_midnight():
    a = daily_windows(np.array([DAY_S - 3600.0, 1000.0]), np.array([7200.0, 10.0]))
    assert a.online(DAY_S - 10).tolist() == [True, False]
    assert a.online(1800.0).tolist() == [True, False]  # the next day's first hour
    assert a.online(1005.0).tolist() == [True, True]
    assert a.online(4000.0).tolist() == [False, False]
    assert a.online_for(0, DAY_S - 1800.0) == pytest.approx(5400.0)  # the rest of the window, past midnight
    assert a.online_for(1, 1005.0) == pytest.approx(5.0)
    assert a.online_for(1, 2000.0) == 0.0
    assert a.first_time_with(2, 2000.0) == pytest.approx(DAY_S + 1000.0)  # both online next at 1000 s tomorrow
    assert a.first_time_with(1, 5000.0) == pytest.approx(DAY_S - 3600.0)
    assert a.first_time_with(3, 0.0) is None


def test_first_time_with_finds_the_earliest_instant_on_random_windows_far_from_zero():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        a = daily_windows(rng.uniform(0, DAY_S, n), rng.lognormal(np.log(3600), 1.0, n))
        t, count = float(rng.uniform(0, 30 * DAY_S)), int(rng.integers(1, n + 1))
        found = a.first_time_with(count, t)
        if found is None:  # then no instant of the next day has that many online
            assert not any(a.online(x).sum() >= count for x in np.arange(t, t + DAY_S, 30.0))
            continue
        assert a.online(found).sum() >= count and found >= t
        assert found == t or a.online(found - 1.0).sum() < count  # and not a second later than needed


def test_a_client_online_all_day_never_leaves():
    a = daily_windows(np.array([5000.0]), np.array([2 * DAY_S]))
    assert a.online_for(0, 123.0) == math.inf and a.online(DAY_S - 1).tolist() == [True]


# -- the clock of a round, by hand ---------------------------------------------------------------------------------
def test_a_client_time_is_download_compute_upload():
    d = draw_profile("datacenter", 3, 0)
    t = client_time(d, 1, bytes_down=2_000_000, flops=1e12, bytes_up=500_000)
    lat = float(d.latency_s[1])
    assert t.download_s == pytest.approx(lat + 2_000_000 / d.download_bytes_per_s[1])
    assert t.compute_s == pytest.approx(1e12 / d.flops_per_s[1])
    assert t.upload_s == pytest.approx(lat + 500_000 / d.upload_bytes_per_s[1])
    assert t.total_s == pytest.approx(t.download_s + t.compute_s + t.upload_s)


def test_a_round_waits_for_every_client_without_a_deadline():
    tl = close_round({0: 5.0, 1: 9.0, 2: 3.0}, {}, {0, 1, 2}, needed=None, deadline_s=None)
    assert tl.counted == [2, 0, 1] and tl.dropped == {} and tl.duration_s == 9.0


def test_a_deadline_drops_late_updates_and_ends_the_round_at_it():
    tl = close_round({0: 5.0, 1: 9.0, 2: 3.0}, {}, {0, 1, 2}, needed=None, deadline_s=6.0)
    assert tl.counted == [2, 0] and list(tl.dropped) == [1] and "after system.deadline_s=6" in tl.dropped[1]
    assert tl.duration_s == 6.0
    early = close_round({0: 5.0, 2: 3.0}, {}, {0, 2}, needed=None, deadline_s=6.0)
    assert early.duration_s == 5.0  # everyone in before the deadline: the round ends then


def test_over_selection_aggregates_the_first_accepted_arrivals():
    # client 2 arrives first but is refused by the server's checks: the round waits for the next
    tl = close_round({0: 5.0, 1: 9.0, 2: 3.0, 3: 4.0}, {}, {0, 1, 3}, needed=2, deadline_s=None)
    assert tl.counted == [3, 0] and tl.duration_s == 5.0
    assert "after the first 2 updates" in tl.dropped[1] and 2 not in tl.dropped
    short = close_round({0: 5.0, 1: 9.0}, {}, {0, 1}, needed=3, deadline_s=7.0)  # fewer than needed by the deadline
    assert short.counted == [0] and short.duration_s == 7.0


def test_a_client_going_offline_before_its_update_arrives_fails_then():
    tl = close_round({0: 5.0, 1: 9.0}, {1: 4.0}, {0, 1}, needed=None, deadline_s=None)
    assert tl.counted == [0] and "went offline 4 s" in tl.dropped[1] and tl.duration_s == 5.0
    # offline after the deadline: the round does not wait past it
    late = close_round({0: 100.0, 1: 5.0}, {0: 50.0}, {0, 1}, needed=None, deadline_s=10.0)
    assert late.counted == [1] and late.duration_s == 10.0


def test_over_selected_surplus_is_not_a_failure():
    tl = close_round({0: 1.0, 1: 2.0, 2: 3.0}, {}, {0, 1, 2}, needed=2, deadline_s=None)
    assert tl.surplus == {2} and set(tl.dropped) == {2}


# -- traces -------------------------------------------------------------------------------------------------------
def write_trace(tmp_path, devices, period=None, name="trace.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"devices": devices, **({"period_s": period} if period else {})}))
    return path


def test_a_json_trace_gives_each_client_its_device(tmp_path):
    path = write_trace(tmp_path, [
        {"flops_per_s": 2e10, "download_mbps": 20, "upload_mbps": 5, "latency_s": 0.05, "online": [[0, 100]]},
        {"slowdown": 4, "download_mbps": 8, "upload_mbps": 2, "active": [50, 10], "inactive": [60, 20]},
    ], period=200)
    d = load_trace(path, 3)  # client 2 gets device 0 again
    assert d.flops_per_s.tolist() == [2e10, REFERENCE_FLOPS_PER_S / 4, 2e10]
    assert d.download_bytes_per_s.tolist() == [20 * MBIT, 8 * MBIT, 20 * MBIT]
    assert d.latency_s.tolist() == [0.05, 0.0, 0.05]
    assert d.availability.online(15.0).tolist() == [True, True, True]
    assert d.availability.online(55.0).tolist() == [True, True, True]
    assert d.availability.online(30.0).tolist() == [True, False, True]
    assert d.availability.online(330.0).tolist() == [False, False, False]  # period 200: 330 is 130
    assert d.availability.online(230.0).tolist() == [True, False, True]  # and 230 is 30
    assert "sha256" in d.source


def test_a_parquet_trace_reads_as_the_json_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"flops_per_s": [2e10, 5e10], "download_mbps": [20.0, 8.0], "upload_mbps": [5.0, 2.0],
                      "online": [[[0.0, 100.0]], [[10.0, 20.0], [50.0, 60.0]]], "period_s": [200.0, 200.0]})
    pq.write_table(table, tmp_path / "trace.parquet")
    d = load_trace(tmp_path / "trace.parquet", 2)
    assert d.flops_per_s.tolist() == [2e10, 5e10]
    assert d.availability.online(55.0).tolist() == [True, True] and d.availability.online(30.0).tolist() == [True, False]


def test_a_parquet_trace_with_fedscale_windows_has_null_for_an_always_online_device(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"flops_per_s": [2e10, 5e10], "download_mbps": [20.0, 8.0], "upload_mbps": [5.0, 2.0],
                      "active": [[10.0, 50.0], None], "inactive": [[20.0, 60.0], None], "period_s": [200.0, 200.0]})
    pq.write_table(table, tmp_path / "trace.parquet")
    d = load_trace(tmp_path / "trace.parquet", 2)
    assert d.availability.online(55.0).tolist() == [True, True] and d.availability.online(30.0).tolist() == [False, True]


@pytest.mark.parametrize(("devices", "needle"), [
    ([{"download_mbps": 1, "upload_mbps": 1}], "device 0 gives neither flops_per_s nor slowdown"),
    ([{"flops_per_s": 1e9, "slowdown": 2, "download_mbps": 1, "upload_mbps": 1}], "gives flops_per_s and slowdown"),
    ([{"flops_per_s": 1e9, "upload_mbps": 1}], "device 0 has no download_mbps"),
    ([{"flops_per_s": 1e9, "download_mbps": 0, "upload_mbps": 1}], "download_mbps is 0; give a finite number > 0"),
    ([{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "speed": 3}], "unknown key 'speed'"),
    ([{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "online": [[5, 2]]}], "window 0 is [5, 2]"),
    ([{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "active": [1], "inactive": []}], "same length"),
    ([{"flops_per_s": True, "download_mbps": 1, "upload_mbps": 1}], "flops_per_s is True"),
    ([], "holds no devices"),
    ([{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "period_s": 5}], "unknown key 'period_s'"),
    ([{"flops_per_s": 10**400, "download_mbps": 1, "upload_mbps": 1}], "flops_per_s is 1000000"),
    ([{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "online": []}], "a non-empty list"),
])
def test_a_bad_trace_is_one_line_naming_the_file_device_and_key(tmp_path, devices, needle):
    path = write_trace(tmp_path, devices)
    with pytest.raises(TraceError) as err:
        load_trace(path, 2)
    assert needle in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_null_latency_is_the_default(tmp_path):
    path = write_trace(tmp_path, [{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "latency_s": None}])
    assert load_trace(path, 1).latency_s.tolist() == [0.0]


def test_a_pickle_trace_is_never_read(tmp_path):
    path = tmp_path / "client_device_capacity"
    path.write_bytes(b"\x80\x04N.")  # a pickle of None: never unpickled
    with pytest.raises(TraceError, match="never read"):
        load_trace(path, 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(bad, 2)


def test_a_window_past_the_period_is_refused(tmp_path):
    path = write_trace(tmp_path, [{"flops_per_s": 1e9, "download_mbps": 1, "upload_mbps": 1, "online": [[0, 300]]}],
                       period=200)
    with pytest.raises(TraceError, match="ends at 300 s, after period_s 200"):
        load_trace(path, 1)


# -- the config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "needle"), [
    (["system.over_selection=3", "federation.num_clients=4", "federation.clients_per_round=2"],
     "selects 8 clients a round, more than federation.num_clients (4)"),
    (["system.profile=mobile", "runtime.flops_sample_steps=0"], "runtime.flops_sample_steps is 0"),
    (["system.deadline_s=10", "runtime.flops_sample_steps=0"], "runtime.flops_sample_steps is 0"),
    (["system.over_selection=0.5", "algorithm.dp={noise_multiplier: 1.0}"], "algorithm.dp with system.over_selection"),
    (["system.profile=mobile", "system.trace=x.json"], "both name the devices"),
    (["system.profile=datacenter", "runtime.name=flower"], "simulated devices and links run in the embedded runtime"),
    (["system.deadline_s=600", "runtime.name=flower"], "is not shorter than federation.round_timeout_s 600"),
    (["system.over_selection=0.5", "runtime.name=flower", "runtime.flower.secure_aggregation={}",
      "runtime.flower.num_supernodes=4", "federation.num_clients=4"], "SecAgg+ runs its own rounds"),
    (["system.deadline_s=0"], "greater than 0"),
    (["system.profile=mobile", "runtime.clients_per_pass=auto"], "clients_per_pass: auto picks its number by timing"),
])
def test_the_config_refuses_what_the_clock_cannot_simulate(overrides, needle):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_over_selection_rounds_up():
    cfg = load_config(None, ["system.over_selection=0.3", "federation.clients_per_round=10",
                             "federation.num_clients=100"])
    assert cfg.system.selected(10) == 13 and cfg.system.selected(3) == 4


# -- selection among the online clients --------------------------------------------------------------------------
def test_selection_among_every_client_is_the_selection_without_a_population():
    for seed, rnd in [(0, 1), (5, 7), (123, 2)]:
        assert random_selection(50, 5, seed, rnd, list(range(50))) == random_selection(50, 5, seed, rnd)
    chosen = random_selection(50, 5, 0, 1, [3, 9, 11, 40])
    assert chosen == [3, 9, 11, 40]  # fewer online than K: all of them
    assert set(random_selection(50, 3, 0, 1, [3, 9, 11, 40, 41])) <= {3, 9, 11, 40, 41}


def test_loss_difference_selection_keeps_to_the_online_clients():
    losses = {0: 1.0, 1: 5.0, 2: 3.0, 3: 4.0}
    everyone = loss_difference_selection(losses, 0.5, 4, 2, 0, 1)
    assert everyone == loss_difference_selection(losses, 0.5, 4, 2, 0, 1, population=[0, 1, 2, 3])
    assert everyone[0] == [1, 3]
    assert loss_difference_selection(losses, 0.5, 4, 2, 0, 1, population=[0, 2, 3])[0] == [2, 3]


# -- runs -----------------------------------------------------------------------------------------------------------
def sim_columns(rows):
    return [{k: r.get(k) for k in SIM_KEYS} for r in rows]


@pytest.mark.needs_data
def test_every_run_has_the_ideal_clock_and_it_does_not_depend_on_the_host(tmp_path, monkeypatch):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("federation.rounds=2")
    summary = EmbeddedRuntime(cfg, tmp_path / "fast").run()
    fast = read_metrics(tmp_path / "fast")
    assert fast[0]["sim_time_s"] == 0.0
    for row in fast[1:]:
        flops = {c: f for c, f in row["client_flops"].items()}
        assert row["client_sim_s"] == pytest.approx({c: f / REFERENCE_FLOPS_PER_S for c, f in flops.items()})
        assert row["sim_round_s"] == pytest.approx(max(row["client_sim_s"].values()))
        assert row["sim_download_s"] == row["sim_upload_s"] == 0.0
        parts = row["sim_download_s"] + row["sim_compute_s"] + row["sim_upload_s"] + row["sim_wait_s"]
        assert parts == pytest.approx(row["sim_round_s"])
    assert fast[2]["sim_time_s"] == pytest.approx(fast[1]["sim_round_s"] + fast[2]["sim_round_s"])
    assert summary["sim_time_s"] == fast[2]["sim_time_s"]

    added = slow_host(monkeypatch)
    EmbeddedRuntime(cfg, tmp_path / "slow").run()
    slow = read_metrics(tmp_path / "slow")
    # every client of the slow run waited (and its host-timed column shows it) on top of its training
    assert len(added) == sum(len(r["client_flops"]) for r in slow[1:])
    assert sum(r["time_client_s"] for r in slow[1:]) >= sum(added) > 0.2 * len(added)
    assert sim_columns(slow) == sim_columns(fast)


@pytest.mark.needs_data
def test_a_deadline_drops_late_clients_and_over_selection_aggregates_the_first(tmp_path):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("system.profile=datacenter", "system.over_selection=0.5", "federation.clients_per_round=2",
                      "federation.rounds=2")
    EmbeddedRuntime(cfg, tmp_path / "over").run()
    for row in read_metrics(tmp_path / "over")[1:]:
        assert len(row["clients"]) == 3 and len(row["client_num_examples"]) == 2 and row["sim_dropped"] == 1
        (late,) = [c for c, why in row["rejected"].items() if "system.over_selection" in why]
        arrived = sorted(row["client_sim_s"], key=lambda c: row["client_sim_s"][c])
        assert late == arrived[-1]  # the last of the three to arrive
        assert row["sim_round_s"] == pytest.approx(row["client_sim_s"][arrived[1]])

    # a deadline between the fastest and the slowest client of the first round
    times = sorted(read_metrics(tmp_path / "over")[1]["client_sim_s"].values())
    cfg = tiny_config("system.profile=datacenter", "system.over_selection=0.5", "federation.clients_per_round=2",
                      "federation.rounds=1", f"system.deadline_s={(times[0] + times[1]) / 2}")
    EmbeddedRuntime(cfg, tmp_path / "deadline").run()
    row = read_metrics(tmp_path / "deadline")[1]
    assert len(row["client_num_examples"]) == 1 and row["sim_dropped"] == 2
    assert sum("after system.deadline_s" in why for why in row["rejected"].values()) == 2
    assert row["sim_round_s"] == pytest.approx((times[0] + times[1]) / 2)


@pytest.mark.needs_data
def test_a_run_replayed_on_other_devices_has_the_timeline_of_a_run_on_them(tmp_path):
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.simclock import replay

    EmbeddedRuntime(tiny_config(), tmp_path / "ideal").run()
    datacenter = tiny_config("system.profile=datacenter")
    EmbeddedRuntime(datacenter, tmp_path / "dc").run()
    ideal_rows, dc_rows = read_metrics(tmp_path / "ideal"), read_metrics(tmp_path / "dc")
    assert sim_columns(ideal_rows) != sim_columns(dc_rows)  # the devices and links do change the timeline
    assert [{k: r.get(k) for k in ("round", *SIM_KEYS)} for r in replay(datacenter, ideal_rows)] == [
        {"round": r["round"], **{k: r.get(k) for k in SIM_KEYS}} for r in dc_rows]

    for overrides in (["system.profile=mobile"], ["system.profile=datacenter", "system.deadline_s=5"]):
        with pytest.raises(UserError, match="run the config with that system instead"):
            replay(tiny_config(*overrides), ideal_rows)
    ideal_rows[1]["rejected"] = {"0": "refused"}
    with pytest.raises(UserError, match="round 1 rejected updates of clients"):
        replay(datacenter, ideal_rows)
    ideal_rows[1]["rejected"], ideal_rows[2]["sim_online_wait_s"] = {}, 3.0  # a row of a run whose clients come and go
    with pytest.raises(UserError, match="round 2 waited for clients to come online or dropped updates"):
        replay(datacenter, ideal_rows)


@pytest.mark.needs_data
def test_mobile_clients_are_selected_only_when_online_and_a_resumed_run_keeps_the_clock(tmp_path, monkeypatch):
    from helpers import crash_at_round

    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.system.devices import draw_profile as draw

    cfg = tiny_config("system.profile=mobile", "federation.num_clients=20", "federation.clients_per_round=3",
                      "federation.rounds=3", "task.max_train_examples=120")
    EmbeddedRuntime(cfg, tmp_path / "full").run()
    full = read_metrics(tmp_path / "full")
    devices = draw("mobile", 20, cfg.seed)
    before = 0.0
    for row in full[1:]:
        start = before + row["sim_online_wait_s"]  # the round's clients were drawn from those online then
        online = devices.availability.online(start)
        assert all(online[c] for c in row["clients"]) and row["sim_time_s"] > before
        before = row["sim_time_s"]
    rt = EmbeddedRuntime(cfg, tmp_path / "cut")
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "cut").run()
    assert sim_columns(read_metrics(tmp_path / "cut")) == sim_columns(full)


@pytest.mark.needs_data
def test_a_select_that_ignores_the_online_clients_gets_their_failure(tmp_path, monkeypatch):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    cfg = tiny_config("system.profile=mobile", "federation.num_clients=20", "federation.clients_per_round=3",
                      "federation.rounds=2", "task.max_train_examples=120")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    picks = {}

    def one_offline(rnd):  # a plugin's select() that does not look at ServerAlgorithm.online
        online = list(rt.server.online or [])
        picks[rnd] = sorted([next(c for c in range(20) if c not in online), *online[:2]])
        return picks[rnd]

    monkeypatch.setattr(rt.server, "select", one_offline)
    rt.run()
    for row in read_metrics(tmp_path / "run")[1:]:
        assert row["clients"] == picks[row["round"]]
        (offline,) = [c for c in row["clients"] if "offline when selected" in row["rejected"].get(str(c), "")]
        assert str(offline) not in row["client_num_examples"] and row["bytes_down"][str(offline)] == 0



def test_the_fedscale_conversion_sample_writes_a_trace_fedpeft_reads(tmp_path, monkeypatch):
    """docs/guide/system.md's conversion, on pickles shaped like FedScale's (written here, so ours to load)."""
    import pickle

    from docs_samples import docs_sample

    monkeypatch.chdir(tmp_path)
    capacity = {1: {"computation": 153.0, "communication": 2209.61}, 2: {"computation": 50.0, "communication": 800.0},
                3: {"computation": 100.0, "communication": 12000.0}}
    behaviour = {7: {"duration": 9000, "active": [0, 5000], "inactive": [3000, 8000], "finish_time": 9000,
                     "model": "a"},
                 8: {"duration": 6000, "active": [1000], "inactive": [2000], "finish_time": 6000, "model": "b"}}
    (tmp_path / "client_device_capacity").write_bytes(pickle.dumps(capacity))
    (tmp_path / "client_behave_trace").write_bytes(pickle.dumps(behaviour))
    exec(compile(docs_sample("fedscale-to-trace"), "docs fedscale-to-trace sample", "exec"), {})  # noqa: S102
    d = load_trace(tmp_path / "fedscale-trace.json", 3)
    assert d.flops_per_s.tolist() == pytest.approx([REFERENCE_FLOPS_PER_S / 1.53, REFERENCE_FLOPS_PER_S / 0.5,
                                                    REFERENCE_FLOPS_PER_S])
    assert d.upload_bytes_per_s.tolist() == pytest.approx([2.20961 * MBIT, 0.8 * MBIT, 12 * MBIT])
    assert d.availability.period_s == 9000
    assert d.availability.online(1500.0).tolist() == [True, True, True]
    assert d.availability.online(4000.0).tolist() == [False, False, False]
    assert d.availability.online(5500.0).tolist() == [True, False, True]
