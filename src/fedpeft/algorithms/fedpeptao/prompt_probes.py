"""What a FedPepTAO client measures on its own data for the server's layer selection (paper 002, Sec. 4.2).

* :func:`client_layer_scores`: Eq. 2-3 for every transformer layer. The hidden states are those each
  layer outputs for the input tokens (``hidden_states[l + 1]`` of the model called with the prompts it
  holds, in eval mode, so without dropout), on ``examples`` samples drawn at random from the client's
  data; each sample's states are flattened over tokens x hidden after zeroing padded positions (the
  reference code keeps the padding's states, which makes two samples' similarity depend on how much
  padding they share in a batch).
* :func:`client_kept_ratio`: Algorithm 1's ratio from the Hessian of the client's training loss with
  respect to the prompt parameters, on one batch (see :mod:`fedpeft.algorithms.fedpeptao.hessian_spectrum`).
  The reference code uses a causal-LM loss over the whole input even for classification; here the
  loss is the one the client trains (the task loss of the model's head).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from fedpeft.algorithms.fedpeptao.hessian_spectrum import kept_ratio, lanczos_spectrum
from fedpeft.algorithms.fedpeptao.layer_selection import layer_score
from fedpeft.data.batching import collate


def sample_batch(data, examples: int, rng: np.random.Generator, pad_id: int, device: torch.device) -> dict:
    """``examples`` (or all, if fewer) of the client's samples as one padded batch."""
    idx = np.sort(rng.permutation(len(data))[:examples])
    return {k: v.to(device) for k, v in collate(data, idx, pad_id).items()}


def client_layer_scores(tuned, batch: dict, num_layers: int) -> list[float] | None:
    """Eq. 3 score of each of the ``num_layers`` layers; None when the batch has fewer than 2 samples."""
    if len(batch["input_ids"]) < 2:
        return None
    model = tuned.module
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True)
    finally:
        model.train(was_training)
    states = out.hidden_states
    if len(states) != num_layers + 1:
        raise ValueError(f"the model returned {len(states)} hidden states for {num_layers} layers")
    mask = batch["attention_mask"].unsqueeze(-1).to(states[1].dtype)
    return [layer_score((states[l + 1] * mask).float().cpu().numpy()) for l in range(num_layers)]


def _math_attention():
    """Hessian-vector products need attention that is twice differentiable: force SDPA's math kernel."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()


def client_kept_ratio(tuned, batch: dict, param_name: str, *, steps: int, probes: int, seed: int) -> float:
    """The share of the prompt Hessian's spectrum kept by the density plateau rule, on one batch."""
    model = tuned.module
    was_training = model.training
    model.eval()
    param = tuned.params[param_name]
    try:
        with _math_attention():
            theta, weights = lanczos_spectrum(lambda: model(**batch).loss, [param], steps=steps, probes=probes,
                                              seed=seed)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return kept_ratio(theta, weights)
