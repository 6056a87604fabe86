"""Run configuration: schema (every option) and loading (YAML + overrides)."""

from fedpeft.config.load import (
    ConfigError,
    apply_overrides,
    dump_config,
    load_config,
    validate_config,
)
from fedpeft.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "apply_overrides", "dump_config", "load_config", "validate_config"]
