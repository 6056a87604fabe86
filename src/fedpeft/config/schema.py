"""Every option of a fedpeft run: its name, default, valid range and help text.

This module knows nothing about torch or files: it only describes and validates. Unknown keys are
rejected (``extra="forbid"``) and choices are ``Literal`` types, so a typo fails before any work
starts with a message naming the valid choices (see :mod:`fedpeft.config.load`).
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializeAsAny,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedpeft.config.adversarial import AttackersConfig
from fedpeft.config.asynchronous import AsynchronousConfig
from fedpeft.config.choices import (
    SECTIONS,
    RegisteredChoices,
    registered_section,
    section_choices,
    validate_choice,
)
from fedpeft.config.section import OptionValueError, Section
from fedpeft.config.system import SystemConfig
from fedpeft.config.wrapping import WrapperOptions
from fedpeft.errors import unprintable
from fedpeft.plugins import load_built_ins
from fedpeft.registry import ALGORITHMS, DATASETS, PEFT_METHODS, RUNTIMES, TRACKERS, Registry


class PeftOptions(Section):
    """Base of a PEFT method's options. A subclass names its method with a literal default,
    ``method: Literal["mine"] = "mine"``, and is registered with ``fedpeft.register_peft_method``; the config
    then accepts ``peft: {method: mine, ...}``."""

    method: str
    # whether fedpeft.heads.layout splits this method's trainable tensors by attention head (head pruning)
    maps_to_heads: ClassVar[bool] = False
    # why the method cannot adapt a vision transformer (task.type image_classification), or None when it can
    no_images: ClassVar[str | None] = None
    # what the method's trainable tensors are, for the algorithms and reports that depend on it (each one is
    # read through its flag, never through the method's name, so that a plugin method can declare it too):
    # LoRA factor pairs (lora_A, lora_B) on the adapted weights, as the federated LoRA methods aggregate them
    lora_factors: ClassVar[bool] = False
    # a key/value prompt for every layer (fedpeft.tuners.prefix_layers reads its layout when the options have
    # projection off), as FedPepTAO and FedSP exchange them
    layer_prefixes: ClassVar[bool] = False
    # every weight of the backbone (the baseline `fedpeft model` compares sizes with: paper 004's Eq. 1)
    trains_every_weight: ClassVar[bool] = False
    # options a short label of the method shows beside its name in reports (e.g. ("r",): "lora r16")
    label_options: ClassVar[tuple[str, ...]] = ()

    def check(self, run: RunConfig) -> None:
        """Refuse (ValueError, one line naming the key and the fix) settings of the run this method cannot
        work with; called when a whole config is validated."""


class AlgorithmOptions(Section):
    """Base of a federated algorithm's options: ``name: Literal["mine"] = "mine"`` names it (registered
    through ``fedpeft.register_algorithm``); the config then accepts ``algorithm: {name: mine, ...}``."""

    name: str
    # whether the server can aggregate from the sample-weighted mean update alone (needed by SecAgg+)
    supports_secure_aggregation: ClassVar[bool] = False
    # whether the client half scores its personalized model when asked (ClientContext.evaluate_personal)
    supports_personalized_eval: ClassVar[bool] = False
    # what each client keeps of its own when the method's model is each client's (e.g. "its LoRA B and task head"),
    # or None when it is the global model. Such a run needs eval.personalized, its primary metric is the personalized
    # one (personal_<metric>), it keeps no best_adapter (no single adapter is the method's model), and with
    # eval.save_client_adapters each client's model is saved (ClientAlgorithm.personal_state assembles it)
    personal_models: ClassVar[str | None] = None
    # why the global state saved as the run's adapter is not the run's model (e.g. updates merged into the
    # backbone), or None; such an adapter is marked and fedpeft.load_adapter refuses it with this reason
    adapter_incomplete: ClassVar[str | None] = None
    # why algorithm.robust does not apply, for an algorithm without a ``robust`` option (one that has the option,
    # e.g. ``robust: fedpeft.RobustRule | None = None``, takes the weighted mean of the clients' changes through
    # ServerAlgorithm.combine, whose place the robust wrapper then takes)
    robust_unavailable: ClassVar[str] = "its server does not aggregate one plain update per client by a weighted mean"
    # why a simulated attacker cannot poison this algorithm's updates (federation.attackers sign_flip, scale, noise
    # change what a client sends relative to what it received), or None
    update_poisoning_unavailable: ClassVar[str | None] = None
    # why this algorithm cannot aggregate asynchronously (federation.asynchronous), or None when it can: its
    # aggregate() then takes updates whose change was made from an older global model, rebased onto the current one
    # (x_current + weight x (x_client - x_start)), as a weighted mean of per-client changes does
    asynchronous_unavailable: ClassVar[str | None] = (
        "its aggregation is not declared to accept updates trained from an older global model (a plugin whose "
        "aggregate() combines per-client changes sets asynchronous_unavailable = None)")

    def check(self, run: RunConfig) -> None:
        """Refuse (ValueError, one line naming the key and the fix) settings of the run this algorithm cannot
        work with; called when a whole config is validated."""

    def wrappers(self) -> list[WrapperOptions]:
        """The wrappers these options turn on: every option holding a wrapper's section that is set
        (``algorithm.robust``, ``algorithm.dp``), in the order of the fields."""
        return [value for name in type(self).model_fields
                if isinstance(value := getattr(self, name), WrapperOptions)]

    @model_validator(mode="before")
    @classmethod
    def _robust_needs_support(cls, data: Any) -> Any:
        if isinstance(data, dict) and "robust" in data and "robust" not in cls.model_fields:
            if data["robust"] is None:  # off, as a config dumped for another algorithm says: nothing to refuse
                return {k: v for k, v in data.items() if k != "robust"}
            able = ", ".join(n for n, m in _all_algorithms().items() if "robust" in m.model_fields)
            raise ValueError(f"algorithm.robust is not available for {cls.model_fields['name'].default}: "
                             f"{cls.robust_unavailable}; algorithms with robust aggregation: {able}")
        return data


TaskType = Literal["classification", "generation", "multiple_choice", "instruction", "image_classification"]


class TaskConfig(Section):
    """What to learn and from which data."""

    type: TaskType = Field(
        "classification", description="classification | generation | multiple_choice | instruction (chat and "
        "instruction tuning of causal LMs: loss on the assistant's tokens) | image_classification (a vision "
        "transformer on images: rows with an image and a label)")
    dataset: str = Field(
        "sst2",
        description="A catalog name (sst2, mnli, 20newsgroups, e2e_nlg, arc_easy, ...), a local "
        "directory or file (jsonl, jsonl.gz, json, csv, tsv, parquet; for images also an ImageFolder directory, "
        "<dir>/<split>/<class>/<image>) or a Hugging Face Hub dataset id.",
    )
    dataset_config: str | None = Field(None, description="Hub dataset configuration name, if any.")
    data_dir: str | None = Field(
        None,
        description="Where catalog datasets are looked for offline. Default: $FEDPEFT_DATA_DIR, "
        "then ./data, then ../shared/data; the Hub is used when none has the dataset.",
    )
    train_split: str = Field(
        "train", description="Split to partition among clients; 'a+b' joins splits, 'test[:80%]' or 'train[:1000]' "
        "takes part of one (Hugging Face datasets' slice syntax). Must not share rows with eval_split.",
    )
    eval_split: str = Field("validation", description="Split the server evaluates on; same syntax as train_split.")
    split_shuffle_seed: int | None = Field(
        None, ge=0, description="Put a sliced split in this seeded random order before slicing, so that "
        "'test[:80%]' / 'test[80%:]' are random yet disjoint parts. None: file order, as Hugging Face datasets.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Map fedpeft's field names (text, text_pair, label, input, target, question, "
        "choices, context, messages, instruction, output, references, image) to the columns of your data.",
    )
    max_length: int = Field(128, ge=8, le=32768, description="Maximum input tokens (truncation; an image is "
                            "always its model's patches).")
    max_target_length: int = Field(64, ge=1, le=4096, description="Generation: maximum target tokens.")
    max_train_examples: int | None = Field(
        None, ge=1, description="Use a seeded random slice of this many training rows (None = all)."
    )
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, le=89_478_485,
        description="Image classification: the most pixels (width x height) an image may have, read from its "
        "header before it is decoded; a bigger one is refused. The default, 4096 x 4096 (16,777,216), holds a "
        "12-megapixel photo yet is far above the 224-384 px the models take, and keeps a decode within 64 MiB (RGB), "
        "where Pillow's own decompression-bomb limit (89,478,485, the most allowed here; Pillow only warns up to "
        "twice that) lets an RGB PNG of 12000 x 12000, a few hundred KB on disk, take 576 MB.")
    prompt_template: str | None = Field(
        None,
        description="Generation / multiple choice: Python format string over the row's fields "
        "(e.g. '{input}\\n' or 'Question: {question}\\nAnswer:'). Default depends on the task.",
    )
    metric: str | None = Field(
        None,
        description="Primary metric for targets and plots. Default: the catalog dataset's own metric "
        "(mcc for CoLA), else accuracy (classification), rougeL (generation), accuracy (multiple_choice); "
        "instruction: rougeL, filled in when the config is read ('loss' picks the eval loss instead).",
    )
    generation_max_new_tokens: int = Field(48, ge=1, le=4096)
    chat_template: str | None = Field(
        None,
        description="Instruction: a Jinja chat template (as tokenizer.chat_template) to format the conversations "
        "with. None: the tokenizer's own, else fedpeft's built-in ChatML-style template with the tokenizer's eos "
        "ending each turn (fedpeft.data.chat.DEFAULT_CHAT_TEMPLATE).",
    )
    instruction: str | None = Field(
        None,
        description="Instruction: the instruction of rows that carry none, so that a generation set (input -> "
        "target) reads as instruction records, e.g. 'Write a restaurant description from these attributes.'",
    )

    @model_validator(mode="after")
    def _instruction_options(self) -> TaskConfig:
        if self.type != "instruction":
            for key in ("chat_template", "instruction"):
                if getattr(self, key) is not None:
                    raise ValueError(f"task.{key} is for task.type instruction; remove it or set task.type: "
                                     "instruction")
            return self
        if self.prompt_template is not None:
            raise ValueError("task.prompt_template is for generation and multiple_choice; instruction rows are "
                             "formatted with a chat template: set task.chat_template instead")
        if self.metric in ("perplexity", "eval_perplexity"):
            raise ValueError("task.metric perplexity is exp(loss) and would be read as higher-is-better; set "
                             "task.metric: loss (lower is better) to pick rounds by the eval loss")
        if self.metric is None:
            self.__dict__["metric"] = "rougeL"  # RunConfig.primary_metric's default (no re-validation loop)
        return self


class QuantizationOptions(Section):
    """A quantized frozen backbone through bitsandbytes (QLoRA, Dettmers et al. 2023): its linear layers are
    stored in 4 or 8 bits and dequantized on the fly; the PEFT method's tensors and the task head stay in
    full precision and train. Needs ``pip install -e ".[quantization]"`` (bitsandbytes)."""

    bits: Literal[4, 8] = Field(4, description="4: NF4/FP4 weights (QLoRA); 8: LLM.int8() weights.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type: NormalFloat4 or FP4.")
    double_quant: bool = Field(True, description="4-bit: quantize the quantization constants too (QLoRA).")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="4-bit: the dtype the dequantized weights are multiplied in (QLoRA uses bfloat16 "
                               "on GPUs; float32 is the exact choice on CPUs).")

    def described(self) -> dict[str, Any]:
        """The options that apply to these bits (what an adapter's json records)."""
        return self.model_dump() if self.bits == 4 else {"bits": self.bits}

    @model_validator(mode="after")
    def _four_bit_options(self) -> QuantizationOptions:
        # (compared with the defaults, so that a saved config with every field written out validates again)
        changed = sorted(k for k in ("quant_type", "double_quant", "compute_dtype")
                         if getattr(self, k) != type(self).model_fields[k].default)
        if self.bits == 8 and changed:
            raise ValueError(f"model.quantization.{changed[0]} is a 4-bit option: remove it or set bits: 4")
        return self


class ModelConfig(Section):
    """The backbone."""

    name: str = Field(
        "minilm-l6",
        description="Bundled alias (minilm-l6, smollm2-135m, tiny-bert, tiny-gpt2, tiny-llama, "
        "tiny-t5, tiny-bart), a local model directory or a Hub model id.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the backbone weights, trained in it end to end: the PEFT method's own "
                               "tensors stay float32, a classifier's task head and the weights full fine-tuning and "
                               "BitFit train are in this dtype (with model.quantization: float32).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = Field(
        None, description="The backbone's attention implementation (transformers' attn_implementation); None: "
                          "transformers' default for the model (sdpa where supported).")
    quantization: QuantizationOptions | None = Field(
        None, description="Quantize the frozen backbone to 4 or 8 bits (bitsandbytes); None: dtype above.")
    dropout: float | None = Field(
        None, ge=0, lt=1, description="Replace every dropout probability of the backbone's config (hidden, "
        "attention, classifier, ...) with this; None: the model's own. (A PEFT method's own dropout, e.g. "
        "peft.dropout of LoRA, is its option.)")


def refuse_quantized_backbone(run: RunConfig, why: str) -> None:
    """For a method's ``check``: refuse a run whose backbone is quantized, saying ``why``."""
    if run.model.quantization is not None:
        raise ValueError(f"model.quantization: {why} (or remove model.quantization)")


# --- federation, training, evaluation, runtime ----------------------------------------------------


class PartitionConfig(Section):
    scheme: Literal["iid", "dirichlet_label", "dirichlet_quantity", "column", "dirichlet_column"] = "iid"
    alpha: float = Field(
        0.5, gt=0, description="Dirichlet concentration: label skew (dirichlet_label), skew over the values of "
        "column (dirichlet_column) or size skew (dirichlet_quantity). Smaller = more skewed."
    )
    size_alpha: float | None = Field(
        None, gt=0, description="dirichlet_label and dirichlet_column only: also draw client sizes from "
        "Dirichlet(size_alpha)."
    )
    min_size: int = Field(1, ge=1, description="Every client gets at least this many examples.")
    column: str | None = Field(
        None, min_length=1, description="Schemes column and dirichlet_column: the field of the training rows "
        "whose values make the clients (e2e_nlg also has its MR attributes: name, eat_type, food, price_range, "
        "customer_rating, area, family_friendly, near). column: each value one client, or values grouped "
        "into num_clients clients, largest first; dirichlet_column: Dirichlet(alpha) skew over the values.",
    )

    @model_validator(mode="after")
    def _column_goes_with_its_schemes(self) -> PartitionConfig:
        uses_column = self.scheme in ("column", "dirichlet_column")
        if uses_column and self.column is None:
            raise ValueError(f"scheme {self.scheme} needs column, the field of the training rows whose values make "
                             "the clients; e.g. --set federation.partition.column=eat_type")
        if not uses_column and self.column is not None:
            raise ValueError(f"column is used only by schemes column and dirichlet_column (scheme is "
                             f"{self.scheme}); remove it, or --set federation.partition.scheme=column")
        return self


class FederationConfig(Section):
    num_clients: int = Field(10, ge=1, le=1_000_000)
    clients_per_round: int = Field(2, ge=1)
    rounds: int = Field(3, ge=1)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    min_replies: int = Field(
        1, ge=1, description="A round aggregates only if at least this many selected clients return an "
        "accepted update; otherwise the global model stays as it was and the round is logged as failed.",
    )
    attackers: AttackersConfig | None = Field(
        None, description="Simulated Byzantine clients that send harmful updates (off by default): "
        "{fraction: F, attack: sign_flip | scale | noise | label_flip, factor, noise_std}.")
    asynchronous: AsynchronousConfig | None = Field(
        None, description="Buffered asynchronous aggregation (FedBuff, FedAsync) on the simulated clock instead of "
        "synchronous rounds (None): clients_per_round clients train at once, each from the global model current when "
        "it started, and every buffer_size arriving updates are aggregated; rounds counts the aggregations.")
    round_timeout_s: float = Field(
        600.0, gt=0, description="Distributed runtimes: how long the server waits for the selected clients' "
        "replies; a client that has not replied by then (killed, disconnected) counts as failed for the round.",
    )

    @model_validator(mode="after")
    def _k_le_n(self) -> FederationConfig:
        if self.clients_per_round > self.num_clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) exceeds num_clients ({self.num_clients})"
            )
        if self.min_replies > self.clients_per_round:
            raise ValueError(
                f"min_replies ({self.min_replies}) exceeds clients_per_round ({self.clients_per_round})"
            )
        return self


