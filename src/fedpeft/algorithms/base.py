"""The two halves of a federated algorithm, over plain named arrays.

A server half selects clients, builds one payload per selected client, checks every returned update
and aggregates the accepted ones. A client half turns a received payload into an update payload,
using a :class:`ClientContext` that the runtime provides (the model with the PEFT method applied, a
local trainer bound to the client's data, and the per-client state the algorithm asked to keep).
Neither half knows about sockets, processes or Flower: the same objects run in every runtime.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, Protocol, TypedDict, TypeVar

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from fedpeft.algorithms.aggregate import weighted_mean
from fedpeft.errors import first_line
from fedpeft.registry import CodeRef
from fedpeft.wire import Arrays, Payload

if TYPE_CHECKING:  # the types of the contract; importing this module loads none of them (no torch)
    import torch

    from fedpeft.config.schema import AlgorithmOptions, PeftOptions
    from fedpeft.data.batching import Encoded, ImageEncoded
    from fedpeft.training.local import TrainResult
    from fedpeft.training.server import ServerModel
    from fedpeft.tuners.tuned import TunedModel

log = logging.getLogger("fedpeft")

# The options model a server half reads (``ServerAlgorithm[MyOptions]`` makes ``self.options`` a ``MyOptions``)
OptionsT = TypeVar("OptionsT", bound="AlgorithmOptions")


def random_selection(num_clients: int, k: int, seed: int, rnd: int, population: Sequence[int] | None = None
                     ) -> list[int]:
    """K distinct clients, uniformly at random; a pure function of (seed, round). ``population``: the clients to
    choose from (default: all ``num_clients``; fewer than K: all of them)."""
    rng = np.random.default_rng([seed, rnd, 0x5E1EC7])
    if population is None:
        return sorted(int(c) for c in rng.choice(num_clients, size=k, replace=False))
    pool = np.asarray(sorted(population), dtype=np.int64)
    return sorted(int(c) for c in rng.choice(pool, size=min(k, len(pool)), replace=False))


class UpdateRejected(ValueError):
    """An update that must not be aggregated; the message is the logged reason."""


def shown(value: Any) -> str:
    """A client's value in a message: its repr, cut to 40 characters (a huge integer's is not even made)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 128:
        return f"an integer of {len(str(abs(value)))} digits" if abs(value).bit_length() < 14000 else "a huge integer"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


# The most examples one update may claim: every integer up to it is exact in float64, which the weights are
# computed in; a larger (or a huge JSON) integer would overflow or lose the sum.
MAX_EXAMPLES = 2**53


def finite_number(value: Any, what: str) -> float:
    """``value`` as a float, or UpdateRejected if it is not a finite JSON number (huge integers included)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UpdateRejected(f"{what} must be a number, got {shown(value)}")
    try:
        x = float(value)
    except OverflowError:
        raise UpdateRejected(f"{what} is out of range, got {shown(value)}") from None
    if not math.isfinite(x):
        raise UpdateRejected(f"{what} must be finite, got {value!r}")
    return x


def _clock_value(value: Any) -> Any:
    """A measured quantity as :func:`fedpeft.wire.clock_text` writes it (or a plain number): a finite,
    non-negative number."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError("not a number") from None
    if finite_number(number, "the value") < 0:
        raise ValueError("must be >= 0")
    return value


ClockValue = Annotated[str | float | int, BeforeValidator(_clock_value)]


