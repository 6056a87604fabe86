"""The registered PEFT methods: a name, its options model, how it wraps a backbone and what else fedpeft may
ask of it (how its adapter is saved, its analytic OPs, which of its tensors belong to attention heads).

The built-in methods (HF peft's LoRA, IA3, prompt tuning, P-tuning, prefix tuning; fedpeft's bottleneck
adapters, BitFit, full fine-tuning) register here exactly as a user's plugin does
(``fedpeft.register_peft_method``); :func:`fedpeft.tuners.tuned.apply_tuner` looks a method up by the config's
``peft.method`` and never names one itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast

from fedpeft import registry
from fedpeft.config.schema import PeftOptions, check_options_model
from fedpeft.plugins import load_built_ins
from fedpeft.registry import CodeRef, resolve
from fedpeft.tuners.analytic_ops import AnalyticOps

if TYPE_CHECKING:  # the types of the contract; importing this module loads none of them (no torch)
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from fedpeft.heads.layout import HeadGeometry, HeadParam
    from fedpeft.models.layout import ArchSpec

SaveFormat = Literal["peft", "model", "state"]
SAVE_FORMATS = ("peft", "model", "state")

# The options model a PEFT method's ``apply`` reads (``register_peft_method(options=MyOptions, apply=f)`` checks
# that ``f`` takes a ``MyOptions``)
PeftOptionsT = TypeVar("PeftOptionsT", bound=PeftOptions)
# apply(model, options, ctx) -> the module to train
Apply = Callable[["nn.Module", PeftOptionsT, "TunerContext"], "nn.Module"]
# head_params(spec, geometry) -> which trainable tensors hold which attention heads' slices
HeadParams = Callable[[Mapping[str, tuple[tuple[int, ...], str]], "HeadGeometry"], "dict[str, HeadParam]"]
# row_forwards: a module type (or "package.module:Class") -> its row forward (or "package.module:function"),
# see fedpeft.tuners.row_batched
RowForwards = Mapping[Any, Any]


@dataclass(frozen=True)
class TunerContext:
    """What a method's ``apply`` gets besides the backbone and its options."""

    kind: str  # "classification" | "causal" | "seq2seq": the model's head
    spec: ArchSpec | None  # fedpeft's layout of the architecture (attention/feed-forward names), None if unknown
    spec_error: str | None  # why ``spec`` is None (the message to raise when a method needs it)
    head_modules: tuple[str, ...]  # top-level task-head modules of a classifier ("classifier", "score", ...)
    tokenizer: PreTrainedTokenizerBase | None = None  # the run's tokenizer (prompt tuning's text initialisation)
    tokenizer_path: str | None = None  # where the tokenizer was loaded from (HF peft's tokenizer_name_or_path)

    def require_spec(self, method: str) -> ArchSpec:
        """The architecture layout, or a one-line error saying that ``method`` needs one."""
        if self.spec is None:
            raise ValueError(f"peft method {method!r} needs fedpeft's layout of this architecture: {self.spec_error}")
        return self.spec


@dataclass(frozen=True)
class PeftMethod(Generic[PeftOptionsT]):
    """One registered PEFT method (see :func:`register_peft_method`); ``apply`` and ``head_params`` may be lazy
    :class:`~fedpeft.registry.CodeRef` references, resolved on first use."""

    name: str
    options: type[PeftOptionsT]
    apply_code: Apply[PeftOptionsT] | CodeRef
    save_format: SaveFormat = "state"
    trains_task_head: bool = False
    analytic_ops_code: AnalyticOps | CodeRef | None = None
    head_params_code: HeadParams | CodeRef | None = None
    trains_batched: bool = True
    row_forwards_code: tuple[tuple[Any, Any], ...] = ()

    @property
    def row_forwards(self) -> dict[type, Callable[..., Any]]:
        """The method's own row forwards (module type -> function), resolved."""
        return {(resolve(t) if isinstance(t, CodeRef) else t): (resolve(f) if isinstance(f, CodeRef) else f)
                for t, f in self.row_forwards_code}

    @property
    def apply(self) -> Apply[PeftOptionsT]:
        return resolve(self.apply_code)

    @property
    def head_params(self) -> HeadParams | None:
        return None if self.head_params_code is None else resolve(self.head_params_code)

    @property
    def analytic_ops(self) -> AnalyticOps | None:
        return None if self.analytic_ops_code is None else resolve(self.analytic_ops_code)


# the registry of fedpeft.registry, typed with its full entries (the same object)
PEFT_METHODS = cast("registry.Registry[PeftMethod[Any]]", registry.PEFT_METHODS)