class TrainConfig(Section):
    """Local training on each selected client."""

    local_epochs: int = Field(1, ge=1)
    local_steps: int | None = Field(None, ge=1, description="If set, exactly this many steps (overrides epochs).")
    batch_size: int = Field(16, ge=1)
    lr: float = Field(5e-4, gt=0)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(0.0, ge=0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None = off).")
    length_grouping: bool = Field(True, description="Batch examples of similar length together.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches of batch_size per optimizer step: the effective batch is batch_size x "
        "this (logged at the start of a run). Each micro-batch's loss is weighted by its share of the step's "
        "loss terms (examples, or target tokens for language modelling), so the step equals one on the large "
        "batch; local_steps counts optimizer steps; an epoch's last step may take fewer micro-batches.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute the backbone's activations in the backward pass instead of keeping them "
                           "(transformers' gradient checkpointing, non-reentrant): less memory, about one more "
                           "forward pass of time.")


class EvalConfig(Section):
    every: int = Field(1, ge=0, description="Evaluate every k rounds (0 = only after the last round).")
    at_start: bool = Field(True, description="Also evaluate the initial global model (round 0).")
    max_examples: int | None = Field(
        500, ge=1, description="Evaluate on a fixed seeded subset of this size (None = full split)."
    )
    batch_size: int = Field(64, ge=1)
    target: float | None = Field(None, description="Value of the primary metric for rounds/time-to-target (for "
                                 "an algorithm whose model is each client's own, FedSA-LoRA: personal_<metric>).")
    save_best: bool = Field(True, description="Also keep the global adapter of the best evaluated round (by the "
                            "primary metric) in RUN_DIR/best_adapter, next to the last round's RUN_DIR/adapter "
                            "(none for an algorithm whose model is each client's own, FedSA-LoRA).")
    personalized: bool = Field(False, description="Also score each selected client's personalized model (what "
                               "its algorithm assembles from the global part and what the client keeps) on a "
                               "held-out slice of its own partition, in the rounds the global model is evaluated.")
    personal_fraction: float = Field(0.2, gt=0, lt=1, description="With personalized: the share of each client's "
                                     "examples held out of its training for that (at least one example).")
    save_client_adapters: bool = Field(False, description="For an algorithm whose model is each client's own "
                                       "(FedSA-LoRA): at the end also save every client's model (the global part "
                                       "with what the client kept) as RUN_DIR/client_adapters/<client id>, scored by "
                                       "`fedpeft eval RUN_DIR --client ID`. Embedded runtime only.")


