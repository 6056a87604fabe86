"""Local training of several clients in one pass over the shared frozen backbone (``runtime.clients_per_pass``).

Each client keeps everything the sequential :class:`~fedpeft.training.local.LocalTrainer` gives it: its own
batches (planned with its own generator, as it would alone), its own loss (:mod:`fedpeft.training.fused_loss`),
its own optimizer and learning-rate schedule (torch's, over its own copies of the trainable tensors), its own
gradient clipping, hooks, extra loss and optimizer state, and its own number of steps (a client that has
finished takes no further part). What is shared is the backbone's forward and backward: at each local step the
clients' micro-batches are cut into sub-batches of rows of similar length (each within
``runtime.max_pass_tokens``; the least padded tokens plus ``runtime.sub_batch_cost`` a sub-batch, or the fewest
sub-batches, such that the pass never pads more input tokens than its clients would alone), and every
sub-batch runs through the model once, each row with its own client's tensors (:mod:`fedpeft.tuners.row_batched`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedpeft.data.batching import Encoded, ImageEncoded, collate
from fedpeft.errors import first_line
from fedpeft.metrics.flops import flop_counter
from fedpeft.training.fused_loss import ClientLosses, client_losses
from fedpeft.training.local import (
    LocalTrainer,
    NonFiniteLoss,
    TrainResult,
    drops_first_label,
    load_optimizer_state,
    loss_terms,
    lr_lambda,
    make_optimizer,
    plan_batches,
    read_optimizer_state,
    step_groups,
)
from fedpeft.tuners.row_batched import RowBatchUnsupported, RowForward, Rows, row_batched

log = logging.getLogger("fedpeft")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device (CUDA) or the host allocator running out of memory."""
    text = str(exc)
    return (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text.lower()
            or "can't allocate memory" in text)


@dataclass
class TrainRequest:
    """One client's ``ctx.train(...)`` call, answered with ``result`` or ``error``."""

    slot: int  # the client's slot in the pass (its index in Rows.slot_params)
    data: Encoded | ImageEncoded
    rng: np.random.Generator
    params: dict[str, torch.nn.Parameter]  # the client's own trainable tensors, by TunedModel.params name
    options: dict[str, Any] = field(default_factory=dict)  # LocalTrainer.train's keyword options
    result: TrainResult | None = None
    error: BaseException | None = None


@dataclass
class PassStats:
    """Tokens of the fused passes so far: real ones, padded as fused, and padded as each client alone."""

    real_tokens: int = 0
    fused_tokens: int = 0
    alone_tokens: int = 0
    sub_batches: int = 0
    micro_steps: int = 0

    def __add__(self, other: PassStats) -> PassStats:
        return PassStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __sub__(self, other: PassStats) -> PassStats:
        return PassStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def padded_share(self) -> float | None:
        return None if not self.fused_tokens else 1.0 - self.real_tokens / self.fused_tokens

    def alone_padded_share(self) -> float | None:
        return None if not self.alone_tokens else 1.0 - self.real_tokens / self.alone_tokens


PACK_BLOCK = 1024  # the most rows one packing programme takes (its tables hold (rows + 1)^2 entries)


