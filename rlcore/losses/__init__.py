"""Losses: advantages, per-token log-probs, per-token policy losses, masks, aggregation.

Read in this order: advantages.py (SPEC 2), logprobs.py and policy.py (SPEC 3-4), masks.py
(SPEC 4), aggregate.py (SPEC 5), metrics.py (SPEC 6); entropy.py is TRL's entropy bonus, beyond
the SPEC. The rewards they start from come from rlcore/rewards.py. docs/losses.md maps every
option to its equation and paper.
"""

from rlcore.losses.advantages import compute_advantages
from rlcore.losses.aggregate import LOSS_TYPES, aggregate_loss
from rlcore.losses.entropy import EntropyBonus, mean_entropy
from rlcore.losses.logprobs import token_logprobs
from rlcore.losses.masks import entropy_mask, mask_truncated, off_policy_mask, tis_weights
from rlcore.losses.metrics import masked_mean, policy_metrics, rollout_mismatch
from rlcore.losses.policy import (
    LOSS_FUNCTIONS,
    PolicyLossOptions,
    check_loss_options,
    log_importance_weights,
    policy_loss,
)

__all__ = [
    "aggregate_loss", "check_loss_options", "compute_advantages", "entropy_mask", "EntropyBonus",
    "log_importance_weights", "LOSS_FUNCTIONS", "LOSS_TYPES", "mask_truncated", "masked_mean", "mean_entropy",
    "off_policy_mask", "policy_loss", "policy_metrics", "PolicyLossOptions", "rollout_mismatch", "tis_weights",
    "token_logprobs",
]