class UpdateMeta(BaseModel):
    """The metadata keys of an update that the runtime and the server read, with their types and ranges: every
    update's metadata is checked against it (or an algorithm's subclass, :attr:`ServerAlgorithm.update_meta`)
    before anything reads it, so a client cannot crash the server with a wrong type, a non-finite number or a
    huge integer. Keys not declared here travel unchecked; a subclass declares an algorithm's own."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    round: int
    num_examples: int = Field(gt=0, le=MAX_EXAMPLES)
    train_loss: float | None = None  # finite; the round's train_loss is the sample-weighted mean of those given
    client: int | None = None  # when given, the sender's client id
    train_steps: int | None = Field(None, ge=0, le=MAX_EXAMPLES)
    train_examples: int | None = Field(None, ge=0, le=MAX_EXAMPLES)
    train_tokens: int | None = Field(None, ge=0, le=MAX_EXAMPLES)
    train_flops_sampled_steps: int | None = Field(None, ge=0, le=MAX_EXAMPLES)
    train_seconds: ClockValue | None = None
    train_flops: ClockValue | None = None
    train_ops_analytic: float | None = Field(None, ge=0, le=1e30)  # OPs of one client's round


def check_update_meta(meta: Any, model: type[UpdateMeta] = UpdateMeta, *, client: int | None = None) -> None:
    """Raise UpdateRejected (one line: the key, what is wrong, what was sent) unless ``meta`` fits ``model``;
    with ``client``, a ``client`` key must name the sender."""
    if not isinstance(meta, dict):
        raise UpdateRejected(f"update metadata is a {type(meta).__name__}, not a mapping")
    try:
        model.model_validate(meta)
    except (TypeError, OverflowError, RecursionError) as exc:  # a validator's own failure: still a refusal
        raise UpdateRejected(f"update metadata could not be checked ({type(exc).__name__}: "
                             f"{first_line(exc, 120)})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(metadata)"
        got = "" if err["type"] in ("missing", "value_error") else f" (got {shown(err.get('input'))})"
        more = f"; {exc.error_count() - 1} more problems" if exc.error_count() > 1 else ""
        raise UpdateRejected(f"update metadata {key}: {err['msg'].removeprefix('Value error, ')}{got}{more}") from None
    if client is not None and meta.get("client") is not None and meta["client"] != client:
        raise UpdateRejected(f"update metadata client: names client {shown(meta['client'])}, but client {client} sent it")


def check_update(
    payload: Payload, expected: Mapping[str, tuple[tuple[int, ...], str]], rnd: int, *, partial: bool = False
) -> None:
    """Raise UpdateRejected unless the update fits ``expected`` (name -> (shape, dtype)) for round rnd."""
    meta = payload.meta
    r = meta.get("round")
    if not isinstance(r, int) or isinstance(r, bool) or r != rnd:
        raise UpdateRejected(f"stale or missing round number {shown(meta.get('round'))} (current round {rnd})")
    n = meta.get("num_examples")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_EXAMPLES:
        raise UpdateRejected(f"num_examples must be a positive integer up to 2**53, got {shown(n)}")
    check_arrays(payload.arrays, expected, partial=partial)


def check_arrays(arrays: Mapping[str, np.ndarray], expected: Mapping[str, tuple[tuple[int, ...], str]], *,
                 partial: bool = False) -> None:
    """Raise UpdateRejected unless ``arrays`` have the expected names, shapes and dtypes and finite values."""
    unknown = sorted(set(arrays) - set(expected))
    if unknown:
        raise UpdateRejected(f"unknown parameter {unknown[0]!r} ({len(unknown)} unknown)")
    if not partial:
        missing = sorted(set(expected) - set(arrays))
        if missing:
            raise UpdateRejected(f"missing parameter {missing[0]!r} ({len(missing)} missing)")
    for name, arr in arrays.items():
        shape, dtype = expected[name]
        if tuple(arr.shape) != tuple(shape):
            raise UpdateRejected(f"{name}: shape {tuple(arr.shape)} != expected {tuple(shape)}")
        if str(arr.dtype) != dtype:
            raise UpdateRejected(f"{name}: dtype {arr.dtype} != expected {dtype}")
        if not np.all(np.isfinite(arr)):
            raise UpdateRejected(f"{name}: contains NaN or Inf")


class LocalTrain(Protocol):
    """``ClientContext.train``: local training on this client's data, seeded by (seed, round, client). The
    keyword arguments are :meth:`fedpeft.training.local.LocalTrainer.train`'s: ``tuned`` (default: the shared
    model, ``ctx.tuned``), ``extra_loss`` (a term added to the loss, e.g. FedProx's proximal term),
    ``before_step``/``after_step`` (hooks around each optimizer step), ``head_fraction`` (the share of attention
    heads trained, for the analytic OPs), ``optimizer_state`` (Adam moments to start from, updated in place) and
    ``lr`` (in place of train.lr)."""

    def __call__(
        self,
        *,
        tuned: TunedModel | None = None,
        extra_loss: Callable[[], torch.Tensor] | None = None,
        before_step: Callable[[], None] | None = None,
        after_step: Callable[[], None] | None = None,
        head_fraction: float = 1.0,
        optimizer_state: dict[str, dict[str, np.ndarray]] | None = None,
        lr: float | None = None,
    ) -> TrainResult: ...


class ClientResources(TypedDict, total=False):
    """``ClientContext.resources``: what a client half may need besides its data (see
    ``fedpeft.runtime.setup.Experiment.client_resources``)."""

    layout: object | None  # what the algorithm's RuntimeNeeds.layout built (e.g. a HeadLayout), or None
    pad_id: int | None  # the tokenizer's padding token (None for images: nothing is padded)
    exclude_token_ids: set[int]  # the tokenizer's end-of-sequence and separator tokens
    device: torch.device  # where the model lives
    batch_size: int  # eval.batch_size, for the client's own evaluation passes
    seed: int  # the run's seed
    client_lr: float  # train.lr
    peft: PeftOptions  # the run's PEFT options


def _no_report(name: str, value: Any) -> None:
    """The default of ``ClientContext.report``: a runtime without observers ignores reports."""


def _no_personal_evaluation() -> dict[str, Any] | None:
    """The default of ``ClientContext.evaluate_personal``: nothing is due."""
    return None


@dataclass
class ClientContext:
    """What the runtime hands a client half for one round."""

    client_id: int
    round: int
    tuned: TunedModel  # the model with the PEFT method applied (shared by the clients a process runs)
    train: LocalTrain  # local training of ``tuned`` (or another TunedModel) on this client's data
    num_examples: int
    state: dict[str, Any] = field(default_factory=dict)  # per-client state kept between rounds
    data: Encoded | ImageEncoded | None = None  # the client's tokenised examples (or images)
    resources: ClientResources = field(default_factory=ClientResources)
    # report(name, value): hand a value to the run's observers (RunObserver.on_client_report) for analysis;
    # it stays in this process and never travels (a runtime without observers ignores it)
    report: Callable[[str, Any], None] = field(default=_no_report)
    # evaluate_personal(): under eval.personalized, in the rounds the global model is evaluated, score the
    # model as ctx.tuned holds it now on this client's held-out slice and report it with the update; the client
    # half calls it once its personalized model is assembled (the global part it received plus what it keeps),
    # before training. Returns the metrics, or None when nothing is due (the runtime's answer, not an error).
    evaluate_personal: Callable[[], dict[str, Any] | None] = field(default=_no_personal_evaluation)


class LayoutBuilder(Protocol):
    """Builds the layout an algorithm works by (:attr:`RuntimeNeeds.layout`), once per process, from the run's
    model with its PEFT method applied and the backbone's config: e.g. which trainable tensors belong to which
    attention head (``fedpeft.heads.layout:head_layout``) or layer (``fedpeft.tuners.prefix_layers:prefix_layout``),
    or a plugin's own map. A ValueError names what the run's model lacks."""

    def __call__(self, tuned: TunedModel, model_config: Any) -> object: ...


@dataclass(frozen=True)
class RuntimeNeeds:
    """What a server half needs from the runtime besides the shared model and the clients' data, declared by the
    algorithm (:meth:`ServerAlgorithm.runtime_needs`); every runtime provides it without knowing what it is."""

    # builds the layout the server half gets as ``layout`` and every client half as ``ctx.resources["layout"]``:
    # a LayoutBuilder, or its "package.module:attribute" (imported when a run starts); None: no layout
    layout: LayoutBuilder | str | None = None
    # a fedpeft.training.server.ServerModel (the global model and the server's data shard), as ``server_model``
    server_model: bool = False
    server_data_fraction: float = 0.0  # share of the training split the server keeps; no client gets it

    def __post_init__(self) -> None:
        if isinstance(self.layout, str):
            CodeRef(self.layout)  # (a one-line error for a malformed reference)
        elif self.layout is not None and not callable(self.layout):
            raise TypeError(f"RuntimeNeeds.layout must be a function (tuned, model_config) -> layout or its "
                            f"'package.module:attribute', got {type(self.layout).__name__}")
        if not 0.0 <= self.server_data_fraction < 1.0:
            raise ValueError(f"server_data_fraction {self.server_data_fraction} must lie in [0, 1)")

    def build_layout(self, tuned: TunedModel, model_config: Any) -> object | None:
        """The layout :attr:`layout` builds for this run's model, or None when the algorithm asks for none."""
        if self.layout is None:
            return None
        builder: LayoutBuilder = CodeRef(self.layout).load() if isinstance(self.layout, str) else self.layout  # type: ignore[assignment]
        return builder(tuned, model_config)


class Combiner(Protocol):
    """What takes the place of a server's weighted mean of the clients' changes (:meth:`ServerAlgorithm.combine`):
    a wrapper's rule (``algorithm.robust``, ``algorithm.dp``)."""

    # set by ServerAlgorithm.combine each time it hands the mean to this rule (a wrapper checks it was called)
    combined: bool

    def combine(self, rnd: int, deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays: ...


class ServerAlgorithm(ABC, Generic[OptionsT]):
    """Holds the global trainable state; subclasses define how updates are combined. Parametrize it with the
    algorithm's options model, ``class MyServer(fedpeft.ServerAlgorithm[MyOptions])``, and ``self.options`` is
    a ``MyOptions`` to a type checker."""

    @classmethod
    def runtime_needs(cls, options: OptionsT) -> RuntimeNeeds:
        """What this algorithm, with these options, needs from the runtime (default: nothing more)."""
        return RuntimeNeeds()

    def __init__(self, options: OptionsT, initial_state: Arrays, *, num_clients: int, clients_per_round: int,
                 seed: int, layout: object | None = None, client_lr: float | None = None,
                 server_model: ServerModel | None = None) -> None:
        self.options: OptionsT = options
        self.layout = layout  # what runtime_needs' layout built (a head layout, a prefix layout, ...), or None
        self.server_model = server_model  # the server's own model and data shard (FedSP), else None
        self.client_lr = client_lr  # the run's train.lr, for algorithms whose server maths uses it
        self.global_state: Arrays = {k: v.astype(np.float32).copy() for k, v in initial_state.items()}
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.seed = seed
        self.expected = {k: (tuple(v.shape), "float32") for k, v in self.global_state.items()}

    # The clients online at this round's start (system: simulated availability), set by the runtime before
    # select(); None: every client. A select() that picks an offline client gets that client's failure.
    online: Sequence[int] | None = None

    def select(self, rnd: int) -> list[int]:
        """The round's clients: ``clients_per_round`` of them (with system.over_selection more than the round
        aggregates), among :attr:`online`."""
        return random_selection(self.num_clients, self.clients_per_round, self.seed, rnd, self.online)

    def select_among(self, rnd: int, candidates: Sequence[int], k: int) -> list[int]:
        """``k`` clients among ``candidates`` (fewer when there are fewer): an asynchronous run's refill of ``k`` free
        slots with the clients online and idle (federation.asynchronous); ``rnd`` numbers the refills."""
        return random_selection(self.num_clients, k, self.seed, rnd, candidates)

    def configure(self, rnd: int, clients: list[int]) -> dict[int, Payload]:
        """One payload per selected client; by default everyone gets the global state."""
        return {c: Payload(self.global_state, {"round": rnd, "client": c}) for c in clients}

    def validate(self, rnd: int, payload: Payload) -> None:
        check_update(payload, self.expected, rnd)

    def validate_from(self, rnd: int, client: int, payload: Payload) -> None:
        """Check the update that ``client`` sent; by default :meth:`validate`. Override it where what a client
        may send depends on the client (e.g. heterogeneous LoRA ranks)."""
        self.validate(rnd, payload)

    # The metadata every update of this algorithm must carry (types, ranges); checked before validate_from.
    update_meta: type[UpdateMeta] = UpdateMeta

    def accept(self, rnd: int, updates: dict[int, Payload]) -> tuple[dict[int, Payload], dict[int, str]]:
        """Split updates into accepted and rejected (client -> reason); rejections are logged. The metadata is
        checked first (:attr:`update_meta`), then the update (:meth:`validate_from`)."""
        ok: dict[int, Payload] = {}
        rejected: dict[int, str] = {}
        for cid, p in updates.items():
            try:
                check_update_meta(p.meta, self.update_meta, client=cid)
                self.validate_from(rnd, cid, p)
                ok[cid] = p
            except UpdateRejected as exc:
                rejected[cid] = str(exc)
                log.warning("round %d: update of client %d rejected: %s", rnd, cid, exc)
        return ok, rejected

    def observe_failures(self, rnd: int, failures: dict[int, str]) -> None:
        """Called with the selected clients whose update did not arrive or was refused (client -> reason)."""

    def observe_evaluation(self, rnd: int, metrics: dict[str, Any]) -> None:
        """Called with the global model's evaluation metrics (e.g. for loss-based selection)."""

    def stop_reason(self) -> str | None:
        """A reason to end the run before the next round (e.g. the privacy budget), or None."""
        return None

    def round_info(self) -> dict[str, Any]:
        """Extra per-round entries for metrics.jsonl (e.g. selection scores)."""
        return {}

    @abstractmethod
    def aggregate(self, rnd: int, updates: dict[int, Payload]) -> dict[str, float]:
        """Combine accepted updates into self.global_state; returns aggregation metrics."""

    # the wrapper's rule that takes the place of the weighted mean in combine() (set by the wrapper), or None
    combiner: Combiner | None = None

    def combine(self, rnd: int, deltas: list[Arrays], weights: list[float], clients: list[int]) -> Arrays:
        """The aggregate of the round's per-client changes ``deltas`` (x_c - x, in the order of ``clients``;
        ``weights``: their sample counts): their weighted mean, or the rule of the wrapper around this server
        (:attr:`combiner`). A server half that aggregates by a weighted mean of per-client changes calls this, and
        its options may then offer the wrappers (a ``robust`` option, a ``dp`` option)."""
        if self.combiner is not None:
            self.combiner.combined = True
            return self.combiner.combine(rnd, deltas, weights, clients)
        return weighted_mean(deltas, weights)

    def aggregate_mean(self, rnd: int, mean_update: dict[str, np.ndarray]) -> dict[str, float]:
        """Apply the sample-weighted mean of the clients' updates (x_c - x), all the server learns under
        secure aggregation; only algorithms that aggregate that way (the FedAvg family) support it."""
        raise NotImplementedError(f"{type(self).__name__} cannot aggregate from the mean update alone")

    # Attributes that make up the server's state between rounds (checkpointed after every round).
    state_attrs: tuple[str, ...] = ("global_state",)

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.state_attrs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (e.g. from a checkpoint), after checking it fits."""
        missing = [name for name in self.state_attrs if name not in state]
        if missing:
            raise ValueError(f"server state lacks {missing}; it was saved by another algorithm")
        glob = state["global_state"]
        if set(glob) != set(self.expected) or any(tuple(glob[k].shape) != self.expected[k][0] for k in glob):
            raise ValueError("saved global state does not match this model's trainable parameters "
                             "(another model, PEFT method or option)")
        for name in self.state_attrs:
            setattr(self, name, state[name])
        self.global_state = {k: np.asarray(v, dtype=np.float32) for k, v in glob.items()}


class ClientAlgorithm(ABC):
    """The client half: :meth:`fit` turns the payload a client received into its update. How it is built is
    the algorithm's choice: ``register_algorithm(client=...)`` takes a factory ``options -> ClientAlgorithm``
    (a subclass whose ``__init__`` takes the options is one).

    Under ``runtime.clients_per_pass`` > 1 the embedded runtime runs several clients' ``fit`` interleaved: each
    runs until its ``ctx.train(...)``, then their trainings run as one fused pass, then each resumes. A client
    half takes part as it is when it keeps what one client's ``fit`` needs across ``ctx.train`` in locals or
    ``ctx.state`` (not on ``self``, which all clients of a process share) and reaches the model through
    ``ctx.tuned`` (each client's own trainable tensors); its hooks and extra loss then act on that client alone.
    One that cannot sets ``trains_batched = False`` and its clients train one at a time."""

    trains_batched: ClassVar[bool] = True

    @abstractmethod
    def fit(self, payload: Payload, ctx: ClientContext) -> Payload:
        """Local work on one client; returns the update payload (arrays + meta incl. num_examples)."""

    def personal_state(self, global_state: Arrays, state: dict[str, Any]) -> Arrays | None:
        """The client's own model, every trainable tensor, from the server's global state and the client's kept
        ``state`` (its ``ctx.state``), or None when the client's model is the global one (the default). An
        algorithm whose options declare ``personal_models`` overrides it (eval.save_client_adapters saves it)."""
        return None
