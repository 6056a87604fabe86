"""The embedded runtime end to end on tiny random models (fast) and real data slices."""

import json

import numpy as np
import pytest
from helpers import tiny_config, without_timings

from fedpeft import wire
from fedpeft.registry import ALGORITHMS
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime, run
from fedpeft.training.local import NonFiniteLoss

FEDAVG_FAMILY = sorted(n for n, e in ALGORITHMS.items() if e.options.supports_secure_aggregation)


@pytest.mark.parametrize("algorithm", FEDAVG_FAMILY)
@pytest.mark.needs_data
def test_every_algorithm_runs(algorithm, tmp_path):
    cfg = tiny_config(f"algorithm.name={algorithm}")
    summary = run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert summary["rounds"] == 2 and summary["rejected_updates"] == 0
    for r in rows[1:]:
        assert len(r["clients"]) == 2 and set(r["bytes_up"]) == {str(c) for c in r["clients"]}
        assert np.isfinite(r["train_loss"]) and "eval_accuracy" in r
        assert r["flops"] > 0 and r["ops_analytic"] > 0
    for name in ("config.yaml", "partition.json", "summary.json", "metrics.jsonl", "events.log"):
        assert (tmp_path / "run" / name).is_file()
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "run" / "plots").exists()  # the runtime draws nothing ...
    from fedpeft.report.plots import write_run_plots

    write_run_plots(tmp_path / "run")  # ... fedpeft run and fedpeft.run do, after the run
    assert len(list((tmp_path / "run" / "plots").glob("*.png"))) == 8  # accuracy and train_loss vs 4 axes


@pytest.mark.needs_data
def test_bytes_are_the_serialized_payload_sizes(tmp_path):
    cfg = tiny_config("federation.rounds=1")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    state0 = {k: v.copy() for k, v in rt.server.global_state.items()}
    rt.run()
    row = read_metrics(tmp_path / "run")[1]
    for cid in row["clients"]:
        expected_down = len(wire.encode(wire.Payload(state0, {"round": 1, "client": cid})))
        assert row["bytes_down"][str(cid)] == expected_down
        tensor_bytes = sum(v.nbytes for v in state0.values())
        assert tensor_bytes < row["bytes_up"][str(cid)] < tensor_bytes + 64 * 1024
    assert row["cum_bytes"] == row["bytes_up_total"] + row["bytes_down_total"]


@pytest.mark.needs_data
def test_same_config_and_seed_give_identical_metrics(tmp_path):
    cfg = tiny_config("peft.dropout=0.1")
    run(cfg, tmp_path / "a")
    run(cfg, tmp_path / "b")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert without_timings(a) == without_timings(b)
    run(tiny_config("seed=1"), tmp_path / "c")
    assert without_timings(read_metrics(tmp_path / "c")) != without_timings(a)


@pytest.mark.parametrize("model, method", [("tiny-gpt2", "lora"), ("tiny-llama", "prefix_tuning"),
                                           ("tiny-t5", "lora"), ("tiny-bart", "houlsby")])
@pytest.mark.needs_data
def test_generation_runs_with_rouge(model, method, tmp_path):
    cfg = tiny_config(f"model.name={model}", f"peft.method={method}", "task.type=generation",
                      "task.dataset=e2e_nlg", "task.train_split=validation_pairs", "task.eval_split=test",
                      "eval.max_examples=8", "task.generation_max_new_tokens=8", "federation.rounds=1")
    run(cfg, tmp_path / "run")
    last = read_metrics(tmp_path / "run")[-1]
    for k in ("eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_loss"):
        assert k in last and np.isfinite(last[k])
    assert len(last["eval_samples"]) == 3


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-t5"])
@pytest.mark.needs_data
def test_multiple_choice_runs(model, tmp_path):
    cfg = tiny_config(f"model.name={model}", "task.type=multiple_choice", "task.dataset=arc_easy",
                      "task.train_split=test[:80%]", "task.eval_split=test[80%:]", "eval.max_examples=16", "federation.rounds=1",
                      "task.max_length=96")
    run(cfg, tmp_path / "run")
    last = read_metrics(tmp_path / "run")[-1]
    assert 0.0 <= last["eval_accuracy"] <= 1.0 and 0.0 <= last["eval_accuracy_norm"] <= 1.0


