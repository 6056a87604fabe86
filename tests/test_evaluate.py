"""Log-likelihood scoring (multiple choice, teacher-forced generation loss) against a direct reference:
full logits of every position, log-softmax over the whole vocabulary, summed over the label tokens."""

import numpy as np
import pytest
import torch
from helpers import tiny_config

from fedpeft.data.batching import collate, sequential_batches
from fedpeft.runtime.setup import build_experiment
from fedpeft.training.evaluate import _lm_loss

pytestmark = pytest.mark.needs_data  # every test here reads the real datasets


def reference_logprobs(model, data, pad_id: int, encoder_decoder: bool) -> np.ndarray:
    out = np.zeros(len(data))
    with torch.no_grad():
        for idx in sequential_batches(data.lengths(), 8):
            batch = collate(data, idx, pad_id)
            batch.pop("token_type_ids", None)
            labels = batch["labels"]
            if encoder_decoder:
                logits = model(**batch).logits
            else:
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                logits = logits[:, -labels.shape[1]:, :][:, :-1, :]  # drop virtual-token positions
                labels = labels[:, 1:]
            logp = torch.log_softmax(logits.double(), dim=-1)
            mask = labels != -100
            picked = torch.gather(logp, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out[idx] = (picked * mask).sum(1).numpy()
    return out


@pytest.mark.parametrize("model,method", [
    ("tiny-llama", "lora"), ("tiny-llama", "prompt_tuning"), ("tiny-llama", "prefix_tuning"),
    ("tiny-gpt2", "houlsby"), ("tiny-gpt2", "p_tuning"), ("tiny-t5", "lora"), ("tiny-bart", "pfeiffer"),
])
def test_choice_scores_match_the_full_vocabulary_reference(model, method):
    cfg = tiny_config(f"model.name={model}", f"peft={{method: {method}}}", "task.type=multiple_choice",
                      "task.dataset=arc_easy", "task.train_split=test[:80%]", "task.eval_split=test[80%:]",
                      "eval.max_examples=12", "task.max_length=96")
    exp = build_experiment(cfg)
    model_ = exp.tuned.module.eval()
    seqs = exp.data.eval.sequences
    sums, counts = _lm_loss(model_, seqs, pad_id=exp.tokenizer.pad_token_id, device=torch.device("cpu"),
                            batch_size=5, encoder_decoder=exp.encoder_decoder, precision="fp32")
    expected = reference_logprobs(model_, seqs, exp.tokenizer.pad_token_id, exp.encoder_decoder)
    assert (counts > 0).all()
    np.testing.assert_allclose(sums, expected, rtol=1e-4, atol=1e-3)
