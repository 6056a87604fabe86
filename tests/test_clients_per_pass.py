"""runtime.clients_per_pass: a round's clients trained together over the one backbone give each client the
update it gets alone.

Tolerance: floats agree to a relative 1e-4 (absolute 1e-7), byte counts to 16 bytes, everything else exactly.
A fused pass computes each row with other matrix-product blockings (batched products, another padded length),
so float32 sums round differently (about 1e-7 relative per operation); AdamW's first steps divide a gradient
by its own magnitude, so a coordinate whose true gradient is zero (a key projection's bias under softmax) moves
by +-lr on rounding noise alone, and over a few steps the metrics agree to about 1e-5. Dropout is off in these
comparisons (model.dropout=0, peft.dropout=0): a fused pass draws its dropout masks for the fused batch, so
with dropout on a run is reproducible for a given clients_per_pass but not draw for draw the sequential one.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Literal

import numpy as np
import pytest
import torch
from golden_runs import GOLDEN, is_timing
from helpers import metrics_difference, tiny_config, without_timings

import fedpeft
from fedpeft.algorithms import ALGORITHMS, make_client
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedavg.options import FedAvgOptions
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.training.fused import pack_rows
from fedpeft.training.fused_loss import ClientLosses, client_losses
from fedpeft.tuners import PEFT_METHODS
from fedpeft.tuners.row_batched import (
    RowBatchUnsupported,
    built_in_row_forwards,
    row_batched_modules,
)

FUSED_KEYS = ("clients_per_pass", "fused_sub_batches", "fused_micro_steps", "fused_padded_share", "alone_padded_share")


def different(a, b) -> str | None:
    """None if two runs' metrics agree within the module's tolerance, else where they first differ."""
    return metrics_difference(a, b, rel_tol=1e-4)


def deterministic(*overrides: str, per_pass: int, plugins=()) -> fedpeft.RunConfig:
    """A tiny config with every dropout off, all clients selected each round (up to 4) and ``per_pass``."""
    clients = next((int(o.split("=")[1]) for o in overrides if o.startswith("federation.num_clients=")), 4)
    common = ["model.dropout=0", f"runtime.clients_per_pass={per_pass}"]
    if not any(o.startswith("federation.clients_per_round=") for o in overrides):
        common.append(f"federation.clients_per_round={min(4, clients)}")
    cfg = tiny_config(*overrides, *common, plugins=plugins)
    if "dropout" in type(cfg.peft).model_fields:
        common.append("peft.dropout=0")
    return tiny_config(*overrides, *common, plugins=plugins)


def metrics(cfg, run_dir) -> list[dict]:
    EmbeddedRuntime(cfg, run_dir).run()
    # (the FLOPs, and the simulated time computed from them, count each pass's padding, which differs together)
    rows = [{k: v for k, v in r.items() if not is_timing(k) and "flops" not in k and "sim_" not in k
             and k not in FUSED_KEYS}
            for r in without_timings(read_metrics(run_dir))]
    return json.loads(json.dumps(rows))


def assert_same_as_alone(overrides, tmp_path, per_pass: int = 4, plugins=()) -> None:
    alone = metrics(deterministic(*overrides, per_pass=1, plugins=plugins), tmp_path / "alone")
    together = metrics(deterministic(*overrides, per_pass=per_pass, plugins=plugins), tmp_path / "together")
    assert (difference := different(alone, together)) is None, difference
    rows = read_metrics(tmp_path / "together")
    return rows


@pytest.mark.parametrize("name", sorted(GOLDEN))
@pytest.mark.needs_data
def test_every_algorithm_and_peft_method_gives_the_same_metrics_trained_together(name, tmp_path, caplog):
    """GOLDEN has a run of every registered algorithm and PEFT method (tests/test_golden.py checks it)."""
    with caplog.at_level(logging.INFO, logger="fedpeft"):
        rows = assert_same_as_alone(GOLDEN[name], tmp_path)
    cfg = tiny_config(*GOLDEN[name])
    if PEFT_METHODS.get(cfg.peft.method).trains_batched and make_client(cfg.algorithm).trains_batched:  # fused passes ran (FedSP: the auxiliary model's body, then each client's prompts
        # alone, over its own body) and are reported
        assert all(r["fused_sub_batches"] > 0 for r in rows[1:]), caplog.text
        assert all(0 <= r["fused_padded_share"] <= r["alone_padded_share"] for r in rows[1:])
    else:
        assert "fused_sub_batches" not in rows[1] and "the clients train one at a time" in caplog.text
        # (flexlora's reference factorisation: each rank trains at its own LoRA scale, one per layer)


@pytest.mark.needs_data
@pytest.mark.parametrize("model, method", [("tiny-vit", "lora"), ("tiny-vit", "houlsby"), ("tiny-vit", "ia3"),
                                           ("tiny-vit", "pfeiffer"), ("swin", "lora"), ("convnext", "lora")])
def test_image_clients_trained_together_get_the_updates_they_get_alone(model, method, tmp_path):
    """A vision model's clients in one pass: their images stacked, each row through its own client's tensors
    (ConvNeXt's feature maps keep each image's rows apart). Swin folds its windows into the batch, so its first
    fused pass finds a layer input that is not one row per image and the clients train one at a time."""
    from conftest import DATA_DIR
    from test_images import vision_model_dir

    kind, model = model, model if model == "tiny-vit" else str(vision_model_dir(tmp_path / model, model))
    rows = assert_same_as_alone([f"model.name={model}", "task.type=image_classification",
                                 f"task.dataset={DATA_DIR / 'mnist'}", "task.train_split=test[:80%]",
                                 "task.eval_split=test[80%:]", "task.split_shuffle_seed=0",
                                 "task.max_train_examples=96", "eval.max_examples=32", f"peft.method={method}",
                                 "federation.rounds=2"], tmp_path)
    if kind == "swin":
        assert all("fused_sub_batches" not in r for r in rows[1:])
        return
    assert all(r["fused_sub_batches"] > 0 and r["fused_padded_share"] == 0 for r in rows[1:])  # images: no padding


@pytest.mark.needs_data
def test_hetlora_clients_prune_alike_trained_together(tmp_path):
    """Every client prunes every round (tests/test_lora_methods.py); the regulariser and the prune decision in
    fused passes give the run they give alone."""
    from test_lora_methods import PRUNING_EVERY_ROUND

    rows = assert_same_as_alone(PRUNING_EVERY_ROUND, tmp_path)
    assert [set(r.get("pruned_rank", {}).values()) for r in rows[1:]] == [{2}, {1}, set()]


@pytest.mark.parametrize("method", sorted(m for m in PEFT_METHODS.names() if PEFT_METHODS.get(m).trains_batched))
@pytest.mark.needs_data
def test_each_client_gets_the_update_it_gets_alone(method, tmp_path):
    """The updates themselves (plain SGD, so nothing but float rounding separates them): each client's change
    of every tensor, as one vector, within 1e-4 of its change trained alone."""
    updates = {}
    for per_pass in (1, 4):
        cfg = deterministic(f"peft.method={method}", "train.optimizer=sgd", "train.lr=0.05", "federation.rounds=1",
                            per_pass=per_pass)
        runtime = EmbeddedRuntime(cfg, tmp_path / str(per_pass))
        payloads = runtime.server.configure(1, [0, 1, 2, 3])
        updates[per_pass] = runtime.transport.run_clients(1, payloads)
        runtime.close()
    for cid, (update, _, _, failure) in updates[1].items():
        fused = updates[4][cid][0]
        assert failure is None and fused is not None
        change = np.concatenate([(update.arrays[k] - payloads[cid].arrays[k]).ravel() for k in update.arrays])
        gap = np.concatenate([(update.arrays[k] - fused.arrays[k]).ravel() for k in update.arrays])
        assert np.linalg.norm(change) > 0
        assert np.linalg.norm(gap) <= 1e-4 * np.linalg.norm(change), (cid, np.linalg.norm(gap) / np.linalg.norm(change))
        assert update.meta["train_steps"] == fused.meta["train_steps"]
        assert update.meta["train_tokens"] == fused.meta["train_tokens"]  # each client's own padding, as alone


@pytest.mark.needs_data
def test_clients_with_different_numbers_of_steps_and_accumulation(tmp_path):
    """Clients of very different sizes (the ones with fewer batches stop while the others go on), gradient
    accumulation over unequal micro-batches, a linear schedule with warm-up, clipping; three clients per pass out
    of four (two passes a round)."""
    rows = assert_same_as_alone(["federation.partition.scheme=dirichlet_quantity", "federation.partition.alpha=0.5",
                                 "train.gradient_accumulation_steps=2", "train.batch_size=4",
                                 "train.scheduler=linear", "train.warmup_ratio=0.3", "train.max_grad_norm=0.5",
                                 "task.max_train_examples=96"], tmp_path, per_pass=3)
    sizes = rows[1]["client_num_examples"].values()
    assert max(sizes) > 2 * min(sizes)


@pytest.mark.needs_data
def test_local_steps_and_a_decoder(tmp_path):
    assert_same_as_alone(["model.name=tiny-gpt2", "peft.method=lora", "train.local_steps=3",
                          "task.type=generation", "task.dataset=e2e_nlg", "task.train_split=validation_pairs",
                          "task.eval_split=test", "eval.max_examples=8", "task.generation_max_new_tokens=8"], tmp_path)


NAN_PLUGIN = '''
from typing import Literal

import torch

import fedpeft
from fedpeft.algorithms.fedavg.halves import FedAvgClient, FedAvgServer
from fedpeft.algorithms.fedavg.options import FedAvgOptions


class NanOptions(FedAvgOptions):
    name: Literal["nan_at_client_1"] = "nan_at_client_1"


class NanClient(FedAvgClient):
    """Client 1's loss turns NaN at its second step."""

    def extra_loss(self, payload, ctx):
        if ctx.client_id != 1:
            return None
        calls = []

        def term():
            calls.append(1)
            return torch.tensor(float("nan") if len(calls) >= 2 else 0.0)
        return term