@pytest.mark.needs_data
def test_bad_updates_are_rejected_logged_and_not_aggregated(tmp_path, monkeypatch):
    cfg = tiny_config("federation.rounds=1", "federation.clients_per_round=3")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    before = {k: v.copy() for k, v in rt.server.global_state.items()}
    selected = rt.server.select(1)
    poisoned, crashed = selected[0], selected[1]
    original = rt.client.fit

    def fit(payload, ctx):
        if ctx.client_id == crashed:
            raise NonFiniteLoss("non-finite training loss (nan) at local step 1")
        update = original(payload, ctx)
        if ctx.client_id == poisoned:
            name = next(iter(update.arrays))
            update.arrays[name] = np.full_like(update.arrays[name], np.nan)
        return update

    monkeypatch.setattr(rt.client, "fit", fit)
    aggregated = []
    real_aggregate = rt.server.aggregate
    monkeypatch.setattr(rt.server, "aggregate", lambda rnd, ups: (aggregated.append(sorted(ups)), real_aggregate(rnd, ups))[1])
    rt.run()
    row = read_metrics(tmp_path / "run")[1]
    assert "NaN or Inf" in row["rejected"][str(poisoned)]
    assert "non-finite training loss" in row["rejected"][str(crashed)]
    assert aggregated == [[selected[2]]]
    assert all(np.all(np.isfinite(v)) for v in rt.server.global_state.values())
    assert any(not np.array_equal(before[k], rt.server.global_state[k]) for k in before)
    log = (tmp_path / "run" / "events.log").read_text()
    assert f"client {poisoned} rejected" in log and f"client {crashed} rejected" in log


@pytest.mark.needs_data
@pytest.mark.parametrize("algorithm", ["fedavg", "headprune", "ffa_lora"])
def test_bad_update_metadata_rejects_that_update_and_the_round_goes_on(algorithm, tmp_path, monkeypatch):
    """The shapes that crashed the server: train_loss a string or not finite, train_flops a string,
    train_ops_analytic a list, num_examples 10**400. Each rejects its update with the key in the reason (a missing
    train_loss is no error: the round's train_loss is the mean of those reported, test below)."""
    breaks = [("train_loss", [0.5]), ("train_loss", "0.5"), ("train_flops", "fast"), ("train_ops_analytic", [1.0]),
              ("num_examples", 10**400)]
    cfg = tiny_config("federation.rounds=1", f"federation.clients_per_round={len(breaks) + 1}",
                      "federation.num_clients=8", f"algorithm.name={algorithm}")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    selected = rt.server.select(1)
    broken = dict(zip(selected, breaks))
    original = rt.client.fit

    def fit(payload, ctx):
        update = original(payload, ctx)
        if ctx.client_id in broken:
            key, value = broken[ctx.client_id]
            update.meta[key] = value
        return update

    monkeypatch.setattr(rt.client, "fit", fit)
    summary = rt.run()
    row = read_metrics(tmp_path / "run")[1]
    assert "round_failed" not in row and summary["rounds"] == 1
    assert sorted(row["client_train_loss"]) == [str(c) for c in selected if c not in broken]
    for cid, (key, _) in broken.items():
        assert f"update metadata {key}:" in row["rejected"][str(cid)]
    log = (tmp_path / "run" / "events.log").read_text()
    assert all(f"client {cid} rejected: update metadata" in log for cid in broken)


@pytest.mark.needs_data
def test_an_update_without_train_loss_or_with_unencodable_metadata(tmp_path, monkeypatch):
    """A client half that reports no train_loss is aggregated (the round's train_loss is the others' mean);
    one whose metadata cannot be encoded (NaN) fails alone, with the reason."""
    cfg = tiny_config("federation.rounds=1", "federation.clients_per_round=3")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    quiet, nan, honest = rt.server.select(1)
    original = rt.client.fit

    def fit(payload, ctx):
        update = original(payload, ctx)
        if ctx.client_id == quiet:
            del update.meta["train_loss"]
        if ctx.client_id == nan:
            update.meta["train_loss"] = float("nan")
        return update

    monkeypatch.setattr(rt.client, "fit", fit)
    rt.run()
    row = read_metrics(tmp_path / "run")[1]
    assert list(row["rejected"]) == [str(nan)] and "not plain finite JSON" in row["rejected"][str(nan)]
    assert row["client_train_loss"][str(quiet)] is None
    assert row["train_loss"] == pytest.approx(row["client_train_loss"][str(honest)])


