"""Run configuration: schema (every option) and loading (YAML + overrides).

Importing it registers nothing: a config's ``peft`` and ``algorithm`` sections are validated against the options
models registered when it is validated, and validating one first registers fedpeft's built-ins
(:func:`fedpeft.plugins.load_built_ins`).
"""

from fedpeft.config.load import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    validate_config,
)
from fedpeft.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "dump_config", "load_config", "validate_config"]
