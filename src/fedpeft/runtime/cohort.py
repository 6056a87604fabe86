"""A round's clients trained together: each client half's ``fit`` runs unchanged, and their ``ctx.train`` calls
meet in one fused pass over the shared backbone (``runtime.clients_per_pass``).

Every client of a cohort gets its own copy of the trainable tensors (a :class:`TunedModel` sharing the
backbone, whose ``params`` are that client's) and runs its ``fit`` in its own thread, but only one thread runs at
a time, handing over explicitly: the cohort starts each client in turn until it asks to train (or finishes);
once all have asked, their requests are trained together (:class:`fedpeft.training.fused.FusedTrainer`), then
each client resumes in turn with its result. Before a client's code runs, its tensors are put into the shared
model (a pointer swap, no copy) and its torch random state is restored, so code that reads ``ctx.tuned.module``
sees the model as the client would alone.

``ctx.train(tuned=another_model)`` (a model the client half holds itself, e.g. FedSP's auxiliary model, shared by
the clients of the process) takes part too: the trainable tensors of that model as the client left them when it
asked are copied as the client's own, trained together with the other clients' requests over the same model
and the same trainable tensors, and written back into the model before the client resumes. A model that cannot
be trained row-batched (see fedpeft.tuners.row_batched) is trained one client at a time, said once in the log.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedpeft.training.fused import FusedTrainer, PassStats, TrainRequest, out_of_memory
from fedpeft.training.local import LocalTrainer, TrainResult
from fedpeft.tuners.row_batched import (
    RowBatchUnsupported,
    RowForward,
    owner_names,
    owners,
    row_batched_modules,
)

log = logging.getLogger("fedpeft")
# runtime.max_pass_tokens on a CPU when the config leaves it unset: larger sub-batches train more slowly there
# and hold more activations (benchmarks/clients_per_pass.py: 32 clients per pass, MiniLM-L6, 1024 tokens per
# sub-batch 10.2 s a round and 1542 MiB, 2048: 10.6 s and 1845 MiB, 4096: 12.1 s and 2926 MiB)
CPU_PASS_TOKENS = 1024
# runtime.sub_batch_cost on a CPU when the config leaves it unset: what one more sub-batch costs, in padded
# tokens. A forward and backward takes a fixed time plus a time per token (benchmarks/sub_batch_cost.py,
# MiniLM-L6 + LoRA r8 on 2 cores: 13.0 ms + 0.42 ms a token, 31 tokens, and 36 in another run); 40 allows for
# a fused pass's own bookkeeping per sub-batch (collation, the loss split), not measured apart. On CUDA, where
# a sub-batch's fixed cost dwarfs its tokens, a pass takes the fewest sub-batches.
CPU_SUB_BATCH_COST = 40


class _Aborted(BaseException):
    """Raised in a waiting client's thread when another client's code failed and the cohort stops."""


@dataclass
class _Slot:
    cid: int
    view: Any  # the client's TunedModel over the shared model
    wake: threading.Event = field(default_factory=threading.Event)
    yielded: threading.Event = field(default_factory=threading.Event)
    request: TrainRequest | None = None
    tuned: Any = None  # the model of the pending request
    frozen: dict[str, torch.Tensor] | None = None  # that model's frozen tensors then, if it is the client half's own
    rng_state: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # torch's CPU and CUDA generators
    outcome: Any = None
    error: BaseException | None = None
    done: bool = False
    abort: bool = False


def get_rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's random state: the CPU generator's and every CUDA device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


def set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def own_copy(params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for n, p in params.items()}


def client_view(tuned: Any) -> Any:
    """A TunedModel over the same module whose trainable tensors are the client's own (copies of the current)."""
    view = copy.copy(tuned)
    view.params = own_copy(tuned.params)
    return view