fedpeft.register_algorithm("nan_at_client_1", options=NanOptions, server=FedAvgServer,
                           client=lambda options: NanClient())
'''


@pytest.mark.needs_data
def test_one_clients_nan_loss_rejects_that_clients_update_only(tmp_path):
    plugin = tmp_path / "nan.py"
    plugin.write_text(NAN_PLUGIN)
    try:
        rows = assert_same_as_alone(["algorithm.name=nan_at_client_1", "train.batch_size=4"], tmp_path,
                                    plugins=[str(plugin)])
    finally:
        ALGORITHMS.remove("nan_at_client_1")
    for row in rows[1:]:
        assert list(row["rejected"]) == ["1"] and "non-finite training loss (nan) at local step 2" in row["rejected"]["1"]
        assert sorted(row["client_train_loss"]) == ["0", "2", "3"]


class FailingOptions(FedAvgOptions):
    name: Literal["fails_at_client_2"] = "fails_at_client_2"


class FailingClient(FedAvgClient):
    def fit(self, payload, ctx):
        if ctx.client_id == 2:
            ctx.train()
            raise RuntimeError("client 2's own code failed")
        return super().fit(payload, ctx)


class SequentialClient(FedAvgClient):
    trains_batched = False


class SequentialOptions(FedAvgOptions):
    name: Literal["sequential_fedavg"] = "sequential_fedavg"


@pytest.mark.needs_data
def test_an_error_in_a_clients_code_ends_the_run_as_alone(tmp_path):
    fedpeft.register_algorithm("fails_at_client_2", options=FailingOptions, server=FedAvgServer,
                               client=lambda options: FailingClient())
    try:
        for per_pass in (1, 4):
            with pytest.raises(RuntimeError, match="client 2's own code failed"):
                EmbeddedRuntime(deterministic("algorithm.name=fails_at_client_2", per_pass=per_pass),
                                tmp_path / str(per_pass)).run()
    finally:
        ALGORITHMS.remove("fails_at_client_2")
    assert not [t for t in __import__("threading").enumerate() if t.name.startswith("fedpeft-client-")]


@pytest.mark.needs_data
def test_a_client_half_that_declares_it_cannot_take_part_trains_alone(tmp_path, caplog):
    fedpeft.register_algorithm("sequential_fedavg", options=SequentialOptions, server=FedAvgServer,
                               client=lambda options: SequentialClient())
    try:
        with caplog.at_level(logging.WARNING, logger="fedpeft"):
            rows = assert_same_as_alone(["algorithm.name=sequential_fedavg"], tmp_path)
    finally:
        ALGORITHMS.remove("sequential_fedavg")
    assert "declares trains_batched = False; the clients train one at a time" in caplog.text
    assert "fused_sub_batches" not in rows[1]


@pytest.mark.needs_data
def test_a_micro_batch_may_pad_what_the_passs_earlier_ones_saved(tmp_path, monkeypatch):
    """The padding budget of each micro-batch's cut is its clients' own padding plus what the pass's earlier
    micro-batches padded less than alone; over the run the fused passes never pad more than alone."""
    from fedpeft.training import fused

    seen = []  # (the micro-batch's own budget, the slack before it, the budget its cut got, padded tokens)
    real_micro, real_pack = fused.FusedTrainer._micro_step, fused.pack_rows

    def micro(self, s, j, members, rows, weights, denominators, budget, step_loss):
        seen.append([budget, self.slack, None])
        padded = real_micro(self, s, j, members, rows, weights, denominators, budget, step_loss)
        seen[-1].append(padded)
        return padded

    def pack(lengths, budget, *args):
        seen[-1][2] = budget
        return real_pack(lengths, budget, *args)

    monkeypatch.setattr(fused.FusedTrainer, "_micro_step", micro)
    monkeypatch.setattr(fused, "pack_rows", pack)
    cfg = tiny_config("federation.clients_per_round=4", "runtime.clients_per_pass=4", "federation.rounds=1",
                      "train.local_epochs=1", "train.batch_size=8")
    EmbeddedRuntime(cfg, tmp_path).run()
    rows = read_metrics(tmp_path)
    assert len(seen) >= 2
    slack = 0
    for own, before, cut_budget, padded in seen:  # (one pass: the slack runs through its micro-batches)
        assert before == slack and cut_budget == own + slack
        slack += own - padded
    assert seen[-1][1] > 0  # the last micro-batch had padding saved earlier to spend
    assert rows[-1]["fused_padded_share"] <= rows[-1]["alone_padded_share"]


@pytest.mark.needs_data
def test_with_dropout_a_fused_run_is_reproducible(tmp_path):
    cfg = tiny_config("federation.clients_per_round=4", "runtime.clients_per_pass=4", "peft.dropout=0.1")
    first, second = metrics(cfg, tmp_path / "a"), metrics(cfg, tmp_path / "b")
    assert first == second


@pytest.mark.parametrize("max_tokens", [None, 90])
def test_rows_are_packed_into_the_fewest_sub_batches_within_the_padding_of_the_clients_alone(max_tokens):
    rng = np.random.default_rng(0)
    for _ in range(200):
        batches = [rng.integers(1, 60, size=rng.integers(1, 5)) for _ in range(rng.integers(1, 5))]
        lengths = np.concatenate(batches)
        budget = sum(len(b) * int(b.max()) for b in batches)  # each client's batch padded to its own longest row
        groups = pack_rows(lengths, budget, max_tokens)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
        assert sum(padded(lengths, g) for g in groups) <= budget
        if max_tokens is None:
            assert len(groups) <= len(batches)
        else:
            assert all(padded(lengths, g) <= max_tokens or len(g) == 1 for g in groups)
        ordered = np.sort(lengths)[::-1]
        if len(groups) > 1:  # one sub-batch fewer would pad more than the budget (or break the cap)
            assert cheapest(ordered, max_tokens, groups=len(groups) - 1) > budget
        # among cuts into as many sub-batches, none pads less
        assert sum(padded(lengths, g) for g in groups) == cheapest(ordered, max_tokens, groups=len(groups))


@pytest.mark.parametrize("max_tokens", [None, 90])
def test_with_a_cost_per_sub_batch_rows_are_packed_at_the_least_cost_within_the_budget(max_tokens):
    rng = np.random.default_rng(1)
    loose = 0
    for _ in range(100):
        batches = [rng.integers(1, 60, size=rng.integers(1, 5)) for _ in range(rng.integers(1, 4))]
        lengths = np.concatenate(batches)
        budget = sum(len(b) * int(b.max()) for b in batches) + int(rng.integers(0, 40))
        cost = int(rng.integers(1, 80))
        groups = pack_rows(lengths, budget, max_tokens, sub_batch_cost=cost)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
        total = sum(padded(lengths, g) for g in groups)
        assert total <= budget
        assert max_tokens is None or all(padded(lengths, g) <= max_tokens or len(g) == 1 for g in groups)
        ordered = np.sort(lengths)[::-1]
        # the least padding plus cost a sub-batch among the cuts within the budget, by brute force
        assert total + cost * len(groups) == cheapest(ordered, max_tokens, per_group=cost, budget=budget)
        loose += cheapest(ordered, max_tokens, per_group=cost) == total + cost * len(groups)
    assert 50 < loose < 100  # most draws take the least-cost cut as it is; in some the budget binds


def test_more_rows_than_one_packing_programme_takes_are_packed_in_blocks(monkeypatch):
    from fedpeft.training import fused

    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 60, size=50)
    whole = fused.pack_rows(lengths, 0, 200, sub_batch_cost=30)  # (a budget below the real tokens: no padding)
    real_pack, sizes = fused.pack_rows, []

    def counted(rows, *args, **kwargs):
        sizes.append(len(rows))
        return real_pack(rows, *args, **kwargs)

    monkeypatch.setattr(fused, "PACK_BLOCK", 8)
    monkeypatch.setattr(fused, "pack_rows", counted)
    for budget, cost in ((0, None), (int(lengths.sum() * 1.3), 30), (int(lengths.sum() * 1.3), None)):
        sizes.clear()
        groups = fused.pack_rows(lengths, budget, 200, sub_batch_cost=cost)
        assert sizes[0] == 50 and sorted(sizes[1:]) == [2, 8, 8, 8, 8, 8, 8]  # one programme per block
        assert sorted(np.concatenate(groups).tolist()) == list(range(50))
        assert sum(padded(lengths, g) for g in groups) <= max(budget, int(lengths.sum()))
        assert all(padded(lengths, g) <= 200 or len(g) == 1 for g in groups)
    assert sum(padded(lengths, g) for g in whole) == lengths.sum()


def padded(lengths: np.ndarray, group: np.ndarray) -> int:
    return len(group) * int(lengths[group].max())


def cheapest(ordered: np.ndarray, max_tokens: int | None, groups: int | None = None, per_group: int = 0,
             budget: float = float("inf")) -> float:
    """Brute force over every cut of the rows (longest first) into contiguous groups: the least padded tokens
    plus ``per_group`` a group, with exactly ``groups`` groups if given, each within ``max_tokens`` unless a
    single row, padding at most ``budget`` in all (inf if none)."""
    from itertools import combinations

    n = len(ordered)
    best = float("inf")
    for cuts in range(n) if groups is None else [groups - 1]:
        for points in combinations(range(1, n), cuts):
            edges = [0, *points, n]
            sizes = [((b - a) * int(ordered[a]), b - a) for a, b in itertools.pairwise(edges)]
            if max_tokens is not None and any(p > max_tokens and k > 1 for p, k in sizes):
                continue
            if sum(p for p, _ in sizes) > budget:
                continue
            best = min(best, sum(p for p, _ in sizes) + per_group * len(sizes))
    return best


def test_a_trainable_tensor_in_a_module_without_a_row_forward_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.GRU(3, 3))
    for p in model.parameters():
        p.requires_grad_(False)
    model[1].weight_ih_l0.requires_grad_(True)
    with pytest.raises(RowBatchUnsupported, match=r"1\.weight_ih_l0 sits in a GRU, which has no row forward"):
        row_batched_modules(model, ["1.weight_ih_l0"], built_in_row_forwards())


def test_a_loss_that_cannot_be_split_per_client_is_refused():
    record = ClientLosses(segments=[(0, 0, 1), (1, 1, 2)])
    logits, labels = torch.randn(2, 3), torch.tensor([0, 2])
    with client_losses(record, 2), pytest.raises(RowBatchUnsupported, match="only a plain mean is split"):
        torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    with client_losses(record, 2):
        torch.nn.functional.cross_entropy(logits, labels)
    alone = [torch.nn.functional.cross_entropy(logits[i:i + 1], labels[i:i + 1]) for i in range(2)]
    assert [float(record.sums[k] / record.counts[k]) for k in (0, 1)] == pytest.approx([float(x) for x in alone])
    assert torch.nn.functional.cross_entropy.__name__ == "cross_entropy"  # put back


@pytest.mark.parametrize("example", ["custom_algorithm", "custom_peft_method", "scaffold"])
@pytest.mark.needs_data
def test_the_examples_plugins_train_together(example, tmp_path):
    """The median rule, LayerNorm tuning and SCAFFOLD (its correction applied to each client's own tensors)."""
    from pathlib import Path

    from fedpeft.config import load_config

    folder = Path(__file__).resolve().parent.parent / "examples" / example
    rows = {}
    for per_pass in (1, 2):
        cfg = load_config(folder / "config.yaml", ["model.dropout=0", "runtime.progress=false",
                                                   f"runtime.clients_per_pass={per_pass}"],
                          plugins=[str(folder / "plugin.py")])
        if "dropout" in type(cfg.peft).model_fields:
            cfg = cfg.model_copy(update={"peft": cfg.peft.model_copy(update={"dropout": 0.0})})
        rows[per_pass] = metrics(cfg, tmp_path / str(per_pass))
    assert (difference := different(rows[1], rows[2])) is None, difference
    assert all(r["fused_sub_batches"] > 0 for r in read_metrics(tmp_path / "2")[1:])


@pytest.mark.needs_data
def test_the_guides_sample_runs(tmp_path, capsys):
    from docs_samples import docs_sample

    exec(compile(docs_sample("clients-per-pass"), "docs clients-per-pass sample", "exec"),  # noqa: S102
         {"run_dir": tmp_path / "run"})
    per_pass, fused, alone = capsys.readouterr().out.split()
    assert per_pass == "4" and 0 <= float(fused) <= float(alone)


@pytest.mark.needs_data
def test_out_of_memory_halves_the_clients_per_pass_and_redoes_the_step(tmp_path, caplog):
    """A device that holds one client's micro-batch (8 rows) and no more: the pass of 4 clients runs out of memory,
    then the pass of 2; each time the step is done again with half as many clients, and every client ends with
    the update it gets alone."""
    alone = metrics(deterministic("train.batch_size=8", per_pass=1), tmp_path / "alone")
    runtime = EmbeddedRuntime(deterministic("train.batch_size=8", per_pass=4), tmp_path / "together")

    def small_device(module, args, kwargs):
        if module.training and kwargs["input_ids"].shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's device)")

    runtime.exp.tuned.module.register_forward_pre_hook(small_device, with_kwargs=True)
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        runtime.run()
    rows = read_metrics(tmp_path / "together")
    together = json.loads(json.dumps([{k: v for k, v in r.items() if not is_timing(k) and "flops" not in k
                                       and "sim_" not in k and k not in FUSED_KEYS} for r in without_timings(rows)]))
    assert (difference := different(alone, together)) is None, difference
    assert "out of memory with 4 clients in one pass" in caplog.text and "2 from now on" in caplog.text
    assert "out of memory with 2 clients in one pass" in caplog.text and "1 from now on" in caplog.text
    assert rows[-1]["clients_per_pass"] == 1


@pytest.mark.needs_data
def test_auto_measures_the_clients_per_pass_on_the_first_round(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedpeft"):
        rows = assert_same_as_alone([], tmp_path, per_pass="auto")
    chosen = [line for line in caplog.text.splitlines() if "runtime.clients_per_pass auto measured" in line]
    assert len(chosen) == 1 and "(probe of one local step: 1: " in chosen[0]
    assert {r["clients_per_pass"] for r in rows[1:]} == {int(chosen[0].split("measured ")[1].split()[0])}


@pytest.mark.needs_data
def test_auto_takes_the_fastest_number_and_stops_once_a_number_is_clearly_slower(tmp_path, caplog, monkeypatch):
    from fedpeft.training.fused import FusedTrainer

    rates = {1: 10.0, 2: 10.2, 4: 15.0, 8: 11.0}  # examples a second; 8 is under 80% of 4's
    tried = []

    def timed(self, requests, repeats=2):
        tried.append(len(requests))
        return len(requests) / rates[len(requests)], len(requests), 0

    monkeypatch.setattr(FusedTrainer, "probe", timed)
    cfg = tiny_config("federation.num_clients=16", "federation.clients_per_round=16", "federation.rounds=1",
                      "runtime.clients_per_pass=auto")
    with caplog.at_level(logging.INFO, logger="fedpeft"):
        EmbeddedRuntime(cfg, tmp_path).run()
    assert tried == [1, 2, 4, 8]  # a 2% gain at 2 does not stop it; 8, clearly slower, does (16 is never tried)
    assert "runtime.clients_per_pass auto measured 4 " in caplog.text
    assert read_metrics(tmp_path)[-1]["clients_per_pass"] == 4


@pytest.mark.needs_data
def test_a_4bit_quantized_backbone_trains_clients_together(tmp_path):
    rows = assert_same_as_alone(["model.quantization={bits: 4}"], tmp_path)
    assert all(r["fused_sub_batches"] > 0 for r in rows[1:])


def test_the_gpu_check_script_is_ready():
    """benchmarks/gpu_check.sh: valid bash, refuses to run without a CUDA device, and the benchmark takes the
    arguments it passes (its CUDA runs need a GPU; a machine with one runs the whole script)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    script = repo / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    if not torch.cuda.is_available():
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False,
                              env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
        assert done.returncode == 2 and "torch sees no CUDA device here" in done.stderr
    sys.path.insert(0, str(repo / "benchmarks"))
    import clients_per_pass

    cfg = clients_per_pass.config("cross-device", "auto", "cuda")
    assert cfg.runtime.device == "cuda" and cfg.runtime.clients_per_pass == "auto"
    assert cfg.federation.clients_per_round == 50 and cfg.federation.num_clients == 1000


def test_the_benchmark_gives_each_settings_share_of_the_best_limit(capsys):
    """benchmarks/clients_per_pass.py's table: a setting's examples a second against the fastest batch size of
    the bare loop timed in the same run, not the one at its own batch size (which read 431% for 32 per pass)."""
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import clients_per_pass
    finally:
        sys.path.remove(benchmarks)

    row = {"round_s": 1.0, "examples_per_s": 30.0, "peak_rss_mib": 1.0, "clients_per_pass": 32}
    clients_per_pass.print_tables({"cross-device": {
        "32": row, "limit": {"32": {"examples_per_s": 40.0}, "256": {"examples_per_s": 7.0}}}})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert "of the best limit (32 rows)" in lines[0]
    assert lines[2].split(" | ")[4] == "75%"
    assert [line.split(" | ")[4] for line in lines[3:5]] == ["100%", "18%"]


@pytest.mark.parametrize("overrides", [
    ["algorithm.robust={rule: median}", "federation.attackers={fraction: 0.25, attack: label_flip}",
     "federation.min_replies=3"],
    ["algorithm.robust={rule: krum, num_attackers: 1}", "federation.attackers={fraction: 0.25, attack: sign_flip}",
     "federation.num_clients=6", "federation.clients_per_round=5", "federation.min_replies=5"],
], ids=["median-label-flip", "krum-sign-flip"])
@pytest.mark.needs_data
def test_robust_rules_and_attackers_trained_together(overrides, tmp_path):
    """(Differential privacy's client half clips after ctx.train, like any client code; its server samples the
    clients from a secret generator, so no two runs of it select the same clients to compare.)"""
    assert_same_as_alone(overrides, tmp_path)


@pytest.mark.needs_data
def test_gradient_checkpointing_recomputes_each_row_with_its_clients_tensors(tmp_path):
    rows = assert_same_as_alone(["train.gradient_checkpointing=true"], tmp_path)
    assert all(r["fused_sub_batches"] > 0 for r in rows[1:])


def test_a_subclass_that_computes_otherwise_has_no_row_forward():
    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = torch.nn.Sequential(ScaledEmbedding(10, 4))
    with pytest.raises(RowBatchUnsupported, match=r"0\.weight sits in a ScaledEmbedding"):
        row_batched_modules(model, ["0.weight"], built_in_row_forwards())
