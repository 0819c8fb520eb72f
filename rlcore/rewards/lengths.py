"""Rewards on a completion's length: DAPO's soft overlong punishment.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.4, eq. 13) shapes the reward of completions
near the length limit instead of only cutting them off: with L_max the expected longest length and
L_cache a "soft punish cache" before it,

    R_length(y) = 0                                 |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                = -1                                L_max < |y|

added to the task's reward. TRL has it as `trl.rewards.get_soft_overlong_punishment`; rlcore's
`soft_overlong_punishment` gives the same scores, with one difference: a completion with tools
is counted by the model's own tokens (its `tool_mask`), as the trainer counts completion lengths,
where TRL counts the tool results in it too.
"""

from __future__ import annotations

from collections.abc import Callable


def overlong_punishment(length: int, max_completion_len: int, soft_punish_cache: int) -> float:
    """DAPO's eq. 13 for a completion of `length` tokens: 0 up to L_max - L_cache, then down
    linearly to -1 at L_max, and -1 past it."""
    start = max_completion_len - soft_punish_cache  # the first length punished is start + 1
    if length <= start:
        return 0.0
    if length <= max_completion_len:
        return (start - length) / soft_punish_cache
    return -1.0


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """The reward function of DAPO's soft overlong punishment with L_max = `max_completion_len` and
    L_cache = `soft_punish_cache` (in a config: the `soft_overlong_punishment` reward, with
    loss.soft_punish_max_completion_len and loss.soft_punish_cache). It scores each completion by
    its token count: `completion_ids`' length, or with tools the model's tokens (`tool_mask`'s ones:
    tool results excluded)."""

    def soft_overlong_punishment_reward(completion_ids: list[list[int]], tool_mask: list[list[int]] | None = None,
                                        **kwargs) -> list[float]:
        lengths = [sum(mask) for mask in tool_mask] if tool_mask is not None else [len(ids) for ids in completion_ids]
        return [overlong_punishment(length, max_completion_len, soft_punish_cache) for length in lengths]

    return soft_overlong_punishment_reward