def pack_rows(lengths: np.ndarray, budget: int, max_tokens: int | None = None,
              sub_batch_cost: int | None = None) -> list[np.ndarray]:
    """Rows (by index into ``lengths``) cut into sub-batches, each padded to its longest row and, with
    ``max_tokens``, holding at most that many padded tokens (or a single row), whose padded tokens total at most
    ``budget``. With ``sub_batch_cost`` (what one more sub-batch costs, in padded tokens) the cut of least
    padded tokens plus that cost per sub-batch, if it fits the budget; otherwise the fewest sub-batches, and
    among those the least padding, which is then also the least cost within the budget (the least padding in g
    groups is convex in g: a group's padding (j - i) x longest[i] over rows sorted by length satisfies the
    quadrangle inequality, with the cap too).

    A sub-batch is a run of rows in order of length (an optimal cut always is one), so dynamic programmes over
    the sorted rows find both. One row per distinct length pads nothing, so the answer exists whenever
    ``budget`` covers the real tokens; below that, the least padding is returned. The programmes hold
    (rows + 1)^2 entries: more than ``PACK_BLOCK`` rows are cut, in order of length, into blocks of at most that
    many, each packed within its share of the budget (in proportion to its real tokens)."""
    order = np.argsort(-lengths, kind="stable")
    n = len(order)
    if n == 0:
        return []
    budget = max(budget, int(lengths.sum()))  # (the least padding, when the budget is below the real tokens)
    if n > PACK_BLOCK:
        blocks = [order[i:i + PACK_BLOCK] for i in range(0, n, PACK_BLOCK)]
        real = max(1, int(lengths.sum()))
        return [block[g] for block in blocks
                for g in pack_rows(lengths[block], budget * int(lengths[block].sum()) // real, max_tokens,
                                   sub_batch_cost)]
    longest = lengths[order].astype(np.int64)  # a group of sorted rows i..j-1 pads to longest[i]
    start = np.arange(n + 1)[:, None]
    size = np.arange(n + 1)[None, :] - start  # (start i, end j): rows in the group
    padded = size * np.append(longest, 0)[:, None]
    allowed = size > 0
    if max_tokens is not None:
        allowed &= (padded <= max_tokens) | (size == 1)
    never = np.iinfo(np.int64).max // 4
    cost_of = np.where(allowed, padded, never)  # (i, j): padded tokens of the group of sorted rows i..j-1
    if sub_batch_cost is not None:
        starts = _cheapest_cut(cost_of, sub_batch_cost)
        if sum(int(cost_of[i, j]) for i, j in itertools.pairwise(starts)) <= budget:
            return [order[i:j] for i, j in itertools.pairwise(starts)]
    best = np.full(n + 1, never, dtype=np.int64)  # least padding of the first j rows in the groups so far
    best[0] = 0
    cuts: list[np.ndarray] = []  # per number of groups: where the last group of the first j rows starts
    while len(cuts) < n and (not cuts or best[n] > budget):
        cost = np.minimum(best[:, None] + cost_of, never)
        cut = cost.argmin(axis=0)
        best = cost[cut, np.arange(n + 1)]
        cuts.append(cut)
    groups, j = [], n
    for cut in reversed(cuts):
        i = int(cut[j])
        groups.append(order[i:j])
        j = i
    return groups[::-1]


def _cheapest_cut(cost_of: np.ndarray, sub_batch_cost: int) -> list[int]:
    """Where the groups start (and the last ends) in the cut of least ``cost_of`` plus ``sub_batch_cost`` a
    group."""
    n = cost_of.shape[0] - 1
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        cost = best[:j] + cost_of[:j, j]
        cut[j] = int(cost.argmin())
        best[j] = cost[cut[j]] + sub_batch_cost
    starts, j = [n], n
    while j > 0:
        j = int(cut[j])
        starts.append(j)
    return starts[::-1]


@dataclass
class _Client:
    request: TrainRequest
    cfg: Any
    steps: list[tuple[int, list[np.ndarray]]]  # (epoch, micro-batches) of each optimizer step
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lengths: np.ndarray  # each example's tokens (an image: its model's tokens)
    epoch_losses: dict[int, list[float]] = field(default_factory=dict)
    examples: int = 0
    tokens: int = 0
    ops: float = 0.0
    sampled: int = 0
    failed: bool = False


