"""The embedded runtime on CUDA end to end (device placement, bf16 autocast, a 4-bit quantized backbone), one
client at a time and several per pass. Skipped without a CUDA device; benchmarks/gpu_check.sh runs them."""

from __future__ import annotations

import pytest
from helpers import tiny_config
from test_clients_per_pass import assert_same_as_alone

from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime

pytestmark = [pytest.mark.cuda, pytest.mark.needs_data]


def test_clients_trained_together_on_cuda_match_one_at_a_time(tmp_path):
    rows = assert_same_as_alone(["runtime.device=cuda"], tmp_path)
    assert all(r["peak_accelerator_mb"] > 0 and r["fused_sub_batches"] > 0 for r in rows[1:])


@pytest.mark.parametrize("method", ["lora", "ia3", "houlsby", "prompt_tuning", "prefix_tuning", "bitfit"])
def test_each_batched_peft_method_trains_on_cuda_in_bf16(method, tmp_path):
    cfg = tiny_config("runtime.device=cuda", "runtime.precision=bf16", f"peft.method={method}",
                      "federation.clients_per_round=4", "runtime.clients_per_pass=4")
    summary = EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")
    assert summary["rounds"] == 2 and all(r["fused_sub_batches"] > 0 and not r["rejected"] for r in rows[1:])


def test_a_4bit_backbone_on_cuda_trains_clients_together(tmp_path):
    cfg = tiny_config("model.name=tiny-llama", "runtime.device=cuda", "model.quantization={bits: 4}",
                      "federation.clients_per_round=4", "runtime.clients_per_pass=auto")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")
    assert all(r["clients_per_pass"] >= 1 and not r["rejected"] for r in rows[1:])


def test_spawned_workers_on_cuda_give_the_metrics_of_one_process(tmp_path):
    """runtime.workers on CUDA: spawned workers (two, so that one device has two where the machine has one GPU),
    each with its own copy of the model, against the run's process alone; and auto, one per device."""
    import torch
    from helpers import metrics_difference
    from test_workers import learning

    base = ("runtime.device=cuda", "federation.num_clients=6", "federation.clients_per_round=4")
    EmbeddedRuntime(tiny_config(*base), tmp_path / "one").run()
    two = EmbeddedRuntime(tiny_config(*base, "runtime.workers=2"), tmp_path / "two")
    two.run()
    visible = sorted(name.rsplit("CUDA_VISIBLE_DEVICES=", 1)[1] for name in two.transport.devices.values())
    assert visible == sorted(f"{two.transport._device_of(i)})" for i in range(2)), two.transport.devices
    rows = read_metrics(tmp_path / "two")
    assert all(r["workers"] == 2 and not r["rejected"] and r["worker_accelerator_mb"] > 0 for r in rows[1:])
    difference = metrics_difference(learning(rows), learning(read_metrics(tmp_path / "one")))
    assert difference is None, difference
    auto = EmbeddedRuntime(tiny_config(*base, "runtime.workers=auto"), tmp_path / "auto")
    auto.run()
    assert auto.transport.workers == torch.cuda.device_count()
