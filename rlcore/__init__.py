"""rlcore: a from-scratch, pure-PyTorch RL post-training framework for language models."""

__version__ = "0.1.0"


class RlcoreWarning(UserWarning):
    """rlcore's own warnings (a TRL option dropped, a risky setting). The command line prints
    each as one `rlcore: warning:` line, once per run, from rank 0 only."""
