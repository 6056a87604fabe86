import numpy as np
import pytest

from fedpeft.metrics import ops, scores
from fedpeft.metrics.accounting import (
    better_or_equal,
    first_reaching,
    summarize,
    total_transmission,
)


def test_appendix_a_rows_by_hand():
    from fedpeft.tuners import analytic_ops as rows
    from fedpeft.tuners.ia3.ops import ia3_row
    from fedpeft.tuners.lora.ops import lora_row

    assert rows.qkv_row(2, 3, 4) == (2 * 4 * 27, 2 * (4 * 27 + 4 * 9))
    assert rows.attention_row(2, 3, 4) == (2 * (16 * 9 + 64 * 3), 2 * (16 * 9 + 3 * 64 * 3))
    assert lora_row(2, 3, 4, 1) == (2 * (4 * 9 * 1 + 4 * 1 * 3), 2 * (4 * 9 * 1 + 2 * 4 * 1 * 3 + 4 * 1 * 3 + 4 * 27))
    assert ia3_row(2, 3, 4) == (2 * 4 * 3, 2 * 2 * 4 * 3)
    fwd = 1 * 27 + 25 * 9 + 125 * 3
    bwd = 1 * 27 + 25 * 9 + 3 * 125 * 3
    assert rows.prompt_row(3, 4, 1) == (fwd, bwd)


def test_method_sums():
    from fedpeft.tuners import analytic_ops as rows
    from fedpeft.tuners.lora.ops import lora_row

    L, d, T = 2, 3, 4
    qkv, attention, fc = (sum(row(L, d, T)) for row in (rows.qkv_row, rows.attention_row, rows.fc_row))
    backbone = qkv + attention + fc
    assert ops.sequence_ops("full", L, d, T) == backbone
    assert ops.sequence_ops("lora", L, d, T, {"r": 2}) == backbone + sum(lora_row(L, d, T, 2))
    prompt = sum(rows.prompt_row(d, T, 5))
    assert ops.sequence_ops("prompt_tuning", L, d, T, {"num_virtual_tokens": 5}) == qkv + fc + prompt
    assert ops.sequence_ops("p_tuning", L, d, T, {"num_virtual_tokens": 5}) == qkv + fc + prompt
    # prompts at every layer: Table 6's P-tuning row, L times the prompt row
    assert ops.sequence_ops("prefix_tuning", L, d, T, {"num_virtual_tokens": 5}) == qkv + fc + L * prompt
    for method in ("bitfit", "houlsby", "pfeiffer"):  # no row of their own: the backbone
        assert ops.sequence_ops(method, L, d, T) == backbone


def test_pruned_ops_scale_head_rows_only():
    from fedpeft.tuners import analytic_ops as rows
    from fedpeft.tuners.lora.ops import lora_row

    L, d, T = 2, 3, 4
    head = sum(rows.qkv_row(L, d, T)) + sum(rows.attention_row(L, d, T)) + sum(lora_row(L, d, T, 2))
    assert ops.sequence_ops("lora", L, d, T, {"r": 2}, head_fraction=0.25) == pytest.approx(
        0.25 * head + sum(rows.fc_row(L, d, T)))
    assert ops.sequence_ops("lora", L, d, T, {"r": 2}, head_fraction=1.0) == ops.sequence_ops("lora", L, d, T, {"r": 2})
    # the documented reading: T5-small (L=18, d=512), LoRA r=16, T=512, 90% sparsity -> 3.81x (paper: 3.9x)
    ratio = ops.sequence_ops("lora", 18, 512, 512, {"r": 16}) / ops.sequence_ops("lora", 18, 512, 512, {"r": 16}, 0.1)
    assert ratio == pytest.approx(3.805, abs=1e-3)
    with pytest.raises(ValueError, match="head_fraction"):
        ops.sequence_ops("lora", L, d, T, {"r": 2}, head_fraction=1.5)


def test_classification_scores_by_hand():
    gold = [0, 0, 1, 1, 2]
    pred = [0, 1, 1, 1, 0]
    s = scores.classification_scores(pred, gold)
    assert s["accuracy"] == pytest.approx(3 / 5)
    # per-class F1: c0: p=1/2 r=1/2 -> .5; c1: p=2/3 r=1 -> .8; c2: 0 -> macro (0.5+0.8+0)/3
    assert s["macro_f1"] == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    # binary MCC by hand: tp=2 tn=2 fp=1 fn=0 -> (4-0)/sqrt(3*2*3*2)
    assert scores.mcc([1, 1, 1, 0, 0], [1, 1, 0, 0, 0]) == pytest.approx(4 / np.sqrt(36))


