"""rlcore: a from-scratch, pure-PyTorch RL post-training framework for language models."""

__version__ = "0.1.0"