def register_peft_method(
    name: str,
    *,
    options: type[PeftOptionsT],
    apply: Apply[PeftOptionsT] | CodeRef | str,
    save_format: SaveFormat = "state",
    trains_task_head: bool = False,
    analytic_ops: AnalyticOps | CodeRef | str | None = None,
    head_params: HeadParams | CodeRef | str | None = None,
    trains_batched: bool = True,
    row_forwards: RowForwards | None = None,
) -> None:
    """Register a PEFT method under ``name``; from then on ``peft: {method: NAME, ...}`` is a valid config section.

    * ``options``: its pydantic options model, a subclass of ``fedpeft.PeftOptions`` with
      ``method: Literal[NAME] = NAME`` (and ``maps_to_heads = True`` when it gives ``head_params``).
    * ``apply(model, options, ctx)``: gets the backbone with every parameter frozen and returns the module to
      train (the same one, changed in place, or a wrapper). The parameters left with ``requires_grad`` are
      what clients train and exchange. ``ctx`` is a :class:`TunerContext`.
    * ``trains_task_head``: True when ``apply`` makes a classifier's task head trainable itself (HF peft's
      ``modules_to_save``); otherwise fedpeft unfreezes ``ctx.head_modules`` after ``apply``.
    * ``save_format``: how RUN_DIR/adapter is written and read back: "state" (the trainable tensors in
      ``fedpeft_adapter.safetensors``; loading applies the method to the backbone again), "peft" (the
      module's ``save_pretrained``, HF PEFT format) or "model" (a complete HF model directory).
    * ``analytic_ops(L, d, T, options, heads)``: paper 000's analytic OPs of one training sequence, as the terms
      head pruning scales and those it does not (``fedpeft.tuners.analytic_ops``: ``OpsTerms``; the rows of
      Table 6 the backbone and the prompts share are there, and ``frozen_backbone`` / ``input_prompts`` are
      ready declarations). None: runs report the analytic OPs as unknown (null); measured FLOPs are reported
      either way.
    * ``head_params(spec, geometry)``: which trainable tensors hold which attention heads' slices (see
      ``fedpeft.heads.layout``); needed by algorithms that work per head (headprune). None: no head layout.
    * ``trains_batched``: whether the clients of a round may train together in one pass over the backbone
      (``runtime.clients_per_pass``); False makes them train one at a time (full fine-tuning: every weight is
      the client's own, so nothing is shared).
    * ``row_forwards``: row forwards for modules of the method's own that hold trainable tensors (module type ->
      ``f(module, rows, *forward_args)``, see ``fedpeft.tuners.row_batched``); ``nn.Linear``, ``nn.Embedding``,
      ``nn.LayerNorm`` and transformers' ``Conv1D`` have theirs already.

    ``apply``, ``head_params`` and ``analytic_ops`` may also be given as ``"package.module:function"``, imported on first use
    (fedpeft's built-ins do, so that validating a config imports no torch).
    """
    load_built_ins()  # fedpeft's own first: a name taken by a built-in is refused, whichever comes first
    check_options_model(options, "peft", name)
    apply_code = CodeRef(apply) if isinstance(apply, str) else apply
    head_params_code = CodeRef(head_params) if isinstance(head_params, str) else head_params
    if not isinstance(apply_code, CodeRef) and not callable(apply_code):
        raise TypeError(f"register_peft_method({name!r}): apply must be a function (model, options, ctx) -> module")
    if save_format not in SAVE_FORMATS:
        raise ValueError(f"register_peft_method({name!r}): save_format {save_format!r}; choose one of "
                         f"{', '.join(SAVE_FORMATS)}")
    if isinstance(analytic_ops, tuple | list):
        raise TypeError(f"register_peft_method({name!r}): analytic_ops {tuple(analytic_ops)!r}: Table 6's rows are "
                        "declared as a function (L, d, T, options, heads) -> OpsTerms now; "
                        "fedpeft.tuners.analytic_ops has the shared rows and the declarations frozen_backbone and "
                        "input_prompts")
    analytic_ops_code = CodeRef(analytic_ops) if isinstance(analytic_ops, str) else analytic_ops
    if analytic_ops_code is not None and not isinstance(analytic_ops_code, CodeRef) and not callable(analytic_ops_code):
        raise TypeError(f"register_peft_method({name!r}): analytic_ops must be a function (L, d, T, options, heads) "
                        "-> fedpeft.tuners.analytic_ops.OpsTerms, or None for unknown OPs")
    if bool(options.maps_to_heads) != (head_params_code is not None):
        raise ValueError(f"register_peft_method({name!r}): give head_params exactly when {options.__name__} sets "
                         "maps_to_heads = True (the config checks it before anything loads)")
    forwards = tuple((CodeRef(t) if isinstance(t, str) else t, CodeRef(f) if isinstance(f, str) else f)
                     for t, f in (row_forwards or {}).items())
    method = PeftMethod(name, options, apply_code, save_format, trains_task_head, analytic_ops_code, head_params_code,
                        bool(trains_batched), forwards)
    PEFT_METHODS.add(name, method)


def registered_peft_method(name: str) -> PeftMethod[Any]:
    """The PEFT method registered under ``name`` (fedpeft's built-ins registered first); a one-line ValueError
    listing the registered ones otherwise."""
    load_built_ins()
    return PEFT_METHODS.require(name, "peft method")
