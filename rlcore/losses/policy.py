"""Per-token policy losses and how `policy_loss` composes them (SPEC sections 3 and 4).

`policy_loss` builds l [B, T] in the SPEC's order:
  0. r = exp(w), w from `log_importance_weights`: per token, per sequence (GSPO) or the sequence's
     value with each token's gradient (GSPO-token);
  1. l_pg from the loss named by `policy_loss` (LOSS_FUNCTIONS): `ppo_clip` (GRPO / DAPO /
     INTELLECT-2's delta), `cispo`, `sapo` or `vespo`, each with its equation and paper;
  2. the off-policy sequence mask, then the entropy mask (they multiply l_pg only; masks.py);
  3. the rollout importance-sampling correction, TIS (multiplies l_pg only; VESPO folds it into
     its sequence weight instead);
  4. + beta * k3 KL to the reference policy.
Its options are one `PolicyLossOptions`, the config's [loss] fields of the same names; its
metrics come from `metrics.policy_metrics`. Aggregation over tokens is a separate step:
`rlcore.losses.aggregate.aggregate_loss`.
"""

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlcore import RlcoreWarning
from rlcore.losses.aggregate import LOSS_TYPES
from rlcore.losses.masks import off_policy_mask
from rlcore.losses.metrics import policy_metrics

LOSSES = ("ppo", "cispo", "sapo", "vespo")  # the names loss.policy_loss takes (config.py's Literal)
LEVELS = ("token", "sequence", "sequence_token")


def log_importance_weights(logp: Tensor, old: Tensor, mask: Tensor, level: str = "token") -> Tensor:
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


@dataclass
class PolicyLossOptions:
    """`policy_loss`'s options: each field is the config's [loss] option of the same name, with
    its default (rlcore/options.py's LossArgs documents them); `from_config` copies them."""

    policy_loss: str = "ppo"                  # which of LOSSES gives l_pg
    importance_sampling_level: str = "token"  # LEVELS: the ratio per token or per sequence
    epsilon: float = 0.2                      # ppo: the lower clip, r >= 1 - epsilon
    epsilon_high: float | None = None         # ppo: the upper clip, r <= 1 + epsilon_high; cispo: the cap
    delta: float | None = None                # ppo: cap on the unclipped ratio (None = off)
    beta: float = 0.0                         # KL coefficient (0.0 = no KL term)
    use_bias_correction_kl: bool = False      # the KL term times r (TRL's)
    off_policy_mask_threshold: float | None = None  # the off-policy sequence mask's delta (None = off)
    sapo_temperature_pos: float = 1.0         # sapo: tau for A > 0
    sapo_temperature_neg: float = 1.05        # sapo: tau otherwise
    vespo_k_pos: float = 2.0                  # vespo: (k, lambda) for A >= 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0                  # vespo: (k, lambda) for A < 0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        if self.epsilon_high is None:  # as the config fills it
            self.epsilon_high = self.epsilon

    @classmethod
    def from_config(cls, loss_args) -> "PolicyLossOptions":
        """The options of the config's loss section (a `LossArgs`), each from its field of the same name."""
        return cls(**{field.name: getattr(loss_args, field.name) for field in dataclasses.fields(cls)})


@dataclass
class PolicyInputs:
    """What a policy loss reads from one micro-batch (`policy_loss` builds it)."""

    logp: Tensor                # [B, T] the current policy's log-probs, with grad
    old: Tensor                 # [B, T] pi_old's (no grad)
    ratio: Tensor               # [B, T], or [B, 1] per sequence: r = exp(log_importance_weights)
    advantages: Tensor          # [B, 1]
    mask: Tensor                # [B, T] in logp's dtype
    tis_weights: Tensor | None  # [B, T] or [B, 1], from masks.tis_weights


# Each policy loss maps (inputs, options) to its per-token term l_pg ([B, T], or [B, 1] for a
# sequence-level ratio) and its diagnostics: per-token tensors that `policy_metrics` averages.
PolicyGradientTerm = Callable[[PolicyInputs, PolicyLossOptions], tuple[Tensor, dict[str, Tensor]]]


