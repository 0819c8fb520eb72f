"""Batched sampling of completions with a static KV cache (see docs/rollout.md)."""

from rlcore.rollout.engine import Rollout, generate

__all__ = ["Rollout", "generate"]
