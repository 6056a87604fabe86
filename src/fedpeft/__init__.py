"""fedpeft: federated parameter-efficient fine-tuning of transformer language models.

The public API (see docs/guide/python-api.md and docs/api/index.md); names load on first use, so ``import fedpeft`` stays light:

* configs: :class:`RunConfig`, :func:`load_config`, :func:`validate_config`, :func:`dump_config`;
* runs: :func:`run`, :func:`resume`, :class:`RunObserver` (watching a run in this process), and reading a run directory back: :func:`read_metrics`,
  :func:`read_summary`, :func:`read_partition`, :func:`load_adapter`;
* your own algorithms: :class:`AlgorithmOptions`, :class:`ServerAlgorithm`, :class:`ClientAlgorithm`,
  :class:`ClientContext`, :class:`Payload`, :func:`check_update`, :class:`UpdateMeta` (the metadata every
  update must carry, checked with :func:`check_update_meta`), :func:`register_algorithm`, and Byzantine-robust
  aggregation for them: :data:`RobustRule` (the ``robust`` option), :func:`robust_aggregate`;
* your own PEFT methods: :class:`PeftOptions`, :class:`TunerContext`, :func:`register_peft_method`;
* your own datasets, experiment trackers and runtimes: :func:`register_dataset`, :func:`register_tracker`,
  :func:`register_runtime`;
* plugins: :func:`load_plugin`;
* errors about the user's input: :class:`UserError`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RunConfig": "fedpeft.config.schema",
    "AlgorithmOptions": "fedpeft.config.schema",
    "PeftOptions": "fedpeft.config.schema",
    "RobustRule": "fedpeft.config.adversarial",
    "robust_aggregate": "fedpeft.algorithms.robust",
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
__all__ = sorted(_EXPORTS)  # noqa: PLE0605


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedpeft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