class FusedTrainer:
    """Trains the requests of one pass together; ``activate(slot)`` puts a slot's tensors into the model
    before its hooks and extra loss run (so they see the model as that client would)."""

    def __init__(self, trainer: LocalTrainer, model: torch.nn.Module, forwards: Mapping[torch.nn.Module, RowForward],
                 names: Mapping[tuple[int, str], str], activate: Callable[[int], None], limit: int | None = None,
                 max_tokens: int | None = None, sub_batch_cost: int | None = None):
        self.trainer = trainer
        self.model = model
        self.forwards = forwards
        self.names = names
        self.activate = activate
        self.stats = PassStats()
        self.limit = limit  # the most clients whose rows go through the model together (halved on out-of-memory)
        self.max_tokens = max_tokens  # the most padded tokens one sub-batch may hold (None: no cap)
        self.sub_batch_cost = sub_batch_cost  # one more sub-batch's cost in padded tokens (None: fewest sub-batches)
        self.slack = 0  # padded tokens the clients alone would have computed so far, less those computed fused

    def train(self, requests: Sequence[TrainRequest]) -> None:
        t = self.trainer
        shifted = drops_first_label(self.model)
        clients = [self._start(r) for r in requests]
        slots = max(r.slot for r in requests) + 1
        slot_params: list[Mapping[str, torch.Tensor]] = [{} for _ in range(slots)]
        for r in requests:
            slot_params[r.slot] = r.params
        rows = Rows(slot_params=slot_params, names=self.names)
        self.model.train()
        start = time.perf_counter()
        longest = max((len(c.steps) for c in clients), default=0)
        for s in range(longest):
            active = [c for c in clients if not c.failed and s < len(c.steps)]
            if not active:
                break
            measure = t.flops_steps < t.flops_sample_steps
            fused_tokens, flops = self._step_within_memory(s, active, rows, shifted, measure)
            if flops is not None:  # the run's budget of sampled steps counts each client's step in the pass
                t.flops_measured += flops
                t.flops_tokens += fused_tokens
                t.flops_steps += len(active)
                for c in active:
                    c.sampled = 1
            for c in active:
                if not c.failed:
                    self._optimizer_step(c)
            if t.on_step is not None:
                t.on_step(s + 1, longest)
        seconds = time.perf_counter() - start
        total_tokens = sum(c.tokens for c in clients) or 1
        rate = t.flops_per_token()
        for c in clients:
            if c.failed:
                continue
            r = c.request
            if r.options.get("optimizer_state") is not None:
                state = r.options["optimizer_state"]
                state.clear()
                state.update(read_optimizer_state(c.optimizer, r.params))
            if c.cfg.local_steps is None:
                last = c.epoch_losses[max(c.epoch_losses)] if c.epoch_losses else []
            else:
                last = [x for e in sorted(c.epoch_losses) for x in c.epoch_losses[e]]
            r.result = TrainResult(
                loss=float(np.mean(last)) if last else float("nan"), steps=len(c.steps), examples=c.examples,
                tokens=c.tokens, seconds=seconds * c.tokens / total_tokens,
                flops=rate * c.tokens if rate is not None else None, flops_sampled_steps=c.sampled,
                ops_analytic=c.ops if t.ops_per_sequence is not None else None)

    def probe(self, requests: Sequence[TrainRequest], repeats: int = 2) -> tuple[float, int, int]:
        """Time the forward and backward of every request's first local step together, ``repeats`` times, and
        throw the gradients away (no optimizer step, no counts): (fastest seconds, examples, peak accelerator
        bytes or 0)."""
        shifted = drops_first_label(self.model)
        clients = [self._start(r) for r in requests]
        rows = Rows(slot_params=[r.params for r in requests], names=self.names)
        self.model.train()
        best, peak = float("inf"), 0
        cuda = self.trainer.device.type == "cuda"
        for _ in range(repeats):
            self.slack = 0  # (each repeat packs as the first)
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.trainer.device)
            start = time.perf_counter()
            self._step(0, clients, rows, shifted)
            if cuda:
                torch.cuda.synchronize(self.trainer.device)
                peak = max(peak, torch.cuda.max_memory_allocated(self.trainer.device))
            best = min(best, time.perf_counter() - start)
            for c in clients:
                c.optimizer.zero_grad(set_to_none=True)
        return best, sum(len(i) for c in clients for i in c.steps[0][1]), peak

    def _start(self, r: TrainRequest) -> _Client:
        t = self.trainer
        lr = r.options.get("lr")
        cfg = t.cfg if lr is None else t.cfg.model_copy(update={"lr": lr})
        epochs = step_groups(plan_batches(r.data, cfg, r.rng), cfg)
        steps = [(e, group) for e, groups in enumerate(epochs) for group in groups]
        optimizer = make_optimizer(list(r.params.values()), cfg)
        if r.options.get("optimizer_state"):
            load_optimizer_state(optimizer, r.params, r.options["optimizer_state"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, len(steps)))
        return _Client(request=r, cfg=cfg, steps=steps, optimizer=optimizer, scheduler=scheduler,
                       lengths=r.data.lengths())

    def _fail(self, c: _Client, value: float, step: int) -> None:
        c.failed = True
        c.request.error = NonFiniteLoss(f"non-finite training loss ({value}) at local step {step + 1}")
        c.optimizer.zero_grad(set_to_none=True)

    def _step_within_memory(self, s: int, active: list[_Client], rows: Rows, shifted: bool,
                            measure: bool) -> tuple[int, float | None]:
        """:meth:`_step` (its padded tokens, and with ``measure`` its FLOPs); when the device runs out of memory,
        the step's gradients and counts are dropped, the number of clients per pass is halved and the step is
        done again (no optimizer step has been taken, so no client loses any work). Below one client per pass
        the error stands."""
        while True:
            saved = [(c.examples, c.tokens, c.ops, c.failed, c.request.error) for c in active]
            stats, slack = dataclasses.astuple(self.stats), self.slack
            try:
                counter = flop_counter() if measure else contextlib.nullcontext()
                with counter:
                    tokens = self._step(s, active, rows, shifted)
                return tokens, counter.get_total_flops() if measure else None
            except (RuntimeError, MemoryError) as exc:
                together = min(self.limit or len(active), len(active))
                if not out_of_memory(exc) or together <= 1:
                    raise
                for c, (examples, tokens, ops, failed, error) in zip(active, saved):
                    c.examples, c.tokens, c.ops, c.failed, c.request.error = examples, tokens, ops, failed, error
                    c.optimizer.zero_grad(set_to_none=True)
                self.stats.__init__(*stats)  # type: ignore[misc]
                self.slack = slack
                self.limit = together // 2
                message = first_line(exc, 80)
                del exc  # (its traceback holds the failed attempt's tensors)
                if self.trainer.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("runtime.clients_per_pass: out of memory with %d clients in one pass (%s); %d from now on, "
                            "local step %d done again", together, message, self.limit, s + 1)

    def _step(self, s: int, active: list[_Client], rows: Rows, shifted: bool) -> int:
        """Forward and backward of step ``s``'s micro-batches of every active client; returns the fused tokens."""
        t = self.trainer
        step_loss = {id(c): 0.0 for c in active}
        batches: dict[int, list[dict[str, torch.Tensor]]] = {}
        weights: dict[int, list[float]] = {}
        terms: dict[int, list[int]] = {}  # each micro-batch's loss terms (the denominator of its mean)
        widths: dict[int, list[int]] = {}  # each micro-batch's padded length (an image: its tokens)
        for c in active:
            group = c.steps[s][1]
            batches[id(c)] = [collate(c.request.data, idx, t.pad_id) for idx in group]  # as the client alone pads
            widths[id(c)] = [int(c.lengths[idx].max()) for idx in group]
            terms[id(c)] = [loss_terms(b, shifted) for b in batches[id(c)]]
            total_terms = sum(terms[id(c)]) or len(group)
            weights[id(c)] = [n / total_terms for n in terms[id(c)]] if len(group) > 1 else [1.0]
        fused_tokens = 0
        for j in range(max(len(c.steps[s][1]) for c in active)):
            present = [c for c in active if not c.failed and j < len(c.steps[s][1])]
            if not present:
                continue
            for c in present:
                idx, width = c.steps[s][1][j], widths[id(c)][j]
                n_tok = len(idx) * width
                c.examples += len(idx)
                c.tokens += n_tok
                self.stats.alone_tokens += n_tok
                if t.ops_per_sequence is not None:
                    c.ops += t._ops(len(idx), width, c.request.options.get("head_fraction", 1.0))
            size = self.limit or len(present)
            for members in (present[i:i + size] for i in range(0, len(present), size)):
                fused_tokens += self._micro_step(
                    s, j, members, rows, {id(c): weights[id(c)][j] for c in members},
                    {id(c): terms[id(c)][j] for c in members},
                    sum(len(c.steps[s][1][j]) * widths[id(c)][j] for c in members), step_loss)
        for c in active:
            if not c.failed:
                c.epoch_losses.setdefault(c.steps[s][0], []).append(step_loss[id(c)])
        return fused_tokens

    def _micro_step(self, s: int, j: int, members: list[_Client], rows: Rows, weights: dict[int, float],
                    denominators: dict[int, int], budget: int, step_loss: dict[int, float]) -> int:
        """One micro-batch of each member, cut into sub-batches by length; returns their padded tokens. The
        sub-batches may pad up to what the members would pad alone (``budget``) plus what earlier micro-batches of
        the pass padded less than alone, so the pass as a whole never pads more than its clients alone."""
        t = self.trainer
        entries = [(c, int(i)) for c in members for i in c.steps[s][1][j]]
        lengths = np.array([c.lengths[i] for c, i in entries], dtype=np.int64)
        by_slot = {c.request.slot: c for c in members}
        loss_value = {id(c): 0.0 for c in members}
        counts = {id(c): 0 for c in members}
        padded = 0
        for group in pack_rows(lengths, budget + self.slack, self.max_tokens, self.sub_batch_cost):
            chosen = sorted(group.tolist(), key=lambda k: (entries[k][0].request.slot, k))
            data = _gathered([(entries[k][0].request.data, entries[k][1]) for k in chosen])
            batch = {k: v.to(t.device) for k, v in collate(data, np.arange(len(chosen)), t.pad_id).items()}
            slots = [entries[k][0].request.slot for k in chosen]
            segments, first = [], 0
            for n in range(1, len(slots) + 1):
                if n == len(slots) or slots[n] != slots[first]:
                    segments.append((slots[first], first, n))
                    first = n
            rows.start_batch(torch.tensor(slots, dtype=torch.long, device=t.device))
            record = ClientLosses(segments=segments)
            # the backward inside the row forwards too: gradient checkpointing recomputes blocks during it
            with row_batched(self.forwards, rows):
                with client_losses(record, len(slots)), t._autocast():
                    self.model(**batch)
                if set(record.sums) != {slot for slot, _, _ in segments}:
                    raise RowBatchUnsupported("the model's forward computed no loss through the functions a fused "
                                              "pass splits per client")
                total = None
                live = [(slot, by_slot[slot], part) for slot, part in record.sums.items() if not by_slot[slot].failed]
                terms = [part / denominators[id(c)] for _, c, part in live]
                values = torch.stack([x.detach().float() for x in terms]).tolist() if terms else []  # one sync
                for (slot, c, _), term, value in zip(live, terms, values):
                    loss_value[id(c)] += value
                    counts[id(c)] += record.counts[slot]
                    if not np.isfinite(value):
                        self._fail(c, loss_value[id(c)], s)
                        continue
                    weighted = term * weights[id(c)]
                    total = weighted if total is None else total + weighted
                if total is not None:
                    total.backward()
            padded += len(chosen) * int(lengths[group].max())  # collate pads to the longest (images: all alike)
            self.stats.sub_batches += 1
            self.stats.real_tokens += int(lengths[group].sum())
        self.stats.fused_tokens += padded
        self.stats.micro_steps += 1
        self.slack += budget - padded
        for c in members:
            if c.failed:
                continue
            if counts[id(c)] != denominators[id(c)]:
                raise RuntimeError(f"fused pass: client slot {c.request.slot} has {counts[id(c)]} loss terms, "
                                   f"alone it would have {denominators[id(c)]}")
            extra_loss = c.request.options.get("extra_loss")
            if extra_loss is not None:
                self.activate(c.request.slot)
                with t._autocast():
                    extra = extra_loss()
                loss_value[id(c)] += float(extra.detach())
                if not np.isfinite(loss_value[id(c)]):
                    self._fail(c, loss_value[id(c)], s)
                    continue
                if extra.requires_grad:  # (a constant term changes the loss, not the gradient)
                    (extra * weights[id(c)]).backward()
            step_loss[id(c)] += loss_value[id(c)] * weights[id(c)]
        return padded

    def _optimizer_step(self, c: _Client) -> None:
        options = c.request.options
        self.activate(c.request.slot)
        if options.get("before_step") is not None:
            options["before_step"]()
        if c.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(c.request.params.values()), c.cfg.max_grad_norm)
        c.optimizer.step()
        if options.get("after_step") is not None:
            options["after_step"]()
        c.scheduler.step()
        c.optimizer.zero_grad(set_to_none=True)


def _gathered(rows: list[tuple[Any, int]]) -> Encoded | ImageEncoded:
    """One sub-batch's examples, each ``(its client's data, its index there)``, as one split (images: one processor's,
    so the clients' pixels share their normalisation)."""
    first = rows[0][0]
    if isinstance(first, ImageEncoded):
        return ImageEncoded(np.stack([d.pixels[i] for d, i in rows]), [d.labels[i] for d, i in rows], first.tokens,
                            first.scale, first.mean, first.std)
    return Encoded(input_ids=[d.input_ids[i] for d, i in rows], labels=[d.labels[i] for d, i in rows],
                   token_type_ids=None if first.token_type_ids is None else [d.token_type_ids[i] for d, i in rows])
