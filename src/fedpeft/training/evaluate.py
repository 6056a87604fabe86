"""Evaluating the global model on the server's evaluation set, per task type."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any

import numpy as np
import torch

from fedpeft.data.batching import Encoded, collate, sequential_batches
from fedpeft.data.chat import InstructionEval
from fedpeft.data.features import ChoiceEval, GenerationEval
from fedpeft.metrics import scores

PREDICTIONS = "_predictions"  # the per-example predictions in evaluate()'s result (not a metric)


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _accepts_logits_to_keep(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_takes_logits_to_keep(type(base))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _token_logprobs(model, batch: dict[str, torch.Tensor], encoder_decoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (sum of log p(label tokens), number of label tokens).

    Only the label positions are scored: a causal model is asked for the logits of the last positions
    that hold a label (``logits_to_keep``, where the architecture has it) and the log-softmax is taken
    over the label positions only. Full-vocabulary log-probabilities of every position of a batch
    (batch x length x vocabulary floats, 6 GiB for 64 x 512 tokens of SmolLM2) are never materialised.
    """
    if encoder_decoder:  # decoder positions are the label positions; the model builds decoder inputs from labels
        labels = batch["labels"]
        logits = model(**batch).logits
    else:
        full = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}  # no HF loss over the whole vocabulary
        length = full.shape[1]
        has_label = (full != -100).any(dim=0)
        first = int(has_label.nonzero()[0]) if bool(has_label.any()) else length - 1
        keep = min(length, length - first + 1)  # logits of positions first-1 .. length-1
        if _accepts_logits_to_keep(model):
            inputs["logits_to_keep"] = keep
        logits = model(**inputs).logits[:, -keep:, :][:, :-1, :]
        labels = full[:, length - keep + 1 :]
    mask = labels != -100
    selected = logits[mask].float()
    target = labels[mask]
    token_logp = selected.gather(1, target.unsqueeze(1)).squeeze(1) - torch.logsumexp(selected, dim=-1)
    picked = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    picked[mask] = token_logp
    return picked.sum(dim=1), mask.sum(dim=1)


@torch.no_grad()
def _lm_loss(model, data: Encoded, *, pad_id, device, batch_size, encoder_decoder, precision) -> tuple[np.ndarray, np.ndarray]:
    sums, counts = np.zeros(len(data)), np.zeros(len(data))
    for idx in sequential_batches(data.lengths(), batch_size):
        batch = {k: v.to(device) for k, v in collate(data, idx, pad_id).items()}
        batch.pop("token_type_ids", None)
        with _autocast(device, precision):
            s, c = _token_logprobs(model, batch, encoder_decoder)
        sums[idx] = s.cpu().numpy()
        counts[idx] = c.cpu().numpy()
    return sums, counts


@torch.no_grad()
def evaluate_classification(model, data: Encoded, *, pad_id, device, batch_size, precision="fp32") -> dict[str, float]:
    preds = np.zeros(len(data), dtype=np.int64)
    loss_sum = 0.0
    num_labels = None
    for idx in sequential_batches(data.lengths(), batch_size):
        batch = {k: v.to(device) for k, v in collate(data, idx, pad_id).items()}
        with _autocast(device, precision):
            out = model(**batch)
        loss_sum += float(out.loss) * len(idx)
        preds[idx] = out.logits.argmax(-1).cpu().numpy()
        num_labels = int(out.logits.shape[-1])
    gold = np.asarray(data.labels)
    return {"eval_loss": loss_sum / len(data), **scores.classification_scores(preds, gold, num_labels),
            PREDICTIONS: preds.tolist()}


@torch.no_grad()
def evaluate_generation(
    model, data: GenerationEval, *, pad_id, eos_id, device, batch_size, encoder_decoder, max_new_tokens,
    tokenizer, precision="fp32",
) -> dict[str, float]:
    sums, counts = _lm_loss(model, data.teacher_forced, pad_id=pad_id, device=device, batch_size=batch_size,
                            encoder_decoder=encoder_decoder, precision=precision)
    predictions = _greedy(model, data.prompts, pad_id=pad_id, eos_id=eos_id, device=device, batch_size=batch_size,
                          encoder_decoder=encoder_decoder, max_new_tokens=max_new_tokens, tokenizer=tokenizer,
                          precision=precision)
    result = {"eval_loss": float(-sums.sum() / max(counts.sum(), 1))}
    result.update(_rouge_and_examples(predictions, data.references))
    return result