class SecureAggregationOptions(Section):
    """Flower's SecAgg+ (Bell et al. 2020) for the FedAvg family: each client masks its quantized update
    with pairwise and private masks, and the server learns only the sample-weighted mean of the updates
    of the clients that completed the protocol (dropped clients' masks are recovered from secret shares).
    Each client must be a SuperNode of its own (num_supernodes = federation.num_clients)."""

    num_shares: int | float = Field(
        1.0, gt=0, description="How many clients hold shares of each client's secrets: an integer > 2, or a "
        "fraction of the round's clients (1.0 = all of them).",
    )
    reconstruction_threshold: int | float = Field(
        0.5, gt=0, description="Shares needed to recover a secret: an integer < num_shares, or a fraction of "
        "num_shares (at least 2). Higher protects better against colluding clients, lower tolerates more dropouts.",
    )
    clipping_range: float = Field(
        8.0, gt=0, description="Update entries (client parameters minus the global ones) are quantized in "
        "[-clipping_range, clipping_range]; a client whose update has a larger entry fails the round "
        "instead of being clipped silently.",
    )


class FlowerRuntimeConfig(Section):
    """The Flower deployment runtime (``runtime.name: flower``)."""

    superlink: str | None = Field(
        None, description="host:port of a running SuperLink to submit the run to (with its SuperNodes "
        "already connected); the ServerApp runs on the SuperLink's machine and writes the run directory "
        "there, at the path given here. None: start a SuperLink and num_supernodes SuperNodes on this "
        "machine (loopback, free ports) for the run and stop them afterwards.",
    )
    engine: Literal["deployment", "simulation"] = Field(
        "deployment", description="deployment: real SuperNodes (processes here, or machines of their own "
        "behind runtime.flower.superlink). simulation: Flower's Ray simulation engine (a SuperLink started "
        "with --simulation; num_supernodes virtual SuperNodes whose ClientApps run in Ray actors; needs "
        "`pip install fedpeft[simulation]`).",
    )
    num_supernodes: int = Field(2, ge=1, description="How many SuperNodes serve the run: the number of partitions "
                                "(SuperNode I serves the clients c with c mod num_supernodes = I; a SuperNode that "
                                "claims another count is refused). Started here when superlink is None (virtual "
                                "SuperNodes with engine: simulation); with a superlink, the number connected to it.")
    client_cpus: float = Field(1.0, gt=0, description="engine: simulation: CPU cores Ray reserves for each "
                               "ClientApp (so cores / client_cpus ClientApps train at once).")
    warm_clients: bool = Field(
        True, description="When starting SuperNodes here: run them in process isolation, each with a "
        "long-lived fedpeft ClientApp worker (python -m fedpeft.runtime.flower.warm_worker) that keeps the "
        "model loaded, instead of Flower's fresh ClientApp process per message.",
    )
    supernode_poll_s: float | None = Field(
        0.1, gt=0, description="When starting SuperNodes here: run them through "
        "fedpeft.runtime.flower.fast_supernode, whose idle poll for new messages is this many seconds instead "
        "of Flower 1.41's fixed 3 s (and 0.5 s reply waits). None: Flower's own flower-supernode.",
    )
    root_certificates: str | None = Field(
        None, description="CA certificate (PEM) of a TLS SuperLink; None with a remote superlink means insecure."
    )
    poll_interval_s: float = Field(0.05, gt=0, description="How often the ServerApp polls for replies.")
    reply_grace_s: float = Field(
        300.0, ge=0, description="federation.asynchronous only: how long a client's message outlives its "
        "federation.round_timeout_s on the SuperLink (its TTL is the sum), so that a reply that arrived while the "
        "server was not pulling (aggregating, evaluating, checkpointing) can still be pulled; Flower refuses a reply "
        "pulled after its message expired. A client with no reply at the first poll after round_timeout_s is a "
        "failed update either way.",
    )
    secure_aggregation: SecureAggregationOptions | None = Field(
        None, description="Secure aggregation with Flower's SecAgg+ (FedAvg family only; off by default)."
    )
    startup_timeout_s: float = Field(180.0, gt=0, description="How long to wait for the SuperNodes to connect.")
    partition_keys: dict[Annotated[int, Field(ge=0)], str] | Literal["any"] | None = Field(
        None, description="Pin partitions to SuperNode keys: {partition id: that SuperNode's OpenSSH public key "
        "(the line in supernode-I.pub) or its SHA256:... fingerprint (ssh-keygen -lf supernode-I.pub; `fedpeft "
        "flower credentials` prints the setting)}. A SuperNode with another key never serves a pinned partition, even "
        "a free one. Needs SuperNode authentication (without it a SuperNode's key changes at every start). any: any "
        "SuperNode may claim a free partition, and one that stops answering is replaced by the next claimant. None: "
        "any, except that a new run on a superlink (engine: deployment) is refused (give the keys, or any), and "
        "SuperNodes started here with credentials are pinned to their own keys.",
    )

    @model_validator(mode="before")
    @classmethod
    def _partition_keys_any_or_keys(cls, data: Any) -> Any:
        value = data.get("partition_keys") if isinstance(data, dict) else None
        if value is not None and value != "any" and not isinstance(value, dict):
            raise ValueError(f"partition_keys: {str(value)[:40]!r} is neither any nor a mapping {{partition: "
                             "SuperNode key or SHA256 fingerprint, ...}")
        if isinstance(value, dict):  # checked here, so that a bad entry is one error, not one per member of the union
            from pydantic import TypeAdapter, ValidationError

            try:
                keys = TypeAdapter(dict[Annotated[int, Field(ge=0)], str]).validate_python(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = f": partition {first['loc'][0]!r}" if "[key]" in first["loc"] else f"[{first['loc'][0]}]"
                raise ValueError(f"partition_keys{where}: {first['msg']}") from None
            data = {**data, "partition_keys": keys}
        return data

    @model_validator(mode="after")
    def _partition_keys_as_fingerprints(self) -> FlowerRuntimeConfig:
        if self.partition_keys == {}:
            raise ValueError("partition_keys: {} pins no partition; give {partition: SuperNode key or SHA256 "
                             "fingerprint, ...}, or any")
        if self.partition_keys is None or self.partition_keys == "any":
            return self
        from fedpeft.keys import pinned_key_fingerprint  # cryptography, imported only when used

        if self.engine == "simulation":
            raise ValueError("partition_keys: the simulation engine's virtual SuperNodes have no keys to pin; "
                             "remove it or use engine: deployment")
        beyond = sorted(p for p in self.partition_keys if p >= self.num_supernodes)
        if beyond:
            raise ValueError(f"partition_keys: partition {beyond[0]} does not exist: the run has num_supernodes="
                             f"{self.num_supernodes} partitions (0..{self.num_supernodes - 1}); set num_supernodes to "
                             "the number of SuperNodes")
        pinned = {}
        for partition, key in self.partition_keys.items():
            try:
                pinned[partition] = pinned_key_fingerprint(key)
            except ValueError as exc:
                raise ValueError(f"partition_keys[{partition}]: {exc}") from None
        if pinned != self.partition_keys:
            self.partition_keys = pinned  # validate_assignment runs this again, on fingerprints
        return self


class TrackingConfig(Section):
    """Where runtime.loggers send a run (see fedpeft.tracking)."""

    project: str | None = Field(None, min_length=1, description="The MLflow experiment and W&B project (None: the "
                                "config's name).")
    mlflow_tracking_uri: str | None = Field(
        None, min_length=1, description="An MLflow tracking server or database URI; None: a SQLite database in the "
        "run directory (RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts).")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B run files under RUN_DIR/wandb, no account or network needed (upload "
        "later with `wandb sync`); online: logged in (WANDB_API_KEY) and sent as the run goes.")


def _check_registered(registry: Registry[Any], key: str, name: str) -> None:
    """Refuse ``name`` (the value of the section's ``key``) unless ``registry`` holds it, listing those it holds."""
    load_built_ins()
    if name not in registry:
        choices = ", ".join(repr(n) for n in registry.names()) or "none"
        raise OptionValueError(key, f"unknown choice {name!r}; valid choices: {choices}")


class RuntimeConfig(Section):
    name: str = Field(
        "embedded", description="A registered runtime (fedpeft.register_runtime). embedded: every client in this "
        "process (default). flower: Flower's deployment engine (ServerApp + ClientApps on SuperNodes); see "
        "runtime.flower.",
    )
    flower: FlowerRuntimeConfig = Field(default_factory=FlowerRuntimeConfig)
    checkpoint_every: int = Field(
        1, ge=0, description="Write RUN_DIR/checkpoint.safetensors after every this many rounds (0 = never); "
        "`fedpeft run --resume RUN_DIR` continues from it.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision of local training and evaluation (fp16 needs cuda)."
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch's default).")
    clients_per_pass: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="The embedded runtime trains up to this many of a round's clients together: one "
        "forward and backward of the frozen backbone over all their rows, each row with its own client's trainable "
        "tensors, each client with its own loss, optimizer, schedule and steps (docs/guide/clients-per-pass.md). "
        "1: one client after another; auto: the number that trains fastest on this device, measured on the first "
        "round's clients (on CUDA within 80% of the memory free).")
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="The embedded runtime trains a round's clients on this many worker processes, forked "
        "once the model is built so that they share its frozen backbone (copy-on-write), each with the torch threads "
        "divided among them and clients_per_pass clients per fused pass (docs/guide/workers.md). 1: in the run's "
        "process; auto: the number (and, with clients_per_pass auto, the clients per pass) whose workers together "
        "train fastest, measured on the first round's clients. On CUDA the workers are spawned, each building its "
        "own copy of the model on device i modulo the devices (auto: one per device).")
    worker_timeout_s: float | None = Field(
        None, gt=0, description="Under runtime.workers, how long a worker (or a probe of auto) may take to answer; "
        "a worker that has not answered by then (hung, stopped) is killed and its clients fail for the round; a probe "
        "is killed and counts as failed (the first candidate's failure stops the run, a later one's ends the search). "
        "None: no limit (a process that dies is found at once either way).")
    max_pass_tokens: int | None = Field(
        None, ge=1, description="Under clients_per_pass, the most padded tokens one sub-batch of a fused pass may "
        "hold (rows beyond it go through the model in another sub-batch, never with more padding). None: 1024 on a "
        "CPU, where larger batches train more slowly and hold more memory; no cap on CUDA.")
    sub_batch_cost: int | None = Field(
        None, ge=0, description="Under clients_per_pass, what one more sub-batch of a fused pass costs, in padded "
        "tokens: the rows of a local step are cut at the least padded tokens plus this much per sub-batch (never "
        "padding more than the clients alone). None: 40 on a CPU (benchmarks/sub_batch_cost.py), the fewest "
        "sub-batches on CUDA; 0: the least padding.")
    flops_sample_steps: int = Field(
        8, ge=0, description="Measure FLOPs with torch's FlopCounterMode on this many local steps of the "
        "run (one per client training, until used up) and scale every step by its tokens (0 = off)."
    )
    max_payload_mb: float | None = Field(
        None, gt=0, description="Updates (and, on a ClientApp, server payloads) larger than this many MiB are "
        "refused before they are decoded. None: updates up to twice the encoded size of the model's trainable "
        "state plus 1 MiB (an algorithm may send a second state, e.g. SCAFFOLD's control variate), server "
        "payloads up to 4096 MiB (FLoRA and FedEx-LoRA send stacks of past rounds).")
    progress: bool = Field(True, description="Show a progress bar with live round metrics.")
    loggers: list[str] = Field(
        default_factory=list, description="Experiment trackers that receive every metrics row, the config and the "
        "summary: tensorboard (RUN_DIR/tensorboard), mlflow, wandb (see runtime.tracking), or one a plugin "
        "registers (fedpeft.register_tracker); each built-in one an extra, e.g. pip install 'fedpeft[tensorboard]'.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _registered_runtime_and_loggers(self) -> RuntimeConfig:
        if "name" in self.model_fields_set:  # the default is a built-in; a name given must be registered
            _check_registered(RUNTIMES, "name", self.name)
        for name in self.loggers:
            _check_registered(TRACKERS, "loggers", name)
        return self

    @model_validator(mode="after")
    def _each_logger_once(self) -> RuntimeConfig:
        twice = sorted({name for name in self.loggers if self.loggers.count(name) > 1})
        if twice:
            raise ValueError(f"runtime.loggers names {twice[0]} more than once: list each logger once")
        return self


# --- the registered choices of peft.method and algorithm.name -----------------------------------------
# Each algorithm and PEFT method owns its options model (fedpeft/algorithms/<name>/, fedpeft/tuners/<name>/)
# and registers it with its code in one call (fedpeft.register_algorithm, fedpeft.register_peft_method); the
# config's ``peft`` and ``algorithm`` sections accept exactly the registered options models.


def _all_peft_methods() -> dict[str, type[PeftOptions]]:
    """Every registered PEFT method's options model, by name (alphabetical)."""
    load_built_ins()
    return {name: PEFT_METHODS[name].options for name in sorted(PEFT_METHODS)}


def _all_algorithms() -> dict[str, type[AlgorithmOptions]]:
    """Every registered algorithm's options model, by name (alphabetical)."""
    load_built_ins()
    return {name: ALGORITHMS[name].options for name in sorted(ALGORITHMS)}


# the choice a run config takes when it leaves the section out (the config's own defaults)
DEFAULT_CHOICES = {"peft": "lora", "algorithm": "fedavg"}


def field_type(model: type[BaseModel], name: str) -> Any:
    """The type a field of a config section is validated as: for a field that takes registered choices (a run
    config's ``peft`` and ``algorithm``, an algorithm's ``robust``), the options models registered now
    (:func:`~fedpeft.config.choices.section_choices`)."""
    if issubclass(model, RunConfig) and name in DEFAULT_CHOICES:
        return section_choices(name)
    field = model.model_fields[name]
    annotation = field.annotation
    section = registered_section(annotation)  # (pydantic moves a bare Annotated field's metadata onto the field)
    section = section or next((m.section for m in field.metadata if isinstance(m, RegisteredChoices)), None)
    if section is None:
        return annotation
    choices = section_choices(section)
    return choices | None if type(None) in typing.get_args(annotation) else choices


def _default_options(section: str) -> Any:
    """The options of the section's default choice (:data:`DEFAULT_CHOICES`; fedpeft's built-ins registered
    first)."""
    load_built_ins()
    return SECTIONS[section][0].get(DEFAULT_CHOICES[section]).options()


class RunConfig(Section):
    plugins: list[str] = Field(
        default_factory=list, description="Plugins loaded before the rest is validated: modules or .py files "
        "that register algorithms or PEFT methods (fedpeft.register_algorithm, fedpeft.register_peft_method). They "
        "are code: running the config (fedpeft run, --resume) imports them; commands that only read it (config, "
        "partition, eval) import them only when named with --plugin or trusted with --trust-plugins, report never.")
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = Field(0, ge=0, lt=2**63, description="Seeds everything random in the run (0 <= seed < 2**63).")
    output_dir: str = Field("runs", description="Where a run's directory is made (OUTPUT_DIR/NAME-TIMESTAMP); "
                            "printable characters only.")
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    # validated by the options model registered under the section's tag (_registered_choice); SerializeAsAny:
    # dumped with that model's fields, not only the base class's
    peft: SerializeAsAny[PeftOptions] = Field(default_factory=lambda: _default_options("peft"))
    algorithm: SerializeAsAny[AlgorithmOptions] = Field(default_factory=lambda: _default_options("algorithm"))
    federation: FederationConfig = Field(default_factory=FederationConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    system: SystemConfig = Field(default_factory=SystemConfig)

    @field_validator("peft", "algorithm", mode="plain")
    @classmethod
    def _registered_choice(cls, value: Any, info: ValidationInfo) -> Any:
        """The section validated by the options model registered under its tag, as the registries hold them
        now (errors name the tag, e.g. ``peft.lora.r``, and list the registered choices)."""
        return validate_choice(str(info.field_name), value)

    @model_validator(mode="after")
    def _printable_output_dir(self) -> RunConfig:
        bad = unprintable(self.output_dir)
        if bad is not None:  # a newline would split every line that prints the run's path
            raise OptionValueError("output_dir", f"{self.output_dir!r} holds the unprintable character {bad!r} (a control or format character); choose a "
                                   "path of printable characters")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.runtime.precision == "fp16" and self.runtime.device == "cpu":
            raise ValueError("runtime.precision fp16 needs a GPU; use bf16 or fp32 on cpu")
        if self.runtime.flower.secure_aggregation is not None:
            self._check_secure_aggregation()
        if self.eval.personalized and not type(self.algorithm).supports_personalized_eval:
            able = ", ".join(n for n, m in _all_algorithms().items() if m.supports_personalized_eval)
            raise ValueError(f"eval.personalized: algorithm {self.algorithm.name} does not score a personalized model "
                             f"(its client half never calls ClientContext.evaluate_personal); algorithms that do: "
                             f"{able}")
        kept = type(self.algorithm).personal_models
        if kept is not None and not self.eval.personalized:
            raise ValueError(f"algorithm {self.algorithm.name}: each client keeps {kept}, so the global model is not "
                             "the method's and its score is not the method's: set eval.personalized: true to score "
                             "the clients' own models")
        if self.eval.save_client_adapters:
            if kept is None:
                raise ValueError(f"eval.save_client_adapters: under algorithm {self.algorithm.name} every client's "
                                 "model is the global one (RUN_DIR/adapter); remove eval.save_client_adapters")
            if self.runtime.name != "embedded":
                raise ValueError("eval.save_client_adapters: the clients' own parts live in the SuperNodes of a "
                                 f"{self.runtime.name} run, not with the server; set runtime.name: embedded or remove "
                                 "eval.save_client_adapters")
        wrappers = self.algorithm.wrappers()
        if len(wrappers) > 1:
            raise ValueError(f"{wrappers[0].key} and {wrappers[1].key} together are not supported (each takes the "
                             "place of the weighted mean of the clients' updates, and a run has one): choose one")
        for wrapper in wrappers:
            wrapper.check(self)
        if self.federation.attackers is not None:
            self.federation.attackers.check(self)
        why = type(self.peft).no_images
        if self.task.type == "image_classification" and why is not None:
            able = ", ".join(n for n, m in _all_peft_methods().items() if m.no_images is None)
            raise ValueError(f"peft.method {self.peft.method} cannot adapt a vision transformer: {why}; methods that "
                             f"can: {able}")
        self._check_system()
        self._check_workers()
        self.peft.check(self)
        self.algorithm.check(self)
        return self

    def _check_workers(self) -> None:
        rt = self.runtime
        if rt.workers == 1:
            if rt.worker_timeout_s is not None:
                raise ValueError(f"runtime.worker_timeout_s {rt.worker_timeout_s:g} applies to worker processes, and "
                                 "runtime.workers is 1 (the run's own process): set runtime.workers or remove "
                                 "runtime.worker_timeout_s")
            return
        if rt.name != "embedded":
            raise ValueError(f"runtime.workers {rt.workers} applies to the embedded runtime; runtime {rt.name} runs "
                             "each client where its messages go: remove runtime.workers")
        if not self.system.simulates_time_only() or self.federation.asynchronous is not None:
            raise ValueError(f"runtime.workers {rt.workers} where the simulated clock decides who trains (a system "
                             "profile or trace, a deadline, over-selection or asynchronous aggregation): each worker "
                             "samples its own FLOPs, which time the clock, so the run would depend on which worker "
                             "trained whom; set runtime.workers: 1")


    def _check_system(self) -> None:
        system, fed = self.system, self.federation
        if self.runtime.name != "flower" and not system.simulates_time_only() and self.runtime.flops_sample_steps == 0:
            raise ValueError("system: simulated devices, deadlines and over-selection time the FLOPs the run counts, "
                             "and runtime.flops_sample_steps is 0 (off): set it to 1 or more")
        decides = not system.simulates_time_only() or fed.asynchronous is not None
        if self.runtime.name == "embedded" and decides and self.runtime.clients_per_pass == "auto":
            raise ValueError("runtime.clients_per_pass: auto picks its number by timing this machine, and the clients "
                             "trained together shift the counted FLOPs that the simulated clock times (here the clock "
                             "decides who trains and what is aggregated): give a number (e.g. 4) so that the run "
                             "gives the same result on every machine")
        selected = system.selected(fed.clients_per_round)
        if selected > fed.num_clients:
            raise ValueError(f"system.over_selection {system.over_selection:g} selects {selected} clients a round, more "
                             f"than federation.num_clients ({fed.num_clients}): lower it")
        for wrapper in self.algorithm.wrappers():
            wrapper.check_system(self)
        if fed.asynchronous is not None:
            self._check_asynchronous()
        if self.runtime.name != "embedded" and (system.trace is not None or system.profile != "ideal"):
            raise ValueError(f"system: simulated devices and links run in the embedded runtime; runtime "
                             f"{self.runtime.name} runs on real ones and reports the ideal clock (set system.profile: "
                             "ideal and remove system.trace; system.deadline_s and over_selection act in real time "
                             "there)")
        if self.runtime.name not in ("embedded", "flower") and (system.deadline_s is not None or system.over_selection):
            raise ValueError(f"system.deadline_s and system.over_selection run in the embedded runtime (on the clock) "
                             f"and the Flower runtime (in real time); runtime {self.runtime.name} does neither: remove "
                             "them")
        if self.runtime.name == "flower" and system.deadline_s is not None and (
                system.deadline_s >= fed.round_timeout_s):
            raise ValueError(f"system.deadline_s {system.deadline_s:g} is not shorter than federation.round_timeout_s "
                             f"{fed.round_timeout_s:g}: on the Flower runtime the round's timeout would end it first; "
                             "lower the deadline or remove it")
        secure = self.runtime.flower.secure_aggregation is not None
        if secure and (system.deadline_s is not None or system.over_selection):
            raise ValueError("system.deadline_s and system.over_selection with runtime.flower.secure_aggregation: "
                             "SecAgg+ runs its own rounds with federation.round_timeout_s and needs every surviving "
                             "client's share; remove one of the two")

    def _check_asynchronous(self) -> None:
        where, fed, asynchronous = "federation.asynchronous", self.federation, self.federation.asynchronous
        assert asynchronous is not None
        why = type(self.algorithm).asynchronous_unavailable
        if why is not None:
            able = ", ".join(n for n, m in _all_algorithms().items() if m.asynchronous_unavailable is None)
            raise ValueError(f"{where}: algorithm {self.algorithm.name} cannot aggregate asynchronously: {why}; "
                             f"algorithms that can: {able}")
        for wrapper in self.algorithm.wrappers():
            if wrapper.asynchronous_unavailable is not None:
                raise ValueError(f"{where} and {wrapper.key} together are not supported "
                                 f"({wrapper.asynchronous_unavailable}): choose one")
        if self.system.deadline_s is not None or self.system.over_selection:
            raise ValueError(f"{where}: system.deadline_s and system.over_selection shape synchronous rounds; remove "
                             "them (an asynchronous run has no rounds to end)")
        if self.runtime.name == "flower":  # in real time: the SuperNodes' own devices and links time the updates
            if self.runtime.flower.secure_aggregation is not None:
                raise ValueError(f"{where} and runtime.flower.secure_aggregation together are not supported (SecAgg+ "
                                 "sums the updates of clients that started together; a buffer takes them as they "
                                 "come): choose one")
            if not self.system.simulates_time_only():
                raise ValueError(f"{where} on the Flower runtime runs in real time, on the SuperNodes' own devices "
                                 "and links: system.profile and system.trace would decide nothing; remove them (or "
                                 "set runtime.name: embedded to run on the simulated clock)")
        elif self.runtime.flops_sample_steps == 0:
            raise ValueError(f"{where}: a client's update arrives when its simulated computation of the FLOPs the run "
                             "counts is done, and runtime.flops_sample_steps is 0 (off): set it to 1 or more")
        elif self.runtime.name != "embedded":
            raise ValueError(f"{where} runs in the embedded runtime (on the simulated clock) or the flower runtime "
                             f"(in real time), not runtime {self.runtime.name}")
        k = asynchronous.buffer(fed.clients_per_round)
        if fed.num_clients < fed.clients_per_round + k:
            raise ValueError(f"{where}: {fed.clients_per_round} clients training at once (clients_per_round) and "
                             f"{k} updates in the buffer need federation.num_clients >= {fed.clients_per_round + k} "
                             f"(it is {fed.num_clients}): a client is not chosen again while its update waits")
        for wrapper in self.algorithm.wrappers():
            wrapper.check_asynchronous(self, k)

    def _check_secure_aggregation(self) -> None:
        where = "runtime.flower.secure_aggregation"
        if self.runtime.name != "flower":
            raise ValueError(f"{where} needs runtime.name: flower (in the embedded runtime the server runs the clients)")
        if not type(self.algorithm).supports_secure_aggregation:
            family = ", ".join(n for n, m in _all_algorithms().items() if m.supports_secure_aggregation)
            raise ValueError(f"{where} needs an algorithm that aggregates from the mean update alone ({family}); "
                             f"{self.algorithm.name} needs the clients' updates in the clear")
        if self.eval.personalized:
            raise ValueError(f"{where} and eval.personalized together are not supported (the masked update carries "
                             "no per-client scores): choose one")
        for wrapper in self.algorithm.wrappers():
            raise ValueError(f"{where} and {wrapper.key} together are not supported "
                             f"({wrapper.secure_aggregation_unavailable}): choose one")
        if self.federation.clients_per_round < 2:
            raise ValueError(f"{where} needs federation.clients_per_round >= 2")
        fl = self.runtime.flower
        if fl.superlink is None and fl.num_supernodes != self.federation.num_clients:
            raise ValueError(f"{where} needs one SuperNode per client: set runtime.flower.num_supernodes to "
                             f"federation.num_clients ({self.federation.num_clients})")

    def primary_metric(self) -> str:
        """The metric a run is judged by (headline, best_round, best_adapter, eval.target): the task's, scored on
        the global model, or ``personal_<metric>`` when the algorithm's model is each client's own
        (``personal_models``)."""
        base = self.task_metric()
        return f"personal_{base}" if type(self.algorithm).personal_models is not None else base

    def task_metric(self) -> str:
        """The task's metric (task.metric or the task type's default), without the model it is scored on."""
        if self.task.metric:
            return self.task.metric
        load_built_ins()
        entry = DATASETS.get(self.task.dataset) if self.task.dataset in DATASETS else None  # a registered dataset's
        if entry is not None and entry.default_metric and entry.task == self.task.type:
            return entry.default_metric
        return {"classification": "accuracy", "generation": "rougeL", "multiple_choice": "accuracy",
                "image_classification": "accuracy"}[
            self.task.type
        ]


def check_options_model(model: object, section: Literal["peft", "algorithm"], name: str) -> None:
    """Refuse (one line) an options model that is not a subclass of the section's base class or whose tag does
    not default to ``name``."""
    base, (_, tag) = (PeftOptions if section == "peft" else AlgorithmOptions), SECTIONS[section]
    register = "register_peft_method" if section == "peft" else "register_algorithm"
    if not (isinstance(model, type) and issubclass(model, base)):
        raise TypeError(f"{register}({name!r}): options must subclass fedpeft.{base.__name__}")
    if model.model_fields[tag].default != name:
        raise ValueError(f"{register}({name!r}): {model.__name__}.{tag} must default to {name!r}, e.g. "
                         f"{tag}: Literal[{name!r}] = {name!r}")


def peft_methods_with(flag: str) -> list[str]:
    """The registered PEFT methods whose options set the class flag ``flag`` (e.g. "layer_prefixes"), by name."""
    load_built_ins()
    return sorted(name for name, entry in PEFT_METHODS.items() if getattr(entry.options, flag, False))


def options_for(section: str, name: str) -> type[BaseModel]:
    """The options model registered under ``name`` for section "peft" or "algorithm" (fedpeft's built-ins
    registered first)."""
    load_built_ins()
    registry, tag = SECTIONS["peft" if section == "peft" else "algorithm"]
    if name not in registry:
        raise ValueError(f"{section}.{tag}: unknown choice {name!r}; valid choices: {', '.join(sorted(registry))}")
    model: type[BaseModel] = registry.get(name).options
    return model
