"""A run's configuration: the option dataclasses (options.py), loading them from TOML and
`--set` (load.py), checking them (validation.py), the batch geometry they give (geometry.py),
and TRL's names for them (trl_names.py)."""

from rlcore.config.load import dump_config, load_config
from rlcore.config.options import Config
from rlcore.config.validation import validate

__all__ = ["Config", "dump_config", "load_config", "validate"]
