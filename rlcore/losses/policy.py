"""Per-token policy losses and the terms applied to them (SPEC sections 3 and 4).

`policy_loss` builds l[B, T] in the SPEC's order:
  1. l_pg: PPO-style clipped (GRPO/DAPO/INTELLECT-2's delta), CISPO, SAPO or VESPO, with token,
     sequence (GSPO) or sequence_token (GSPO-token) importance weights;
  2. off-policy sequence mask, then entropy mask (multiply l_pg only);
  3. rollout importance-sampling correction, TIS (multiplies l_pg only; VESPO folds it into its
     sequence weight instead);
  4. + beta * k3 KL to the reference policy.
Aggregation over tokens is a separate step: `rlcore.losses.aggregate.aggregate_loss`.
"""

import math
import warnings

from collections.abc import Callable

import torch
from torch import Tensor

from rlcore import RlcoreWarning
from rlcore.losses.aggregate import LOSS_TYPES
from rlcore.losses.metrics import masked_mean

LOSSES = ("ppo", "cispo", "sapo", "vespo")
LEVELS = ("token", "sequence", "sequence_token")
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(logp: Tensor, old: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """Log importance weight w, with r = exp(w), from logp and old [B, T] under mask [B, T].

    token:          w = logp - old                                         [B, T]
    sequence:       w_i = sum_t (logp - old) m / max(sum_t m, 1)           [B, 1]  (GSPO, 2507.18071)
    sequence_token: w = logp - sg(logp) + sg(w_seq)                        [B, T]  (GSPO-token, same paper)
                    the sequence's value with each token's own gradient
    """
    log_ratio = logp - old
    if level == "token":
        return log_ratio
    mask = mask.to(log_ratio.dtype)
    w_seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    if level == "sequence":
        return w_seq
    if level == "sequence_token":
        return logp - logp.detach() + w_seq.detach()
    raise ValueError(f"unknown importance_sampling_level {level!r}; valid: {', '.join(LEVELS)}")


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
def vespo_weights(advantages: Tensor, log_ratio: Tensor, mask: Tensor, tis_weights: Tensor | None = None,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """VESPO's sequence weight phi(w) = exp(lambda + k log w - lambda w) (arXiv:2602.10693; TRL's
    get_gamma_weights), a gamma density scaled so phi(1) = 1, of the sequence ratio
    log w = sum_t clamp(logp - old, -20, 20) over valid tokens (+ sum_t log tis, clamped below at
    log 1e-8, when TIS weights are given), clamped to [log 1e-8, 20]; (k, lambda) = the _pos pair
    for A >= 0, else the _neg pair. advantages [B], log_ratio, mask [B, T] -> [B, 1], no grad."""
    low = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if tis_weights is not None:  # token weights [B, T] are summed in log space; a sequence weight [B, 1] is one
        log_tis = tis_weights.log().clamp(low, 20.0)
        log_w = log_w + (log_tis if log_tis.shape[-1] == 1 else (log_tis * mask).sum(-1, keepdim=True))
    log_w = log_w.clamp(low, 20.0)
    pos = advantages[:, None] >= 0
    k = torch.where(pos, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(pos, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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


def check_loss_options(
    loss_type: str,
    *,
    policy_loss: str = "ppo",
    importance_sampling_level: str = "token",
    epsilon_high: float | None = None,
) -> None:
    """Validate option names once, before training, and warn about combinations that are legal
    but probably not what was meant. `policy_loss` is the `loss` argument of `policy_loss`."""
    for name, value, valid in (("loss_type", loss_type, LOSS_TYPES), ("policy_loss", policy_loss, LOSSES),
                               ("importance_sampling_level", importance_sampling_level, LEVELS)):
        if value not in valid:
            raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
    if policy_loss == "cispo" and epsilon_high is None:
        warnings.warn("policy_loss='cispo' caps the ratio at epsilon_high, which was left at its "
                      "default (= epsilon, 0.2): every update shrinks five-fold. CISPO uses an "
                      "absolute cap such as epsilon_high=5.0", RlcoreWarning, stacklevel=2)
    if importance_sampling_level != "token" and loss_type not in ("grpo", "luspo"):
        warnings.warn(
            f"importance_sampling_level={importance_sampling_level!r} (GSPO) with loss_type="
            f"{loss_type!r} sums tokens, so each sequence's loss is weighted by its length; "
            "GSPO's objective is a per-sequence mean: use loss_type='grpo'", RlcoreWarning, stacklevel=2)


def policy_loss(
    logp: Tensor,
    old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss: str = "ppo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    ref: Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = False,
    tis_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_keep: Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    samp: Tensor | None = None,
    off_policy_mask_threshold: float | None = None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[Tensor, dict]:
    """Per-token loss l [B, T] and diagnostics, before aggregation (see module docstring).

    logp [B, T] current policy (with grad), old [B, T] pi_old (no grad; logp.detach() on-policy),
    advantages [B], mask [B, T], ref [B, T] reference log-probs (needed when beta != 0),
    tis_weights [B, T] or [B, 1] from `tis_weights`, entropy [B, T] of the current policy
    (needed when top_entropy_quantile < 1, unless entropy_keep [B, T] gives the caller's
    `entropy_mask(entropy, mask, top_entropy_quantile)` already), samp [B, T] the rollout engine's log-probs (needed
    with off_policy_mask_threshold). epsilon_high defaults to epsilon; for cispo it is
    an absolute cap on the ratio (recommended 5.0). use_bias_correction_kl multiplies the KL
    term by the ratio (TRL's option of that name). Option names and risky combinations are
    checked once, by `check_loss_options` for direct callers and by `rlcore.validation.validate`
    in the training loop, not per micro-batch.
    Metrics (detached 0-dim masked means over valid tokens, plus `tokens`, the count):
    clip_ratio/low, /high, /region (ppo: tokens where clipping removed the gradient; cispo:
    only /high, ratio above the cap), delta_bound (tokens whose loss is -delta * A),
    kl_old/k1, kl_old/k3 (policy vs old), kl_ref (when ref is given), entropy,
    entropy_mask/kept, off_policy_mask/kept, tis/mean (when their inputs are given), vespo/phi_mean.
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; valid: {', '.join(LOSSES)}")
    if beta != 0.0 and ref is None:
        raise ValueError(f"beta={beta} needs ref, the reference policy's log-probs [B, T]")
    if top_entropy_quantile < 1.0 and entropy is None and entropy_keep is None:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} needs entropy [B, T]")
    if off_policy_mask_threshold is not None and samp is None:
        raise ValueError(f"off_policy_mask_threshold={off_policy_mask_threshold} needs samp [B, T]")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}")
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = importance_weights(logp, old, mask, importance_sampling_level).exp()  # [B, T] or [B, 1]

    # 1. Policy-gradient term.
    if loss == "ppo":
        # PPO clip (Schulman et al. 2017) with DAPO's decoupled eps_low / eps_high (2503.14476):
        #   l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        # INTELLECT-2 (2505.07291) caps the unclipped branch at delta: r -> min(r, delta).
        clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
        unclipped = ratio if delta is None else ratio.clamp(max=delta)
        l_pg = -torch.min(unclipped * adv, clipped * adv)
    elif loss == "cispo":
        # CISPO (MiniMax-M1, 2506.13585): REINFORCE weighted by the capped, detached ratio,
        #   l = -sg(min(r, eps_high)) A log pi
        l_pg = -ratio.clamp(max=eps_high).detach() * adv * logp
    elif loss == "vespo":
        # VESPO (2602.10693): REINFORCE weighted by a detached gamma-shaped function of the whole
        # sequence's ratio (which TIS weights fold into), l = -phi(w) A log pi
        phi = vespo_weights(adv[:, 0], logp.detach() - old, mask, tis_weights,
                            vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        l_pg = -phi * adv * logp
    elif loss == "sapo":
        # SAPO (Soft Adaptive Policy Optimization, 2511.20347): a sigmoid gate instead of a clip,
        #   l = -sigmoid(tau (r - 1)) (4 / tau) A,  tau = tau_pos if A > 0 else tau_neg
        tau = torch.full_like(adv, sapo_temperature_neg).masked_fill_(adv > 0, sapo_temperature_pos)
        l_pg = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    else:  # a name added to LOSSES without its branch here
        raise NotImplementedError(f"policy_loss has no branch for loss {loss!r}; add one beside ppo/cispo/vespo/sapo")
    l_pg = l_pg.expand_as(logp)  # sequence-level weights give one value per row

    # 2. Off-policy sequence mask, then the entropy mask (train only on high-entropy "forking" tokens).
    if off_policy_mask_threshold is not None:
        opm = off_policy_mask(advantages.to(logp.dtype), logp.detach(), samp, mask, off_policy_mask_threshold)
        l_pg = l_pg * opm
    if top_entropy_quantile < 1.0:
        kept = entropy_mask(entropy, mask, top_entropy_quantile) if entropy_keep is None else entropy_keep
        l_pg = l_pg * kept
    # 3. Rollout importance-sampling correction (after clipping and the entropy mask); VESPO's
    # weight already holds it.
    if tis_weights is not None and loss != "vespo":
        l_pg = l_pg * tis_weights
    # 4. KL to the reference, k3 estimator (Schulman 2020; DeepSeekMath): >= 0, unbiased on-policy.
    per_token = l_pg
    # k3 = exp(x) - 1 - x, x = ref - logp; computed as expm1(x) - x since exp(x) - 1 rounds below 0 in fp32
    k3 = None if ref is None else torch.expm1(ref - logp) - (ref - logp)
    if beta != 0.0:
        kl = k3
        if use_bias_correction_kl:
            # TRL's use_bias_correction_kl: the k3 of tokens sampled from pi_old, weighted by
            # r = pi_theta / pi_old to estimate KL(pi_theta || ref); on-policy r = 1 in value
            # but not in gradient (d r = r d logp), which adds kl * d logp.
            kl = kl * ratio
        per_token = l_pg + beta * kl

    with torch.no_grad():
        r = ratio.expand_as(logp)
        log_ratio = logp - old
        metrics = {
            "tokens": mask.sum(),
            "kl_old/k1": masked_mean(-log_ratio, mask),
            "kl_old/k3": masked_mean(log_ratio.expm1() - log_ratio, mask),
        }
        if loss == "ppo":
            low = (r < 1 - eps_low) & (adv < 0)
            high = (r > 1 + eps_high) & (adv > 0)
            metrics["clip_ratio/low"] = masked_mean(low.float(), mask)
            metrics["clip_ratio/high"] = masked_mean(high.float(), mask)
            metrics["clip_ratio/region"] = masked_mean((low | high).float(), mask)
            if delta is not None:
                bound = (ratio > delta) & (unclipped * adv < clipped * adv)
                metrics["delta_bound"] = masked_mean(bound.expand_as(logp).float(), mask)
        elif loss == "cispo":
            metrics["clip_ratio/high"] = masked_mean((r > eps_high).float(), mask)
        if ref is not None:
            metrics["kl_ref"] = masked_mean(k3, mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        if top_entropy_quantile < 1.0:
            metrics["entropy_mask/kept"] = masked_mean(kept, mask)
        if off_policy_mask_threshold is not None:
            metrics["off_policy_mask/kept"] = masked_mean(opm.expand_as(logp), mask)
        if tis_weights is not None:
            metrics["tis/mean"] = masked_mean(tis_weights.expand_as(logp), mask)
        if loss == "vespo":
            metrics["vespo/phi_mean"] = masked_mean(phi.expand_as(logp), mask)
    return per_token, metrics
