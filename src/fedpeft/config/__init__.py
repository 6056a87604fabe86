"""Run configuration: schema (every option) and loading (YAML + overrides).

Importing it registers fedpeft's built-in algorithms and PEFT methods (:func:`fedpeft.plugins.load_built_ins`),
whose options the config's ``peft`` and ``algorithm`` sections accept.
"""

from fedpeft.config import schema as _schema
from fedpeft.config.load import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    validate_config,
)
from fedpeft.config.schema import RunConfig
from fedpeft.plugins import load_built_ins as _load_built_ins

with _schema.choices_refreshed_once():
    _load_built_ins()

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "dump_config", "load_config", "validate_config"]
