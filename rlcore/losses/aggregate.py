"""Per-token loss [B, T] -> the micro-batch's contribution to the optimizer-step loss (SPEC 5).

Summing the returned values over the GA micro-batches of a step (and averaging gradients over
the P data-parallel ranks, as DDP does) gives the step loss of each `loss_type`:

  grpo     mean_i( sum_t l*m / max(sum_t m, 1) ) / GA     per-sequence token mean (DeepSeekMath, 2402.03300)
  bnpo     sum(l*m) / max(sum(m), 1) / GA                 micro-batch token mean
  dr_grpo  sum(l*m) / (B * max_completion_length) / GA    constant normaliser (Dr. GRPO, 2503.20783)
  dapo     sum(l*m) / max(N_step / P, 1)                  token mean of the whole step (DAPO, 2503.14476)
  luspo    mean_i( sum_t l*m ) / GA                       per-sequence token sum (LUSPO, 2602.05261; TRL's)
"""

from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    gradient_accumulation_steps: int,
    max_completion_length: int,
    step_tokens: int | float | Tensor | None = None,
    world_size: int = 1,
) -> Tensor:
    """Reduce per_token [B, T] under mask [B, T] to a 0-dim loss for one micro-batch.

    step_tokens (dapo only): active tokens of the whole optimizer step, summed over its
    micro-batches and ranks (an all-reduced count, known before the first backward of the step).
    Fully masked rows contribute 0; every denominator is clamped at 1, so an all-masked batch
    gives a finite 0.
    """
    mask = mask.to(per_token.dtype)
    summed = per_token * mask
    ga = gradient_accumulation_steps
    if loss_type == "grpo":
        per_seq = summed.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.mean() / ga
    if loss_type == "bnpo":
        return summed.sum() / mask.sum().clamp(min=1.0) / ga
    if loss_type == "dr_grpo":
        return summed.sum() / (per_token.shape[0] * max_completion_length) / ga
    if loss_type == "luspo":
        return summed.sum(-1).mean() / ga
    if loss_type == "dapo":
        if step_tokens is None:
            raise ValueError("loss_type='dapo' needs step_tokens: the active-token count of the "
                             "whole optimizer step (all micro-batches, all ranks)")
        # Dividing by N_step / P and letting DDP average over P ranks = sum over the step / N_step.
        # A step_tokens tensor stays on device (no sync); a python number is used as is.
        denominator = step_tokens / world_size
        denominator = denominator.clamp(min=1.0) if isinstance(denominator, Tensor) else max(denominator, 1.0)
        return summed.sum() / denominator
    raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