def test_binary_f1_and_glue_acc_and_f1_by_hand():
    # pred [1,1,1,0,0] vs gold [1,1,0,0,0]: tp 2, fp 1, fn 0 -> F1 = 4/5; accuracy 4/5
    out = scores.classification_scores([1, 1, 1, 0, 0], [1, 1, 0, 0, 0], num_labels=2)
    assert out["f1"] == pytest.approx(0.8) and out["acc_and_f1"] == pytest.approx(0.8)
    out = scores.classification_scores([1, 0, 0, 0, 0], [1, 1, 0, 0, 0], num_labels=2)  # F1 = 2/3, acc 4/5
    assert out["acc_and_f1"] == pytest.approx((2 / 3 + 0.8) / 2)
    assert "f1" not in scores.classification_scores([2, 0], [2, 1], num_labels=3)


def test_rouge_identical_and_disjoint():
    r = scores.rouge(["the cat sat", "a b c"], [["the cat sat"], ["x y z", "a b c"]])
    assert r["rouge1"] == pytest.approx(1.0) and r["rougeL"] == pytest.approx(1.0)
    r = scores.rouge(["dog"], [["the cat sat"]])
    assert r["rouge1"] == 0.0 and r["rouge2"] == 0.0


def test_choice_scores_raw_and_length_normalised():
    # example 0 has 2 choices, example 1 has 3
    logprob = np.array([-4.0, -5.0, -1.0, -3.0, -2.0])
    example = np.array([0, 0, 1, 1, 1])
    chars = np.array([2, 10, 1, 10, 10])
    gold = np.array([1, 2])
    s = scores.choice_scores(logprob, example, chars, gold)
    # raw: ex0 picks 0 (wrong), ex1 picks 0 (wrong); normalised: ex0 -2 vs -.5 -> 1 (right); ex1 -1,-.3,-.2 -> 2 (right)
    assert s["accuracy"] == 0.0 and s["accuracy_norm"] == 1.0


def test_targets_and_transmission():
    rows = [{"round": 0, "eval_accuracy": 0.5, "wall_s": 1.0}, {"round": 1, "eval_accuracy": 0.8, "wall_s": 5.0}]
    assert first_reaching(rows, "eval_accuracy", 0.7)["round"] == 1
    assert first_reaching(rows, "eval_accuracy", 0.9) is None
    assert better_or_equal("loss", 0.2, 0.3) and not better_or_equal("accuracy", 0.2, 0.3)
    assert total_transmission(rounds=30, clients=10, payload_bytes=440e6) == pytest.approx(264e9)
    s = summarize(rows, metric="accuracy", target=0.7)
    assert s["initial"] == 0.5 and s["final"] == 0.8 and s["rounds_to_target"] == 1 and s["time_to_target_s"] == 5.0


@pytest.mark.parametrize("method,options,L,d,sparsity,printed", [
    ("lora", {"r": 16}, 18, 512, 0.0, 33.07), ("lora", {"r": 16}, 18, 512, 0.9, 8.47),  # Tables 1-4, T5-small
    ("full", {}, 18, 512, 0.9, 10.63), ("lora", {"r": 4}, 18, 512, 0.0, 32.05), ("ia3", {}, 18, 512, 0.5, 21.76),
    ("prompt_tuning", {"num_virtual_tokens": 20}, 18, 512, 0.0, 22.81),  # Table 3
    ("prefix_tuning", {"num_virtual_tokens": 20}, 18, 512, 0.9, 6.73),  # Table 3's P-Tuning
    ("lora", {"r": 16}, 36, 768, 0.9, 34.83), ("lora", {"r": 16}, 12, 768, 0.0, 42.73),  # Table 4: T5-base, GPT-2
])
def test_paper000_macs_reproduces_the_printed_ops(method, options, L, d, sparsity, printed):
    from fedpeft.metrics.ops import paper000_macs

    heads = {512: 8, 768: 12}[d]
    assert paper000_macs(method, L, d, 512, options, 1.0 - sparsity, heads=heads) / 1e9 == pytest.approx(printed, rel=1e-3)


def test_paper000_macs_rank_sensitivity_is_the_papers():
    """r16 -> r8 moves the paper's T5-small figure by 0.69 G (33.07 -> 32.38); the transcription by ~40 G."""
    from fedpeft.metrics.ops import paper000_macs

    delta = (paper000_macs("lora", 18, 512, 512, {"r": 16}) - paper000_macs("lora", 18, 512, 512, {"r": 8})) / 1e9
    assert delta == pytest.approx(0.69, abs=0.02)