def _greedy(model, prompts: Encoded, *, pad_id, eos_id, device, batch_size, encoder_decoder, max_new_tokens, tokenizer,
            precision, stop_text: str | None = None) -> list[str]:
    """Greedy continuations of the prompts (new tokens only, special tokens dropped, stripped); with
    ``stop_text``, generation also stops once a continuation contains it and each is cut before it (as written,
    or as the tokenizer decodes it: an uncased WordPiece tokenizer gives "### End" back as "# # # end")."""
    markers: list[str] = []
    if stop_text:
        decoded = tokenizer.decode(tokenizer(stop_text, add_special_tokens=False)["input_ids"]).strip()
        markers = list(dict.fromkeys(m for m in (stop_text, decoded) if m))
    stop = {"stop_strings": markers, "tokenizer": tokenizer} if markers else {}
    predictions = [""] * len(prompts)
    side = "right" if encoder_decoder else "left"
    for idx in sequential_batches(prompts.lengths(), batch_size):
        batch = collate(prompts, idx, pad_id, padding_side=side)
        inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
        with _autocast(device, precision):
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=pad_id, eos_token_id=eos_id, **stop)
        new = out if encoder_decoder else out[:, inputs["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        for i, t in zip(idx, texts):
            for marker in markers:
                t = t.split(marker, 1)[0]
            predictions[i] = t.strip()
    return predictions


def _rouge_and_examples(predictions: list[str], references: list[list[str]]) -> dict[str, Any]:
    result: dict[str, Any] = dict(scores.rouge(predictions, references))
    result["_examples"] = [{"prediction": p, "reference": r[0]} for p, r in zip(predictions[:3], references[:3])]
    result[PREDICTIONS] = predictions
    return result


@torch.no_grad()
def evaluate_instruction(
    model, data: InstructionEval, *, pad_id, device, batch_size, max_new_tokens, tokenizer, precision="fp32",
) -> dict[str, Any]:
    """Instruction data: the eval loss (mean over every assistant token of the teacher-forced conversations),
    its perplexity (exp of that loss) and ROUGE of the greedy final responses (generation stops at the
    tokenizer's eos or the chat template's end-of-turn token) against the references."""
    sums, counts = _lm_loss(model, data.teacher_forced, pad_id=pad_id, device=device, batch_size=batch_size,
                            encoder_decoder=False, precision=precision)
    loss = float(-sums.sum() / max(counts.sum(), 1))
    predictions = _greedy(model, data.prompts, pad_id=pad_id, eos_id=list(data.stop_ids), device=device,
                          batch_size=batch_size, encoder_decoder=False, max_new_tokens=max_new_tokens,
                          tokenizer=tokenizer, precision=precision, stop_text=data.stop_text)
    result: dict[str, Any] = {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf}
    result.update(_rouge_and_examples(predictions, data.references))
    return result


@torch.no_grad()
def evaluate_choice(model, data: ChoiceEval, *, pad_id, device, batch_size, encoder_decoder, precision="fp32") -> dict[str, float]:
    sums, counts = _lm_loss(model, data.sequences, pad_id=pad_id, device=device, batch_size=batch_size,
                            encoder_decoder=encoder_decoder, precision=precision)
    gold_seq = data.gold[data.example_index] == _choice_positions(data.example_index)
    result = {"eval_loss": float(-sums[gold_seq].sum() / max(counts[gold_seq].sum(), 1))}
    result.update(scores.choice_scores(sums, data.example_index, data.choice_chars, data.gold))
    result[PREDICTIONS] = scores.choice_picks(sums, data.example_index, data.choice_chars, len(data.gold))[0].tolist()
    return result


def _choice_positions(example_index: np.ndarray) -> np.ndarray:
    pos = np.zeros(len(example_index), dtype=np.int64)
    seen: dict[int, int] = {}
    for i, ex in enumerate(example_index):
        pos[i] = seen.get(int(ex), 0)
        seen[int(ex)] = pos[i] + 1
    return pos


def evaluate(model, task_data, *, tokenizer, device, batch_size, encoder_decoder, max_new_tokens, precision) -> dict[str, Any]:
    """The eval split's metrics ("eval_loss", scores), plus under PREDICTIONS one prediction per example (class
    index, generated text, or chosen choice index) and, for generation and instruction, "_examples" (three of
    them)."""
    model.eval()
    pad_id = tokenizer.pad_token_id
    if task_data.task_type in ("classification", "image_classification"):
        return evaluate_classification(model, task_data.eval, pad_id=pad_id, device=device, batch_size=batch_size,
                                       precision=precision)
    if task_data.task_type == "generation":
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        return evaluate_generation(model, task_data.eval, pad_id=pad_id, eos_id=eos, device=device,
                                   batch_size=batch_size, encoder_decoder=encoder_decoder,
                                   max_new_tokens=max_new_tokens, tokenizer=tokenizer, precision=precision)
    if task_data.task_type == "instruction":
        return evaluate_instruction(model, task_data.eval, pad_id=pad_id, device=device, batch_size=batch_size,
                                    max_new_tokens=max_new_tokens, tokenizer=tokenizer, precision=precision)
    return evaluate_choice(model, task_data.eval, pad_id=pad_id, device=device, batch_size=batch_size,
                           encoder_decoder=encoder_decoder, precision=precision)