class Cohort:
    """Runs groups of clients together over ``tuned``'s module (one Cohort per run). ``forwards``: the row
    forwards by module type (the built-in ones and the PEFT method's)."""

    def __init__(self, tuned: Any, trainer: LocalTrainer, forwards: Mapping[type, RowForward],
                 max_tokens: int | None = None, sub_batch_cost: int | None = None):
        self.tuned = tuned
        self.trainer = trainer
        self.forwards = forwards
        self.max_tokens = max_tokens  # the most padded tokens in one sub-batch of a pass (None: no cap)
        self.sub_batch_cost = sub_batch_cost  # one more sub-batch's cost in padded tokens (None: fewest sub-batches)
        self.stats = PassStats()
        self.limit: int | None = None  # the most clients in one pass once memory ran out (None: no limit)
        self.chosen: int | None = None  # what runtime.clients_per_pass auto measured
        self.probe_rate = 0.0  # examples a second of the number the last probe chose
        self.places: dict[tuple[int, tuple[str, ...]], dict[str, list[tuple[torch.nn.Module, str]]]] = {}
        self.modules: dict[tuple[int, tuple[str, ...]], Mapping[torch.nn.Module, RowForward] | str] = {}
        # per model (as _key) of the current wave of requests: the frozen tensors' versions and, for a model of the
        # client half's own, their values (see _same_frozen)
        self.wave: dict[tuple[int, tuple[str, ...]], tuple[dict[str, int], dict[str, torch.Tensor] | None]] = {}

    def probe(self, data: Callable[[int], Any], cids: Sequence[int], seed: int, only: int | None = None) -> int:
        """The number of clients per pass that trains fastest on this device: the first local step of 1, 2, 4, ...
        of ``cids`` (``data(cid)``: a client's examples) run together and timed (the faster of two), up to all of
        them; the fastest wins (its examples a second are kept as ``probe_rate``; ``only``: time that number
        alone, for the worker probe). It stops early when a number trains under 80% as fast as the best so far (larger
        ones will not catch up) or on running out of memory. On CUDA the number is also held to what fits
        in 80% of the memory free when the probe starts, at each client's footprint as measured (the pass's
        peak less what was allocated before it, over its clients). The next number tried is the smallest of
        twice the last, the number of clients and (on CUDA) what fits. Nothing is trained."""
        self.probe_rate = 0.0
        modules = self._row_modules(self.tuned)
        if isinstance(modules, str):
            return 1
        names = owner_names(self.tuned.module, list(self.tuned.params))
        originals = dict(self.tuned.params)
        state = get_rng_state()
        best, best_rate, k, found = 1, 0.0, only or 1, []
        device = self.trainer.device
        cids = [c for c in cids if len(data(c))]
        cuda = device.type == "cuda"
        if cuda:  # what the probe's passes may use: free device memory and the allocator's cached blocks
            held = torch.cuda.memory_allocated(device)
            room = 0.8 * (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - held)
        try:
            while cids:
                requests = [TrainRequest(slot=i, data=data(c), rng=np.random.default_rng([seed, 0, c]),
                                         params=own_copy(originals)) for i, c in enumerate(cids[:k])]
                fused = FusedTrainer(self.trainer, self.tuned.module, modules, names,
                                     activate=lambda i, rs=requests: self.install(self.tuned, rs[i].params),
                                     max_tokens=self.max_tokens, sub_batch_cost=self.sub_batch_cost)
                try:
                    seconds, examples, peak = fused.probe(requests)
                except RowBatchUnsupported as exc:  # (how the model computes its loss): one at a time
                    self.modules[self._key(self.tuned)] = str(exc)
                    log.warning("runtime.clients_per_pass: %s; the clients train one at a time", exc)
                    return 1
                except (RuntimeError, MemoryError) as exc:
                    if not out_of_memory(exc):
                        raise
                    found.append(f"{k}: out of memory")
                    break
                rate = examples / seconds
                found.append(f"{k}: {rate:.1f} examples a second")
                if rate > best_rate:
                    best, best_rate = k, rate
                elif rate < 0.8 * best_rate:
                    break
                following = min(2 * k, len(cids))
                if only is not None:
                    break
                if cuda:
                    per_client = max(1, peak - held) / k
                    fits = int(room // per_client)
                    found[-1] += f" ({per_client / 2**20:.0f} MiB each, {fits} fit)"
                    following = min(following, fits)
                if following <= k:
                    break
                k = following
        finally:
            self.install(self.tuned, originals)
            for p in originals.values():
                p.grad = None
            set_rng_state(state)
            if cuda:
                torch.cuda.empty_cache()
        self.probe_rate = best_rate
        log.info("runtime.clients_per_pass auto measured %d (probe of one local step: %s)", best, ", ".join(found))
        return best

    def install(self, tuned: Any, params: Mapping[str, torch.nn.Parameter]) -> None:
        """Put ``params`` (by TunedModel.params name) into ``tuned.module`` in place of its own, at every place
        each sits (tied weights included); a pointer swap, no copy."""
        key = (id(tuned.module), tuple(params))
        if key not in self.places:
            self.places[key] = owners(tuned.module, list(params))
        for name, places in self.places[key].items():
            for module, attr in places:
                module._parameters[attr] = params[name]

    def run(self, cids: Sequence[int], job: Callable[[int, Any, Callable[..., TrainResult]], Any],
            seed: Sequence[int]) -> dict[int, Any]:
        """``job(cid, tuned, train)`` for every client, ``train(tuned, data, rng, **options)`` fused across them;
        returns each client's outcome (re-raising the first client's error, in client order)."""
        slots = [_Slot(cid, client_view(self.tuned)) for cid in cids]
        originals = dict(self.tuned.params)
        self.wave = {}
        threads = []
        try:
            for slot in slots:
                threads.append(threading.Thread(target=self._body, args=(slot, job), daemon=True,
                                                name=f"fedpeft-client-{slot.cid}"))
                threads[-1].start()
                self._resume(slot)
            while True:
                pending = [s for s in slots if s.request is not None and not s.done]
                if not pending:
                    break
                self._train(pending, seed)
                self.wave = {}
                for slot in pending:
                    self._resume(slot)
            return {slot.cid: slot.outcome for slot in slots}
        finally:
            for slot in slots:
                if not slot.done:
                    slot.abort = True
                    slot.wake.set()
            for thread in threads:  # an aborted client's own clean-up runs before the cohort goes on
                thread.join()
            self.install(self.tuned, originals)

    def _resume(self, slot: _Slot) -> None:
        """Run the client's thread until it asks to train or finishes; a failure stops the cohort."""
        self.install(self.tuned, slot.view.params)
        request = slot.request
        if request is not None and slot.tuned is not slot.view:  # a model of the client half's own: as it was
            params = dict(slot.tuned.module.named_parameters())  # when the client asked, with the trained tensors
            with torch.no_grad():
                for name, value in (slot.frozen or {}).items():
                    params[name].copy_(value)
                for name, p in slot.tuned.params.items():
                    p.copy_(request.params[name])
        if slot.rng_state is not None:
            set_rng_state(slot.rng_state)
        slot.yielded.clear()
        slot.wake.set()
        slot.yielded.wait()
        if slot.error is not None:
            raise slot.error

    def _body(self, slot: _Slot, job: Callable[..., Any]) -> None:
        slot.wake.wait()
        slot.wake.clear()
        try:
            if slot.abort:
                raise _Aborted
            slot.outcome = job(slot.cid, slot.view, lambda tuned, data, rng, **options:
                               self._ask(slot, tuned, data, rng, options))
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the cohort's thread, which re-raises it)
            slot.error = exc
        finally:
            slot.done = True
            slot.yielded.set()

    def _ask(self, slot: _Slot, tuned: Any, data: Any, rng: np.random.Generator,
             options: dict[str, Any]) -> TrainResult:
        key = self._key(tuned)
        if isinstance(self.modules.get(key), str) or not self._same_frozen(tuned, slot):  # here, alone
            return self.trainer.train(tuned, data, rng, **options)
        params = slot.view.params if tuned is slot.view else own_copy(tuned.params)
        slot.request = TrainRequest(slot=0, data=data, rng=rng, params=params, options=options)
        slot.tuned = tuned
        slot.frozen = self.wave[key][1]
        slot.rng_state = get_rng_state()
        slot.yielded.set()
        slot.wake.wait()
        slot.wake.clear()
        if slot.abort:
            raise _Aborted
        request, slot.request, slot.tuned, slot.frozen = slot.request, None, None, None
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _same_frozen(self, tuned: Any, slot: _Slot) -> bool:
        """Whether ``tuned``'s frozen tensors are those of the clients that asked before in this wave (the fused
        pass shares them). The first to ask records them: their versions (in-place changes), and for a model of
        the client half's own also their values, put back before the pass. A client half that changes the shared
        backbone's frozen tensors differently per client breaks the contract (RuntimeError); a model of its own
        whose frozen tensors differ per client (FedSP's auxiliary model once each client trained its own body) is
        trained one client at a time from then on."""
        key = self._key(tuned)
        frozen = {n: p for n, p in tuned.module.named_parameters() if n not in tuned.params and
                  not any(p is q for q in tuned.params.values())}
        versions = {n: p._version for n, p in frozen.items()}
        first = self.wave.get(key)
        if first is None:
            values = None if tuned is slot.view else {n: p.detach().clone() for n, p in frozen.items()}
            self.wave[key] = (versions, values)
            return True
        if versions == first[0]:
            return True
        if first[1] is None:
            raise RuntimeError("runtime.clients_per_pass: a client half changed the shared model's frozen tensors "
                               "between two clients' ctx.train calls; clients trained together share them (declare "
                               "trains_batched = False on the client half)")
        if all(torch.equal(p, first[1][n]) for n, p in frozen.items()):
            return True
        reason = (f"the clients' frozen tensors of a model of the client half's own ({type(tuned.module).__name__}) "
                  "differ from client to client, so they share no backbone")
        self.modules[key] = reason
        log.warning("runtime.clients_per_pass: %s; the clients train one at a time", reason)
        return False

    @staticmethod
    def _key(tuned: Any) -> tuple[int, tuple[str, ...]]:
        return id(tuned.module), tuple(tuned.params)

    def _row_modules(self, tuned: Any) -> Mapping[torch.nn.Module, RowForward] | str:
        """The row-batched modules of ``tuned`` (cached), or why it trains one client at a time."""
        key = self._key(tuned)
        if key not in self.modules:
            try:
                self.modules[key] = row_batched_modules(tuned.module, list(tuned.params), self.forwards)
            except RowBatchUnsupported as exc:
                self.modules[key] = str(exc)
                log.warning("runtime.clients_per_pass: %s; the clients train one at a time", exc)
        return self.modules[key]

    def _train(self, pending: list[_Slot], seed: Sequence[int]) -> None:
        groups: dict[tuple[int, tuple[str, ...]], list[_Slot]] = {}
        for slot in pending:
            groups.setdefault(self._key(slot.tuned), []).append(slot)
        for group in groups.values():
            self._train_group(group, seed)

    def _train_group(self, group: list[_Slot], seed: Sequence[int]) -> None:
        tuned = group[0].tuned
        recorded = self.wave.get(self._key(tuned))
        if recorded is not None and recorded[1] is not None:  # a model of the client half's own: its frozen state
            params = dict(tuned.module.named_parameters())
            with torch.no_grad():
                for name, value in recorded[1].items():
                    params[name].copy_(value)
        requests = []
        for k, slot in enumerate(group):
            assert slot.request is not None
            slot.request.slot = k
            requests.append(slot.request)
        originals = dict(tuned.params)
        modules = self._row_modules(tuned)
        snapshots = [(copy.deepcopy(r.rng.bit_generator.state), {n: p.detach().clone() for n, p in r.params.items()})
                     for r in requests]
        try:
            if isinstance(modules, str):
                raise RowBatchUnsupported(modules)
            torch.manual_seed(int(np.random.SeedSequence([*seed, *(s.cid for s in group)]).generate_state(1)[0]))
            names = owner_names(tuned.module, list(tuned.params))
            fused = FusedTrainer(self.trainer, tuned.module, modules, names,
                                 activate=lambda k: self.install(tuned, requests[k].params), limit=self.limit,
                                 max_tokens=self.max_tokens, sub_batch_cost=self.sub_batch_cost)
            fused.stats = self.stats
            try:
                fused.train(requests)
            finally:
                self.limit = fused.limit
        except RowBatchUnsupported as exc:
            if not isinstance(modules, str):  # found during the pass (e.g. how the model computes its loss)
                self.modules[self._key(tuned)] = str(exc)
                log.warning("runtime.clients_per_pass: %s; the clients train one at a time", exc)
            for slot, request, (rng_state, values) in zip(group, requests, snapshots):
                self._train_alone(slot, request, rng_state, values)
        finally:
            self.install(tuned, originals)

    def _train_alone(self, slot: _Slot, request: TrainRequest, rng_state: dict[str, Any],
                     values: Mapping[str, torch.Tensor]) -> None:
        """The request trained as the client would alone, from where it asked (its generator, tensors, torch
        random state)."""
        request.rng.bit_generator.state = rng_state
        request.result = request.error = None
        with torch.no_grad():
            for name, p in request.params.items():
                p.copy_(values[name])
                p.grad = None
        self.install(slot.tuned, request.params)
        if slot.rng_state is not None:
            set_rng_state(slot.rng_state)
        alone = copy.copy(slot.tuned)
        alone.params = request.params
        try:
            request.result = self.trainer.train(alone, request.data, request.rng, **request.options)
        except Exception as error:  # noqa: BLE001 (handed to the client's own code, as it would be alone)
            request.error = error
        slot.rng_state = get_rng_state()


def make_cohort(exp: Any, client: Any) -> Cohort | None:
    """The run's Cohort under ``runtime.clients_per_pass`` > 1, or None (logging once why the clients train one
    at a time: the PEFT method or the client half declares it cannot, fp16's loss scaling, or a trainable tensor
    in a module without a row forward)."""
    from fedpeft.tuners.registry import registered_peft_method
    from fedpeft.tuners.row_batched import built_in_row_forwards

    cfg = exp.cfg
    if cfg.runtime.clients_per_pass == 1:
        return None
    method = registered_peft_method(cfg.peft.method)
    reason = None
    if not method.trains_batched:
        reason = f"peft.method {cfg.peft.method} trains every client's own copy of the weights"
    elif not getattr(client, "trains_batched", True):
        reason = f"the client half of algorithm {cfg.algorithm.name} declares trains_batched = False"
    elif cfg.runtime.precision == "fp16":
        reason = "runtime.precision fp16 scales each client's loss on its own (use bf16)"
    forwards = {**built_in_row_forwards(), **method.row_forwards}
    if reason is None:
        try:
            row_batched_modules(exp.tuned.module, list(exp.tuned.params), forwards)
        except RowBatchUnsupported as exc:
            reason = str(exc)
    if reason is not None:
        log.warning("runtime.clients_per_pass %s: %s; the clients train one at a time", cfg.runtime.clients_per_pass,
                    reason)
        return None
    log.info("runtime.clients_per_pass %s: clients train together in passes over the backbone",
             cfg.runtime.clients_per_pass)
    cpu = exp.device.type == "cpu"
    max_tokens = cfg.runtime.max_pass_tokens
    if max_tokens is None and cpu:
        max_tokens = CPU_PASS_TOKENS
    sub_batch_cost = cfg.runtime.sub_batch_cost
    if sub_batch_cost is None and cpu:
        sub_batch_cost = CPU_SUB_BATCH_COST
    return Cohort(exp.tuned, exp.trainer, forwards, max_tokens, sub_batch_cost)


def pass_row(before: PassStats, after: PassStats) -> dict[str, Any]:
    """A metrics row's figures of the round's fused passes: sub-batches run, and the share of padded tokens in
    them next to the share the same clients would have padded alone."""
    delta = after - before
    if not delta.sub_batches:
        return {}
    return {"fused_sub_batches": delta.sub_batches, "fused_micro_steps": delta.micro_steps,
            "fused_padded_share": delta.padded_share(), "alone_padded_share": delta.alone_padded_share()}
