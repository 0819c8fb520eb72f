"""Masked means and the rollout-vs-trainer mismatch diagnostics (SPEC section 6).

Every metric here and in `policy_loss` is a masked mean over the valid tokens of one
micro-batch, returned as a detached 0-dim tensor next to `tokens`, the count it averaged over.
To average across micro-batches and ranks without bias, accumulate `value * tokens` and
`tokens`, all-reduce both, and divide once per step (one sync point instead of one per metric).
"""

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, T] (or [B, 1], broadcast over T) over mask [B, T]; 0 when nothing is valid."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@torch.no_grad()
def rollout_mismatch(old: Tensor, samp: Tensor, mask: Tensor, tis: Tensor | None = None) -> dict:
    """How far the rollout engine's log-probs `samp` [B, T] are from the trainer's `old` [B, T].

    mismatch/abs_mean and mismatch/abs_max of |samp - old| over valid tokens; mismatch/k3, the
    k3 estimate of KL(samp || old) per token (samples come from the engine); with `tis`, the
    weights from `tis_weights` ([B, T] or [B, 1]), tis/frac_changed: the fraction of valid
    tokens whose weight was truncated or masked (differs from the raw exp(old - samp) ratio).
    The loop computes it once per round from `old` when it has it (old and samp do not change during
    the update), and on-policy per micro-batch from the training forward's `logp.detach()`.
    """
    valid = mask.bool()
    log_ratio = (old - samp).where(valid, 0.0)
    abs_diff = log_ratio.abs()
    metrics = {
        "tokens": valid.sum().float(),
        "mismatch/abs_mean": masked_mean(abs_diff, valid),
        "mismatch/abs_max": abs_diff.max() if abs_diff.numel() else abs_diff.new_zeros(()),
        "mismatch/k3": masked_mean(log_ratio.expm1() - log_ratio, valid),
    }
    if tis is not None:
        raw = log_ratio.sum(-1, keepdim=True) if tis.shape[-1] == 1 else log_ratio  # sequence modes
        metrics["tis/frac_changed"] = masked_mean((tis != raw.exp()).float(), valid)
    return metrics
