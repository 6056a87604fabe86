"""The base of the Byzantine-robust aggregation rules' options (``algorithm.robust``; each rule's own options live
beside its code, ``fedpeft/algorithms/robust/``) and the options of the simulated attackers
(``federation.attackers``). Like the rest of fedpeft.config: descriptions and validation only, no torch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from fedpeft.config.choices import registered_field
from fedpeft.config.section import Section
from fedpeft.config.wrapping import WrapperOptions

if TYPE_CHECKING:
    from fedpeft.config.schema import RunConfig



class RobustRuleOptions(WrapperOptions):
    """Base of a Byzantine-robust aggregation rule's options (``algorithm.robust``). A subclass names its rule with
    a literal default, ``rule: Literal["mine"] = "mine"``, and is registered with its aggregation function through
    ``fedpeft.register_robust_rule``; the config then accepts ``algorithm.robust: {rule: mine, ...}`` for every
    algorithm with a ``robust`` option. fedpeft's own rules live in ``fedpeft/algorithms/robust/``."""

    rule: str
    key: ClassVar[str] = "algorithm.robust"
    server_wrapper: ClassVar[str] = "fedpeft.algorithms.robust.wrapper:RobustServer"
    secure_aggregation_unavailable: ClassVar[str] = "SecAgg+ hides the individual updates a robust rule compares"

    def min_updates(self) -> int:
        """The fewest updates the rule can aggregate with its guarantee."""
        return 1

    def check(self, run: RunConfig) -> None:
        """Refuse (ValueError, one line) a federation this rule cannot protect as configured (a subclass that
        overrides it calls it too)."""
        need = self.min_updates()
        fed = run.federation
        if fed.clients_per_round < need:
            raise ValueError(f"algorithm.robust: rule {self.rule} {self.why(need)} "
                             f"(federation.clients_per_round is {fed.clients_per_round}): {self.fix(need)}")
        if fed.min_replies < need:
            raise ValueError(f"algorithm.robust: rule {self.rule} aggregates only rounds with at least {need} "
                             f"accepted updates: set federation.min_replies to {need} or more (it is "
                             f"{fed.min_replies}); a round with fewer then fails and leaves the global model as it was")

    def check_asynchronous(self, run: RunConfig, buffer_size: int) -> None:
        if buffer_size < self.min_updates():
            raise ValueError(f"federation.asynchronous: algorithm.robust rule {self.rule} needs at least "
                             f"{self.min_updates()} updates per aggregation, and buffer_size is {buffer_size}: raise "
                             "buffer_size")

    def why(self, need: int) -> str:
        return f"needs at least {need} updates per round"

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round"


# The type of an algorithm's ``robust`` option (``robust: fedpeft.RobustRule | None = None``): one of the rules
# registered when the config is validated, told apart by ``rule`` (to a type checker, their base class)
if TYPE_CHECKING:
    RobustRule = RobustRuleOptions
else:
    RobustRule = registered_field("robust", RobustRuleOptions)
ROBUST_DESCRIPTION = ("Byzantine-robust aggregation in place of the weighted mean of the updates (off by default): "
                      "{rule: median | trimmed_mean | krum | multi_krum | norm_bound | a plugin's rule, ...}; the "
                      "server optimizer then steps on the robust aggregate.")

MODEL_POISONING = ("sign_flip", "scale", "noise")
DEFAULT_FACTOR = {"sign_flip": 1.0, "scale": 10.0}


class AttackersConfig(Section):
    """Simulated Byzantine clients: fraction x num_clients clients (rounded half up), drawn once from the run's seed, send
    a harmful update whenever they are selected. sign_flip: the honest update reversed and times factor
    (default 1); scale: the honest update times factor (default 10); noise: an update of Gaussian noise
    with standard deviation noise_std per entry in place of the honest one; label_flip: the update of
    honest training on flipped labels (label y of C becomes C - 1 - y; classification only). Attackers are
    listed per round in metrics.jsonl (adversarial_clients); the server is not told."""

    fraction: float = Field(gt=0, lt=1, description="Share of the clients that attack (required).")
    attack: Literal["sign_flip", "scale", "noise", "label_flip"] = "sign_flip"
    factor: float | None = Field(None, description="sign_flip: the update sent is -factor x the honest one "
                                 "(default 1); scale: factor x the honest one (default 10).")
    noise_std: float | None = Field(None, gt=0, description="noise: the standard deviation of the Gaussian update "
                                    "(default 0.1).")

    @model_validator(mode="after")
    def _options_go_with_their_attack(self) -> AttackersConfig:
        if self.factor is not None and self.attack not in DEFAULT_FACTOR:
            raise ValueError(f"federation.attackers.factor is used by attacks sign_flip and scale, not "
                             f"{self.attack}: remove it")
        if self.factor is not None and self.factor <= 0:
            raise ValueError(f"federation.attackers.factor must be positive, got {self.factor:g} (sign_flip "
                             "reverses the update itself)")
        if self.noise_std is not None and self.attack != "noise":
            raise ValueError(f"federation.attackers.noise_std is used by attack noise, not {self.attack}: remove it")
        return self

    @property
    def scale(self) -> float:
        """The multiplier sign_flip and scale apply to the honest update (sign included)."""
        factor = self.factor if self.factor is not None else DEFAULT_FACTOR[self.attack]
        return -factor if self.attack == "sign_flip" else factor

    @property
    def std(self) -> float:
        return self.noise_std if self.noise_std is not None else 0.1

    def count(self, num_clients: int) -> int:
        return int(self.fraction * num_clients + 0.5)  # rounded half up

    def check(self, run: RunConfig) -> None:
        n = run.federation.num_clients
        if self.count(n) == 0:
            raise ValueError(f"federation.attackers.fraction {self.fraction:g} of {n} clients makes no attacker "
                             f"(rounded): raise it to at least {math.ceil(1000 / n) / 1000:g}, or remove "
                             "federation.attackers")
        if self.count(n) == n:
            raise ValueError(f"federation.attackers.fraction {self.fraction:g} of {n} clients makes every client an "
                             "attacker (rounded): lower it")
        reason = type(run.algorithm).update_poisoning_unavailable
        if self.attack in MODEL_POISONING and reason is not None:
            raise ValueError(f"federation.attackers.attack {self.attack} changes the update a client sends, which "
                             f"algorithm {run.algorithm.name} cannot take: {reason}; use attack label_flip")
        if self.attack == "label_flip" and run.task.type not in ("classification", "image_classification"):
            raise ValueError(f"federation.attackers.attack label_flip flips class labels; task.type is "
                             f"{run.task.type}: choose sign_flip, scale or noise")
