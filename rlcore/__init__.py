"""rlcore: a from-scratch, pure-PyTorch RL post-training framework for language models."""

from pathlib import Path

__version__ = "0.1.0"

EMBEDDED_DEFAULT = Path(__file__).parent / "config" / "default.toml"  # the run `rlcore train` runs with no config


class RlcoreWarning(UserWarning):
    """rlcore's own warnings (a TRL option dropped, a risky setting). The command line prints
    each as one `rlcore: warning:` line, once per run, from rank 0 only."""


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and the fix."""
