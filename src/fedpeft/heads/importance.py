"""Head importance on a client (paper 000, Eq. 6): the "confidence" of each attention head.

For every example, every head and every query position that is not padding, take the largest
attention probability that the query gives to a key which is neither padding nor an end-of-sequence /
separator token (the tokenizer's ``eos_token_id`` and ``sep_token_id``); average over the example's
query positions, then over the examples. Virtual prompt / prefix keys count as ordinary keys. A query
whose every key is excluded (e.g. the first position of a causal model that starts with a separator)
is left out. The probabilities are the model's own softmax over all its keys, not renormalised.

The pass feeds the model exactly the batch that training feeds it (input ids, attention mask,
``token_type_ids`` where the task has sentence pairs, labels), so BERT-family pairs keep their segment ids.

Encoder-decoder models: the decoder reads its inputs shifted right by one (``decoder_start_token_id``,
then the target without its last token; a classification head's decoder reads the shifted input ids),
so decoder key ``j`` is the token at position ``j - 1`` of the target. Decoder queries are the target
positions (labels != -100; for a classification head, the input positions); a decoder key is excluded
when the token the decoder reads there is padding, EOS or a separator (so BART's decoder-start ``</s>``
is excluded and T5's last target token is kept; T5's decoder start is its pad id, which the model
attends like any token, so it counts). Cross-attention keys are the encoder tokens. The pass runs in
eval mode with eager attention (SDPA returns no probabilities) under ``torch.no_grad``, on the model as
received from the server, before training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fedpeft.data.batching import collate, sequential_batches
from fedpeft.heads.layout import HeadLayout


@dataclass
class Importance:
    alpha: np.ndarray  # (num_heads,) float64
    examples: int
    seconds: float


def _base(module):
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def decoder_inputs(source: torch.Tensor, config) -> torch.Tensor:
    """The token ids an encoder-decoder model's decoder reads for ``source`` (labels, or the input ids of a
    classification head): shifted right by one behind ``decoder_start_token_id``, -100 read as padding,
    as T5's ``_shift_right`` and BART's ``shift_tokens_right`` build them (mBART-style models, which move
    the last token to the front instead, are not covered)."""
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        raise ValueError(f"{config.model_type}: head importance needs the config's decoder_start_token_id and "
                         "pad_token_id to know what the decoder reads; set them in the model's config")
    shifted = torch.empty_like(source)
    shifted[:, 1:] = source[:, :-1]
    shifted[:, 0] = int(start)
    return shifted.masked_fill(shifted == -100, int(pad))


def _keys(valid: torch.Tensor, tokens: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """Key positions that count: valid ones whose token is not an excluded (EOS / separator) id."""
    return valid & ~torch.isin(tokens, exclude) if exclude is not None else valid


def _max_valid(att: torch.Tensor, q_valid: torch.Tensor, k_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (example, head): sum over valid queries of the max probability on valid keys, and the query count.

    att: (B, H, Tq, Tk'), where Tk' may exceed len(k_valid)'s T by leading virtual keys (always valid).
    """
    extra = att.shape[-1] - k_valid.shape[1]
    if extra > 0:
        k_valid = torch.cat([torch.ones(k_valid.shape[0], extra, dtype=torch.bool, device=k_valid.device), k_valid], 1)
    extra_q = att.shape[2] - q_valid.shape[1]
    if extra_q > 0:  # prompt tuning prepends virtual queries: they are not the example's positions
        att = att[:, :, extra_q:, :]
    masked = att.masked_fill(~k_valid[:, None, None, :], float("-inf"))
    best = masked.max(dim=-1).values  # (B, H, Tq)
    usable = q_valid[:, None, :] & torch.isfinite(best)
    return torch.where(usable, best, torch.zeros_like(best)).sum(-1), usable.sum(-1)


@torch.no_grad()
def head_importance(
    tuned, data, layout: HeadLayout, *, pad_id: int, exclude_token_ids: set[int], device: torch.device,
    batch_size: int = 16, max_examples: int | None = None, rng: np.random.Generator | None = None,
) -> Importance:
    """alpha_h for every head of ``layout`` on the client's ``data`` (a sample of ``max_examples``)."""
    start = time.perf_counter()
    n = len(data)
    if max_examples is not None and n > max_examples:
        rng = rng or np.random.default_rng(0)
        data = data.subset(np.sort(rng.choice(n, size=max_examples, replace=False)))
        n = max_examples
    module = tuned.module
    base = _base(module)
    previous = getattr(base.config, "_attn_implementation", None)
    was_training = module.training
    base.set_attn_implementation("eager")
    module.eval()
    H = layout.heads_per_module
    sums = np.zeros(layout.num_heads)
    exclude = torch.tensor(sorted(exclude_token_ids), dtype=torch.long, device=device) if exclude_token_ids else None
    encdec = bool(getattr(base.config, "is_encoder_decoder", False))
    try:
        for idx in sequential_batches(data.lengths(), batch_size):
            batch = {k: v.to(device) for k, v in collate(data, idx, pad_id).items()}
            if "pixel_values" in batch:  # an image: every patch and the class token, none of them padding
                ids = None
                enc_q = torch.ones(len(idx), int(data.lengths()[0]), dtype=torch.bool, device=device)
                enc_k = enc_q
            else:
                ids = batch["input_ids"]
                enc_q = batch["attention_mask"].bool()
                enc_k = _keys(enc_q, ids, exclude)
            out = module(**batch, output_attentions=True)
            groups: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []
            if encdec:
                labels = batch["labels"]
                if labels.dim() == 2:  # seq2seq: the decoder reads the shifted target
                    dec_q, dec_inputs = labels != -100, decoder_inputs(labels, base.config)
                else:  # classification head: the decoder reads the shifted input ids
                    dec_q, dec_inputs = enc_q, decoder_inputs(ids, base.config)
                dec_k = _keys(dec_q, dec_inputs, exclude)
                groups = [(out.encoder_attentions, enc_q, enc_k), (out.decoder_attentions, dec_q, dec_k),
                          (out.cross_attentions, dec_q, enc_k)]
            else:
                groups = [(out.attentions, enc_q, enc_k)]
            mod = 0
            for attentions, q_valid, k_valid in groups:
                for att in attentions:
                    s, c = _max_valid(att.float(), q_valid, k_valid)
                    mean = torch.where(c > 0, s / c.clamp(min=1), torch.zeros_like(s))  # (B, H)
                    sums[mod * H:(mod + 1) * H] += mean.sum(0).double().cpu().numpy()
                    mod += 1
            if mod != layout.num_modules:
                raise RuntimeError(f"the model returned {mod} attention maps, the head layout expects {layout.num_modules}")
    finally:
        if previous is not None:
            base.set_attn_implementation(previous)
        module.train(was_training)
    return Importance(alpha=sums / max(n, 1), examples=n, seconds=time.perf_counter() - start)