def ppo_clip(inputs: PolicyInputs, options: PolicyLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped objective (Schulman et al. 2017, arXiv:1707.06347) with DAPO's decoupled
    clip range (arXiv:2503.14476) and INTELLECT-2's cap delta on the unclipped ratio
    (arXiv:2505.07291; with delta > 1 + epsilon_high, verl's dual clip at c = delta):
        l = -min(min(r, delta) A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    Diagnostics: clip_ratio/low (r < 1 - epsilon, A < 0), clip_ratio/high (r > 1 + epsilon_high,
    A > 0), clip_ratio/region (either: the clip removed the gradient), with delta delta_bound
    (tokens whose loss is -delta A)."""
    r, adv, low_bound, high_bound = inputs.ratio, inputs.advantages, 1 - options.epsilon, 1 + options.epsilon_high
    clipped = r.clamp(low_bound, high_bound) * adv
    unclipped = (r if options.delta is None else r.clamp(max=options.delta)) * adv
    low, high = (r < low_bound) & (adv < 0), (r > high_bound) & (adv > 0)
    clips = {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio/region": low | high}
    if options.delta is not None:
        clips["delta_bound"] = (r > options.delta) & (unclipped < clipped)
    return -torch.min(unclipped, clipped), clips


def cispo(inputs: PolicyInputs, options: PolicyLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the capped, detached ratio,
        l = -sg(min(r, epsilon_high)) A log pi
    epsilon_high is an absolute cap here (recommended 5.0). Diagnostics: clip_ratio/high, the
    tokens whose ratio is above the cap, whatever the sign of A."""
    ratio, cap = inputs.ratio, options.epsilon_high
    return -ratio.clamp(max=cap).detach() * inputs.advantages * inputs.logp, {"clip_ratio/high": ratio > cap}


def sapo(inputs: PolicyInputs, options: PolicyLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347): a sigmoid gate instead of a clip,
        l = -sigmoid(tau (r - 1)) (4 / tau) A,  tau = tau_pos if A > 0 else tau_neg
    No diagnostics."""
    adv = inputs.advantages
    tau = torch.full_like(adv, options.sapo_temperature_neg).masked_fill_(adv > 0, options.sapo_temperature_pos)
    return -torch.sigmoid(tau * (inputs.ratio - 1)) * (4 / tau) * adv, {}


def vespo(inputs: PolicyInputs, options: PolicyLossOptions) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO (arXiv:2602.10693): REINFORCE weighted by a detached gamma-shaped function of the
    whole sequence's ratio, which the TIS weights fold into (`vespo_weights`),
        l = -phi(w) A log pi
    Diagnostics: vespo/phi_mean."""
    phi = vespo_weights(inputs.advantages[:, 0], inputs.logp.detach() - inputs.old, inputs.mask, inputs.tis_weights,
                        options.vespo_k_pos, options.vespo_lambda_pos, options.vespo_k_neg, options.vespo_lambda_neg)
    return -phi * inputs.advantages * inputs.logp, {"vespo/phi_mean": phi}


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


LOSS_FUNCTIONS: dict[str, PolicyGradientTerm] = {"ppo": ppo_clip, "cispo": cispo, "sapo": sapo, "vespo": vespo}
OWN_TIS = ("vespo",)  # losses whose weight already holds the TIS weights: policy_loss does not apply them again


def check_loss_options(
    loss_type: str,
    *,
    policy_loss: str = "ppo",
    importance_sampling_level: str = "token",
    epsilon_high: float | None = None,
) -> None:
    """Validate option names once, before training, and warn about combinations that are legal
    but probably not what was meant, for code that calls the losses directly (the training loop
    gets the same checks from `rlcore.config.validation.validate`)."""
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
    options: PolicyLossOptions | None = None,
    ref: Tensor | None = None,
    tis_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_keep: Tensor | None = None,
    samp: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Per-token loss l [B, T] and its metrics, before aggregation (see module docstring).

    logp [B, T] current policy (with grad), old [B, T] pi_old (no grad; logp.detach() on-policy),
    advantages [B], mask [B, T]; ref [B, T] reference log-probs (needed when beta != 0),
    tis_weights [B, T] or [B, 1] from `masks.tis_weights`, entropy [B, T] of the current policy
    (for the metric), entropy_keep [B, T] from `masks.entropy_mask` (the entropy mask; None = off),
    samp [B, T] the rollout engine's log-probs (needed with off_policy_mask_threshold). Option
    names and risky combinations are checked once, by `check_loss_options` for direct callers
    and by `rlcore.config.validation.validate` in the training loop, not per micro-batch. The metrics
    are `metrics.policy_metrics`'. options None: PolicyLossOptions()'s defaults.
    """
    options = PolicyLossOptions() if options is None else options
    if options.policy_loss not in LOSSES:
        raise ValueError(f"unknown loss {options.policy_loss!r}; valid: {', '.join(LOSSES)}")
    if options.policy_loss not in LOSS_FUNCTIONS:  # a name added to LOSSES without its function
        raise NotImplementedError(f"policy_loss has no branch for loss {options.policy_loss!r}; add its function "
                                  f"to LOSS_FUNCTIONS beside ppo/cispo/sapo/vespo")
    if options.beta != 0.0 and ref is None:
        raise ValueError(f"beta={options.beta} needs ref, the reference policy's log-probs [B, T]")
    if options.off_policy_mask_threshold is not None and samp is None:
        raise ValueError(f"off_policy_mask_threshold={options.off_policy_mask_threshold} needs samp [B, T]")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}")
    mask = mask.to(logp.dtype)
    ratio = log_importance_weights(logp, old, mask, options.importance_sampling_level).exp()  # [B, T] or [B, 1]
    inputs = PolicyInputs(logp, old, ratio, advantages.to(logp.dtype)[:, None], mask, tis_weights)

    # 1. The policy-gradient term; sequence-level weights give one value per row.
    l_pg, diagnostics = LOSS_FUNCTIONS[options.policy_loss](inputs, options)
    l_pg = l_pg.expand_as(logp)
    # 2. Off-policy sequence mask, then the entropy mask (train only on high-entropy "forking" tokens).
    off_policy_keep = None
    if options.off_policy_mask_threshold is not None:
        off_policy_keep = off_policy_mask(advantages.to(logp.dtype), logp.detach(), samp, mask,
                                          options.off_policy_mask_threshold)
        l_pg = l_pg * off_policy_keep
    if entropy_keep is not None:
        l_pg = l_pg * entropy_keep
    # 3. Rollout importance-sampling correction (after clipping and the entropy mask).
    if tis_weights is not None and options.policy_loss not in OWN_TIS:
        l_pg = l_pg * tis_weights
    # 4. KL to the reference, k3 estimator (Schulman 2020; DeepSeekMath): >= 0, unbiased on-policy.
    # k3 = exp(x) - 1 - x, x = ref - logp; computed as expm1(x) - x since exp(x) - 1 rounds below 0 in fp32
    k3 = None if ref is None else torch.expm1(ref - logp) - (ref - logp)
    per_token = l_pg
    if options.beta != 0.0:
        # TRL's use_bias_correction_kl: the k3 of tokens sampled from pi_old, weighted by
        # r = pi_theta / pi_old to estimate KL(pi_theta || ref); on-policy r = 1 in value
        # but not in gradient (d r = r d logp), which adds kl * d logp.
        kl = k3 * ratio if options.use_bias_correction_kl else k3
        per_token = l_pg + options.beta * kl
    metrics = policy_metrics(logp, old, mask, diagnostics, k3=k3, entropy=entropy, entropy_keep=entropy_keep,
                             off_policy_keep=off_policy_keep, tis_weights=tis_weights)
    return per_token, metrics
