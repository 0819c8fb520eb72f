"""Rewards -> group-relative advantages (SPEC section 2).

GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) replaces PPO's value function with the
statistics of G completions of the same prompt:  A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4).
Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the std: A_i = r_i - mean_g(r).
The rewards R [N, F] come from `rlcore.rewards.scoring.score_completions`.
"""

import torch
from torch import Tensor

SCALE_REWARDS = {"group": "group", True: "group", "batch": "batch", "none": "none", False: "none"}
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _nanstd(x: Tensor, dim: int) -> Tensor:
    """Bessel-corrected std ignoring NaN; NaN where fewer than two values are present."""
    count = (~x.isnan()).sum(dim, keepdim=True)
    dev = x - x.nanmean(dim, keepdim=True)
    var = dev.square().nansum(dim, keepdim=True) / (count - 1)
    return var.where(count > 1, torch.nan).sqrt().squeeze(dim)


def varied_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """[N / G] bool: which groups of G contiguous rows of r [N] (NaN = unscored) hold at least two
    distinct valid rewards. The others teach nothing (their advantages are all 0); DAPO's dynamic
    sampling keeps only these."""
    groups = rewards.view(-1, num_generations)
    valid = ~groups.isnan()
    return groups.where(valid, -torch.inf).amax(dim=1) > groups.where(valid, torch.inf).amin(dim=1)


def weighted_rewards(rewards: Tensor, weights: Tensor) -> Tensor:
    """r [N] = nansum_f(w_f * R_f) from R [N, F] and w [F] (SPEC 2), NaN where every function
    returned None (no function could score the completion)."""
    r = (rewards * weights).nansum(dim=1)
    r[rewards.isnan().all(dim=1)] = torch.nan
    return r


def compute_advantages(
    rewards: Tensor,
    num_generations: int,
    reward_weights: list[float] | None = None,
    scale_rewards: str | bool = "group",
    reward_names: list[str] | None = None,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> tuple[Tensor, dict]:
    """Group-relative advantages A [N] from per-function rewards R [N, F] (NaN = unscorable).

    "sum_then_normalize" (SPEC 2): r = nansum_f(w_f * R_f) (NaN where every function returned
    None); groups are G contiguous rows; A = (r - nanmean_g) / (nanstd_g + 1e-4) for "group"
    (True), nanstd over the whole batch for "batch", no division for "none" (False). A group
    whose valid rewards are all equal gets exactly 0.
    "normalize_then_sum" (GDPO, TRL's multi_objective_aggregation; not in SPEC): each function's
    rewards are normalised within each group first, z_f = (R_f - nanmean_g) / (nanstd_g + 1e-4),
    then s = nansum_f(w_f * z_f) and A = (s - nanmean(s)) / (nanstd(s) + 1e-4) over the whole
    batch (scale_rewards does not apply), so one function's scale cannot drown the others'.
    NaN advantages become 0. Returns (A, stats) with python-float stats:
    reward/mean, reward/std, reward/<name>/mean and /std per function (names default to "0", "1", ...),
    frac_reward_zero_std (groups with fewer than two distinct valid rewards), advantage/mean,
    advantage/abs_mean.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, F], got shape {tuple(rewards.shape)}")
    n, num_funcs = rewards.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} completions do not split into groups of num_generations="
                         f"{num_generations}; the generation batch must be a multiple of it")
    if reward_weights is None:
        reward_weights = [1.0] * num_funcs
    if len(reward_weights) != num_funcs:
        raise ValueError(f"reward_weights has {len(reward_weights)} entries but there are "
                         f"{num_funcs} reward functions; give one weight per function")
    if reward_names is not None and len(reward_names) != num_funcs:
        raise ValueError(f"reward_names has {len(reward_names)} entries for {num_funcs} reward functions")
    if multi_objective_aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {', '.join(AGGREGATIONS)}, "
                         f"got {multi_objective_aggregation!r}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be 'group' (True), 'batch' or 'none' (False), "
                         f"got {scale_rewards!r}")
    scale = SCALE_REWARDS[scale_rewards]
    rewards = rewards.double()
    weights = torch.tensor(reward_weights, dtype=torch.float64, device=rewards.device)

    r = weighted_rewards(rewards, weights)
    groups = r.view(-1, num_generations)
    mean = groups.nanmean(dim=1, keepdim=True)
    adv = groups - mean
    if scale == "group":
        adv = adv / (_nanstd(groups, dim=1)[:, None] + 1e-4)
    elif scale == "batch":
        adv = adv / (_nanstd(r, dim=0) + 1e-4)
    # (r - mean) of equal floats is not exactly 0 in floating point, so zero such groups explicitly
    zero_std = ~varied_groups(r, num_generations)
    adv = adv.masked_fill(zero_std[:, None] | adv.isnan(), 0.0).view(-1)
    if multi_objective_aggregation == "normalize_then_sum":
        per_func = rewards.view(-1, num_generations, num_funcs)
        z = (per_func - per_func.nanmean(dim=1, keepdim=True)) / (_nanstd(per_func, dim=1)[:, None] + 1e-4)
        s = (z * weights).nansum(dim=2).view(-1)
        s[rewards.isnan().all(dim=1)] = torch.nan
        adv = (s - s.nanmean()) / (_nanstd(s, dim=0) + 1e-4)
        adv = adv.nan_to_num(nan=0.0)

    names = reward_names or [str(f) for f in range(num_funcs)]  # .item(): host syncs, once per round
    stats = {
        "reward/mean": r.nanmean().item(),
        "reward/std": _nanstd(r, dim=0).item(),
        **{f"reward/{name}/mean": rewards[:, f].nanmean().item() for f, name in enumerate(names)},
        **{f"reward/{name}/std": _nanstd(rewards[:, f], dim=0).item() for f, name in enumerate(names)},
        "frac_reward_zero_std": zero_std.double().mean().item(),
        "advantage/mean": adv.mean().item(),
        "advantage/abs_mean": adv.abs().mean().item(),
    }
    return adv.float(), stats
