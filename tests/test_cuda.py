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
