"""The masks and weights that multiply the policy-gradient term l_pg [B, T] (SPEC section 4),
and the loss mask of truncated completions. None carries a gradient. The first three multiply
l_pg only: a token they zero still counts in every denominator; mask_truncated zeroes the loss
mask itself, so its rows leave the denominators too.

  off_policy_mask   DeepSeek-V3.2's: drop stale negative-advantage sequences     [B, 1]
  entropy_mask      "Beyond the 80/20 rule": keep the high-entropy tokens        [B, T]
  tis_weights       truncated importance sampling for the rollout engine's drift [B, T] or [B, 1]
  mask_truncated    mask_truncated_completions: the loss mask without truncated rows
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def off_policy_mask(advantages: Tensor, logp: Tensor, samp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9; TRL's
    off_policy_mask_threshold): drop a sequence whose advantage is negative and whose mean
    per-token KL(sampling policy || current), estimated as mean_t (samp - logp) over its valid
    tokens, exceeds `threshold`. advantages [B], logp, samp, mask [B, T] -> float [B, 1] (1 = keep).
    """
    kl = ((samp - logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages[:, None] >= 0) | (kl <= threshold)).to(logp.dtype)


@torch.no_grad()
def entropy_mask(entropy: Tensor, mask: Tensor, top_entropy_quantile: float,
                 gather: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Keep the top `top_entropy_quantile` fraction of valid tokens by entropy ("Beyond the 80/20
    rule", 2506.01939): tau = quantile(H over valid tokens, 1 - rho); keep H >= tau.

    entropy, mask [B, T] -> float mask [B, T] (0 on padding). rho = 1 keeps every valid token.
    `gather` concatenates the 1-D tensors of all ranks (`distributed.gather_uneven`), so that tau
    is the quantile over every rank's tokens; None takes this rank's alone.
    """
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    valid = mask.bool()
    h = entropy.to(torch.promote_types(entropy.dtype, torch.float32))  # compare in the dtype of tau
    values = h[valid] if gather is None else gather(h[valid])
    if values.numel() == 0:
        return torch.zeros_like(entropy)
    tau = torch.quantile(values, 1.0 - top_entropy_quantile)  # torch.quantile caps input at 2**24
    return ((h >= tau) & valid).to(entropy.dtype)


@torch.no_grad()
def tis_weights(
    old: Tensor,
    samp: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    min: float | None = None,
    max: float | None = 2.0,
) -> Tensor:
    """Truncated importance sampling weights for the rollout-vs-trainer mismatch (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"). No grad.

    old: trainer log-probs under pi_old [B, T]; samp: the rollout engine's log-probs [B, T].
    token_truncate:    clamp(exp(old - samp), min, max)                         [B, T]
    token_mask:        exp(old - samp), 0 outside [min, max]                    [B, T]
    sequence_truncate: clamp(exp(sum_t (old - samp) m), min, max)               [B, 1]
    sequence_mask:     exp(sum_t (old - samp) m), 0 outside [min, max]          [B, 1]
    A bound of None is no bound. Sequence ratios are products of token ratios: long
    completions leave [min, max] far more often than short ones.
    """
    log_ratio = (old - samp).where(mask.bool(), 0.0)  # padding may hold anything, even NaN
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = log_ratio.exp()
    low = 0.0 if min is None else min  # ratios are >= 0, so 0 is no bound
    high = math.inf if max is None else max
    if mode in ("token_truncate", "sequence_truncate"):
        return ratio.clamp(low, high)
    if mode in ("token_mask", "sequence_mask"):
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown TIS mode {mode!r}; valid: {', '.join(TIS_MODES)}")


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """mask_truncated_completions: zero the loss mask [B, T] of rows that hit max_completion_length
    without EOS (truncated [B] bool). Their rewards still entered the group statistics."""
    return mask * (~truncated.bool())[:, None]
