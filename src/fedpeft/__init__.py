"""fedpeft: federated parameter-efficient fine-tuning of transformer language models.

The public API (see docs/guide/python-api.md and docs/api/index.md); names load on first use, so ``import fedpeft`` stays light:

* configs: :class:`RunConfig`, :func:`load_config`, :func:`validate_config`, :func:`dump_config`;
* runs: :func:`run`, :func:`resume`, :class:`RunObserver` (watching a run in this process), and reading a run directory back: :func:`read_metrics`,
  :func:`read_summary`, :func:`read_partition`, :func:`load_adapter`;
* your own algorithms: :class:`AlgorithmOptions`, :class:`ServerAlgorithm`, :class:`ClientAlgorithm`,
  :class:`ClientContext`, :class:`Payload`, :func:`check_update`, :class:`UpdateMeta` (the metadata every
  update must carry, checked with :func:`check_update_meta`), :func:`register_algorithm`, and Byzantine-robust
  aggregation for them: :data:`RobustRule` (the ``robust`` option), :func:`robust_aggregate`;
* your own robust rules: :class:`RobustRuleOptions`, :class:`RobustResult`, :func:`register_robust_rule`; the
  ``dp`` option an algorithm offers: :class:`PrivacyOptions`;
* your own PEFT methods: :class:`PeftOptions`, :class:`TunerContext`, :func:`register_peft_method`;
* your own datasets, experiment trackers and runtimes: :func:`register_dataset`, :func:`register_tracker`,
  :func:`register_runtime`;
* plugins: :func:`load_plugin`;
* errors about the user's input: :class:`UserError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.lazy import lazy_getattr

if TYPE_CHECKING:  # what a type checker sees of the lazy exports below (a test checks that they agree)
    from fedpeft.adapters import load_adapter
    from fedpeft.algorithms.base import (
        ClientAlgorithm,
        ClientContext,
        RuntimeNeeds,
        ServerAlgorithm,
        UpdateMeta,
        UpdateRejected,
        check_update,
        check_update_meta,
    )
    from fedpeft.algorithms.privacy.options import PrivacyOptions
    from fedpeft.algorithms.registry import register_algorithm
    from fedpeft.algorithms.robust.core import RobustResult
    from fedpeft.algorithms.robust.registry import register_robust_rule, robust_aggregate
    from fedpeft.api import read_partition, resume, run
    from fedpeft.config.adversarial import RobustRule, RobustRuleOptions
    from fedpeft.config.load import ConfigError, dump_config, load_config, validate_config
    from fedpeft.config.schema import AlgorithmOptions, PeftOptions, RunConfig
    from fedpeft.data.catalog import register_dataset
    from fedpeft.errors import UserError
    from fedpeft.launchers import register_runtime
    from fedpeft.observer import RunObserver
    from fedpeft.plugins import load_plugin
    from fedpeft.rundir import read_metrics, read_summary
    from fedpeft.tracking.backends import register_tracker
    from fedpeft.tuners.registry import TunerContext, register_peft_method
    from fedpeft.wire import Payload

__version__ = "0.1.0"

_EXPORTS = {
    "RunConfig": "fedpeft.config.schema",
    "AlgorithmOptions": "fedpeft.config.schema",
    "PeftOptions": "fedpeft.config.schema",
    "RobustRule": "fedpeft.config.adversarial",
    "RobustRuleOptions": "fedpeft.config.adversarial",
    "PrivacyOptions": "fedpeft.algorithms.privacy.options",
    "RobustResult": "fedpeft.algorithms.robust.core",
    "robust_aggregate": "fedpeft.algorithms.robust.registry",
    "register_robust_rule": "fedpeft.algorithms.robust.registry",
    "load_config": "fedpeft.config.load",
    "validate_config": "fedpeft.config.load",
    "dump_config": "fedpeft.config.load",
    "ConfigError": "fedpeft.config.load",
    "run": "fedpeft.api",
    "resume": "fedpeft.api",
    "read_metrics": "fedpeft.rundir",
    "read_summary": "fedpeft.rundir",
    "read_partition": "fedpeft.api",
    "load_adapter": "fedpeft.adapters",
    "ServerAlgorithm": "fedpeft.algorithms.base",
    "ClientAlgorithm": "fedpeft.algorithms.base",
    "ClientContext": "fedpeft.algorithms.base",
    "RuntimeNeeds": "fedpeft.algorithms.base",
    "RunObserver": "fedpeft.observer",
    "UpdateRejected": "fedpeft.algorithms.base",
    "check_update": "fedpeft.algorithms.base",
    "UpdateMeta": "fedpeft.algorithms.base",
    "check_update_meta": "fedpeft.algorithms.base",
    "Payload": "fedpeft.wire",
    "register_algorithm": "fedpeft.algorithms.registry",
    "register_peft_method": "fedpeft.tuners.registry",
    "register_dataset": "fedpeft.data.catalog",
    "register_tracker": "fedpeft.tracking.backends",
    "register_runtime": "fedpeft.launchers",
    "TunerContext": "fedpeft.tuners.registry",
    "load_plugin": "fedpeft.plugins",
    "UserError": "fedpeft.errors",
}
__all__ = [  # sorted(_EXPORTS), written out for type checkers and linters (a test checks)
    "AlgorithmOptions", "ClientAlgorithm", "ClientContext", "ConfigError", "Payload", "PeftOptions",
    "PrivacyOptions", "RobustResult", "RobustRule", "RobustRuleOptions", "RunConfig", "RunObserver",
    "RuntimeNeeds", "ServerAlgorithm", "TunerContext", "UpdateMeta", "UpdateRejected", "UserError",
    "check_update", "check_update_meta", "dump_config", "load_adapter", "load_config",
    "load_plugin", "read_metrics", "read_partition", "read_summary", "register_algorithm",
    "register_dataset", "register_peft_method", "register_robust_rule", "register_runtime",
    "register_tracker", "resume", "robust_aggregate", "run", "validate_config",
]


__getattr__ = lazy_getattr("fedpeft", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
