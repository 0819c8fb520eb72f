"""Masked means, the policy loss's metrics and the rollout-vs-trainer mismatch diagnostics
(SPEC section 6).

Every metric here is a masked mean over the valid tokens of one micro-batch, returned as a
detached 0-dim tensor next to `tokens`, the count it averaged over. To average across
micro-batches and ranks without bias, accumulate `value * tokens` and `tokens`, all-reduce both,
and divide once per step (one sync point instead of one per metric).
"""

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [B, T] (or [B, 1], broadcast over T) over mask [B, T]; 0 when nothing is valid."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@torch.no_grad()
def policy_metrics(
    logp: Tensor,
    old: Tensor,
    mask: Tensor,
    diagnostics: dict[str, Tensor],
    *,
    k3: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_keep: Tensor | None = None,
    off_policy_keep: Tensor | None = None,
    tis_weights: Tensor | None = None,
) -> dict:
    """`policy_loss`'s metrics: detached 0-dim masked means over the valid tokens of mask [B, T],
    with `tokens`, the count.

    kl_old/k1 and kl_old/k3: the policy's KL to pi_old, from logp and old [B, T]; then the loss's
    own `diagnostics` (per-token tensors [B, T] or [B, 1]; a bool one is a fraction of tokens:
    clip_ratio/*, delta_bound, vespo/phi_mean); then those of the other terms that are given:
    kl_ref (the k3 [B, T] of the KL term), entropy [B, T], entropy_mask/kept (the entropy mask
    [B, T]), off_policy_mask/kept (the off-policy mask [B, 1]), tis/mean (TIS weights [B, T] or
    [B, 1]).
    """
    log_ratio = logp - old
    metrics = {
        "tokens": mask.sum(),
        "kl_old/k1": masked_mean(-log_ratio, mask),
        "kl_old/k3": masked_mean(log_ratio.expm1() - log_ratio, mask),
    }
    for name, value in diagnostics.items():
        metrics[name] = masked_mean(value.float() if value.dtype == torch.bool else value, mask)
    terms = {"kl_ref": k3, "entropy": entropy, "entropy_mask/kept": entropy_keep,
             "off_policy_mask/kept": off_policy_keep, "tis/mean": tis_weights}
    metrics.update({name: masked_mean(value, mask) for name, value in terms.items() if value is not None})
    return metrics


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