@pytest.mark.needs_data
def test_the_default_update_limit_follows_the_trainable_size(tmp_path, monkeypatch):
    """runtime.max_payload_mb unset: an update may be twice the trainable state's encoded size plus 1 MiB; one
    above that is refused before it is decoded, with the option to raise named."""
    from fedpeft import wire

    rt = EmbeddedRuntime(tiny_config("federation.rounds=1"), tmp_path / "run")
    spec = {k: (v.shape, "float32") for k, v in rt.server.global_state.items()}
    assert rt.max_payload == 2 * wire.encoded_size(spec, {}) + 2**20
    assert rt.max_payload < 4 * 2**20  # tiny-bert's LoRA: far below the 4 GiB of old
    explicit = EmbeddedRuntime(tiny_config("federation.rounds=1", "runtime.max_payload_mb=8"), tmp_path / "run2")
    assert explicit.max_payload == 8 * 2**20
    explicit.close()
    original = rt.client.fit
    victim = rt.server.select(1)[0]

    def fit(payload, ctx):
        update = original(payload, ctx)
        if ctx.client_id == victim:
            update.meta["padding"] = "x" * rt.max_payload
        return update

    monkeypatch.setattr(rt.client, "fit", fit)
    rt.run()
    reason = read_metrics(tmp_path / "run")[1]["rejected"][str(victim)]
    assert f"exceeds the limit of {rt.max_payload} bytes (runtime.max_payload_mb)" in reason


@pytest.mark.needs_data
def test_clients_keep_no_state_under_fedavg(tmp_path):
    rt = EmbeddedRuntime(tiny_config("federation.num_clients=20", "federation.clients_per_round=4"), tmp_path / "run")
    rt.run()
    assert rt.client_states == {}


@pytest.mark.needs_data
def test_local_steps_and_eval_every(tmp_path):
    cfg = tiny_config("train.local_steps=3", "federation.rounds=3", "eval.every=2", "eval.at_start=false")
    run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [("eval_accuracy" in r) for r in rows] == [False, True, True]  # rounds 1, 2, 3 (last always)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_round"] == 3


@pytest.mark.parametrize("method, files", [("houlsby", {"fedpeft_adapter.safetensors", "fedpeft_adapter.json"}),
                                           ("ia3", {"adapter_model.safetensors", "adapter_config.json"})])
@pytest.mark.needs_data
def test_final_adapter_is_saved(method, files, tmp_path):
    run(tiny_config(f"peft.method={method}", "federation.rounds=1"), tmp_path / "run")
    assert files <= {p.name for p in (tmp_path / "run" / "adapter").iterdir()}


@pytest.mark.needs_data
def test_label_skew_partition_is_saved(tmp_path):
    run(tiny_config("federation.partition.scheme=dirichlet_label", "federation.partition.alpha=0.1",
                    "federation.rounds=1"), tmp_path / "run")
    stats = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert stats["num_clients"] == 4 and stats["num_examples"] == 64 and "labels" in stats["clients"][0]


@pytest.mark.needs_data
def test_mixed_precision_autocast_runs_on_cpu(tmp_path):
    run(tiny_config("runtime.precision=bf16", "runtime.device=cpu", "federation.rounds=1"), tmp_path / "run")
    assert np.isfinite(read_metrics(tmp_path / "run")[-1]["eval_loss"])


@pytest.mark.needs_data
def test_more_clients_than_examples_is_a_clear_error(tmp_path):
    from fedpeft.data.partition import PartitionError

    with pytest.raises(PartitionError, match="cannot give 100 clients at least 1"):
        run(tiny_config("federation.num_clients=100", "task.max_train_examples=50"), tmp_path / "run")


def test_fp16_on_cpu_is_rejected_before_work():
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        tiny_config("runtime.precision=fp16", "runtime.device=cpu")


@pytest.mark.needs_data
def test_min_replies_keeps_the_global_model_when_too_few_arrive(tmp_path):
    cfg = tiny_config("federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=1",
                      "federation.min_replies=2", "train.local_steps=1")
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    before = {k: v.copy() for k, v in rt.server.global_state.items()}
    real = rt.transport.run_client
    rt.transport.run_client = lambda rnd, cid, p: (None, 0, 0, "killed") if cid == 1 else real(rnd, cid, p)
    rt.run()
    row = read_metrics(tmp_path / "run")[1]
    assert "1 of 2 updates accepted, federation.min_replies is 2" in row["round_failed"]
    assert all(np.array_equal(before[k], rt.server.global_state[k]) for k in before)
