"""Options of the Byzantine-robust aggregation rules (``algorithm.robust``) and of the simulated attackers
(``federation.attackers``). Like the rest of fedpeft.config: descriptions and validation only, no torch."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from fedpeft.config.section import Section

if TYPE_CHECKING:
    from fedpeft.config.schema import RunConfig



class _Rule(Section):
    def min_updates(self) -> int:
        """The fewest updates the rule can aggregate with its guarantee."""
        return 1

    def check(self, run: RunConfig) -> None:
        """Refuse (ValueError, one line) a federation this rule cannot protect as configured."""
        need = self.min_updates()
        fed = run.federation
        if fed.clients_per_round < need:
            raise ValueError(f"algorithm.robust: rule {self.rule} {self.why(need)} "  # type: ignore[attr-defined]
                             f"(federation.clients_per_round is {fed.clients_per_round}): {self.fix(need)}")
        if fed.min_replies < need:
            raise ValueError(f"algorithm.robust: rule {self.rule} aggregates only rounds with at least {need} "  # type: ignore[attr-defined]
                             f"accepted updates: set federation.min_replies to {need} or more (it is "
                             f"{fed.min_replies}); a round with fewer then fails and leaves the global model as it was")

    def why(self, need: int) -> str:
        return f"needs at least {need} updates per round"

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round"


class MedianRule(_Rule):
    """Coordinate-wise median of the clients' updates (Yin et al., ICML 2018). Tolerates fewer than half the
    updates being arbitrary; ignores the clients' sample counts (a claimed count is itself an attack surface);
    without attack it is noisier than the mean, most under skewed (non-IID) clients."""

    rule: Literal["median"] = "median"

    def min_updates(self) -> int:
        return 3  # the median of two updates is their mean


def trim_count(n: int, trim_fraction: float) -> int:
    """floor(beta n), the values the trimmed mean drops at each end of a coordinate, with a tolerance for binary
    rounding: 0.29 x 100 is 28.999999999999996 in floats, and trims 29."""
    return math.floor(trim_fraction * n + 1e-9)


class TrimmedMeanRule(_Rule):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): in every coordinate the floor(beta n) largest and
    floor(beta n) smallest of the n updates are dropped and the rest averaged, unweighted. Tolerates up to
    floor(beta n) arbitrary updates per round."""

    rule: Literal["trimmed_mean"] = "trimmed_mean"
    trim_fraction: float = Field(0.1, gt=0, lt=0.5, description="beta: the share of updates dropped at each end "
                                 "of every coordinate.")

    def min_updates(self) -> int:
        n = 2
        while trim_count(n, self.trim_fraction) < 1:  # at least one value trimmed at each end
            n += 1
        return n

    def why(self, need: int) -> str:
        return f"with trim_fraction {self.trim_fraction:g} trims nothing below {need} updates per round"

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round or algorithm.robust.trim_fraction"


class KrumRule(_Rule):
    """Krum (Blanchard et al., NeurIPS 2017): each update is scored by the summed squared distances to its
    n - f - 2 nearest other updates and the lowest-scoring one becomes the round's update. Tolerates f
    arbitrary updates when n >= 2f + 3; uses one client's update per round, so it costs accuracy without
    attack, most under skewed clients."""

    rule: Literal["krum"] = "krum"
    num_attackers: int = Field(1, ge=0, description="f: the Byzantine updates per round it must tolerate.")

    def min_updates(self) -> int:
        return 2 * self.num_attackers + 3

    def fix(self, need: int) -> str:
        return "raise federation.clients_per_round or lower algorithm.robust.num_attackers"


class MultiKrumRule(KrumRule):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the unweighted mean of the m updates with the lowest Krum
    scores (m = n - f by default), which keeps most of the mean's accuracy without attack."""

    rule: Literal["multi_krum"] = "multi_krum"  # type: ignore[assignment]
    keep: int | None = Field(None, ge=1, description="m: updates averaged; None = n - f (n: the round's updates).")

    def min_updates(self) -> int:
        # Krum's 2f + 3, and m + f so that m updates can be kept while f are left out
        return max(super().min_updates(), (self.keep or 0) + self.num_attackers)


class NormBoundRule(_Rule):
    """Norm bounding (Sun et al., 2019, "Can you really backdoor federated learning?"): every update is scaled
    down to L2 norm at most max_norm (over all its tensors), then the sample-weighted mean is taken as in
    FedAvg. Limits what one update can move, not what many can; without attack it equals FedAvg whenever no
    honest update exceeds the bound. It keeps FedAvg's weighting by the clients' claimed sample counts, so a client
    that overstates its count weighs more (within the bound)."""

    rule: Literal["norm_bound"] = "norm_bound"
    max_norm: float | None = Field(None, gt=0, description="The bound; None = the median norm of the round's "
                                   "updates (so at most half of them are scaled).")


RobustRule = Annotated[MedianRule | TrimmedMeanRule | KrumRule | MultiKrumRule | NormBoundRule,
                       Field(discriminator="rule")]
ROBUST_DESCRIPTION = ("Byzantine-robust aggregation in place of the weighted mean of the updates (off by default): "
                      "{rule: median | trimmed_mean | krum | multi_krum | norm_bound, ...}; the server optimizer "
                      "then steps on the robust aggregate.")

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
