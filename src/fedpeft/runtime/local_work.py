"""One client's local work for a round, the same in every runtime (in this process, or in a Flower ClientApp):
seeded by (seed, round, client) only, so a client gives the same update wherever and whenever it runs: bit for bit
with the same torch threads on the same kind of machine, to float32 rounding elsewhere (other threads, a fused pass)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedpeft import algorithms, wire
from fedpeft.algorithms.base import ClientContext
from fedpeft.runtime.attacks import attacker_ids, flip_labels, poison
from fedpeft.runtime.personal import PERSONAL, personal_due, score
from fedpeft.runtime.setup import Experiment


def client_seed(seed: int, rnd: int, cid: int) -> int:
    return int(np.random.SeedSequence([seed, rnd, cid]).generate_state(1)[0])


def train_client(exp: Experiment, client: algorithms.ClientAlgorithm, rnd: int, cid: int, received: wire.Payload,
                 state: dict[str, Any], report: Callable[[str, Any], None] | None = None, *, tuned: Any = None,
                 trainer: Callable[..., Any] | None = None) -> wire.Payload:
    """One client's local work for round ``rnd``, the same in every runtime: seeded by (seed, round, client)
    only, so a client gives the same update wherever and whenever it runs (to float32 rounding across thread
    counts and fused passes; see the module's text). ``state`` is the client's
    algorithm state, updated in place. ``tuned`` (default: the shared ``exp.tuned``) is the model the client
    half gets; ``trainer(tuned, data, rng, **options)`` (default: ``exp.trainer.train``) trains it (a cohort
    passes its own, see fedpeft.runtime.cohort)."""
    own = exp.tuned if tuned is None else tuned
    train_with = exp.trainer.train if trainer is None else trainer
    cfg = exp.cfg
    rng = np.random.default_rng([cfg.seed, rnd, cid])
    torch.manual_seed(client_seed(cfg.seed, rnd, cid))
    data = exp.client_data(cid)
    attacking = cid in attacker_ids(cfg)  # a simulated Byzantine client (federation.attackers)
    if attacking and cfg.federation.attackers.attack == "label_flip":
        data = flip_labels(data, exp.data.num_labels)

    def train(*, tuned=None, **options):  # the options of LocalTrainer.train (hooks, optimizer state, lr, ...)
        return train_with(tuned or own, data, rng, **options)

    ctx = ClientContext(client_id=cid, round=rnd, tuned=own, train=train, num_examples=len(data), state=state,
                        data=data, resources=exp.client_resources)
    if report is not None:
        ctx.report = report
    due = personal_due(cfg, rnd)
    personal: dict[str, Any] = {}

    def evaluate_personal(tuned: Any = None) -> dict[str, Any] | None:
        if not due:
            return None
        if PERSONAL in personal:
            raise RuntimeError(f"algorithm {cfg.algorithm.name}: ctx.evaluate_personal() called twice in one round")
        task = exp.personal_data(cid)
        personal[PERSONAL] = None if task is None else score(exp, (tuned or own).module, task)
        return personal[PERSONAL]

    ctx.evaluate_personal = evaluate_personal
    update = client.fit(received, ctx)
    if attacking:
        update = poison(update, received, cfg, rnd, cid)
    if due and PERSONAL not in personal:
        raise RuntimeError(f"algorithm {cfg.algorithm.name} declares supports_personalized_eval but its client half "
                           "did not call ctx.evaluate_personal() (eval.personalized)")
    if personal.get(PERSONAL) is not None:
        update.meta[PERSONAL] = personal[PERSONAL]
    return update
