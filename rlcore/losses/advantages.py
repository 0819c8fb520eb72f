"""Rewards -> group-relative advantages (SPEC section 2).

GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) replaces PPO's value function with the
statistics of G completions of the same prompt:  A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4).
Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the std: A_i = r_i - mean_g(r).
"""

import asyncio
import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence, Set

import torch
from torch import Tensor

from rlcore.rewards import RewardFunctionError

FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards are stored as float32
SCALE_REWARDS = {"group": "group", True: "group", "batch": "batch", "none": "none", False: "none"}
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def score_completions(
    reward_funcs: Sequence[Callable],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    on_error: str = "raise",
    extra: dict | None = None,
    first_row: int = 0,
) -> Tensor:
    """Call each reward function TRL-style and stack the scores into R [N, F] (NaN = None).

    Each function is called as fn(prompts=..., completions=..., **extra, **columns), where
    `extra` holds what TRL passes besides the columns (completion_ids, trainer_state,
    log_metric, log_extra); a function without **kwargs gets only the arguments it names. An
    async function is awaited. It must return one number (bools count as 0/1) or None per
    completion, as a list, tuple, numpy array or 1-D tensor; NaN counts as None (TRL turns None
    into NaN); an infinite score, or one past float32's range, is an error. A function that
    raises is re-run one sample at a time to name the offending sample in a RewardFunctionError,
    which holds the function's own traceback frames; with on_error="none" the
    failing samples score None instead. A function whose signature cannot take these arguments is an error
    either way. Errors number the samples from `first_row` (a rank's first row of the round).
    """
    if on_error not in ("raise", "none"):
        raise ValueError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    n = len(completions)
    scores = torch.full((n, len(reward_funcs)), torch.nan)
    for f, fn in enumerate(reward_funcs):
        name = _name(fn)
        kwargs = _arguments_for(fn, name, {"prompts": prompts, "completions": completions, **(extra or {}),
                                           **columns})
        per_row = [key for key in kwargs if key in columns or key in ("prompts", "completions", "completion_ids")]
        try:
            values = _call(fn, kwargs)
        except ImportError as err:  # a package it needs is missing: no sample would score, reward_on_error or not
            install = f" (pip install {err.name})" if err.name else ""
            raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err}; install the "
                                      f"package it imports{install} and run again", err) from err
        except Exception as err:
            values = _score_one_by_one(fn, name, kwargs, per_row, n, on_error, err, first_row)
        for i, value in enumerate(_check_scores(name, values, n, completions, first_row)):
            if value is not None:
                scores[i, f] = float(value)
    return scores


def check_reward_funcs(reward_funcs: Sequence[Callable], keywords: Sequence[str]) -> None:
    """Before any scoring: raise the TypeError `score_completions` would raise for a function
    that cannot be called with `keywords` (prompts, completions, the extras and the columns),
    naming the function and the parameter."""
    for fn in reward_funcs:
        _arguments_for(fn, _name(fn), dict.fromkeys(keywords))


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _arguments_for(fn: Callable, name: str, available: dict) -> dict:
    """The keyword arguments of `available` that `fn` takes: all of them with **kwargs (as TRL
    requires), else those it names. Raises TypeError, naming the parameter, when `fn` requires
    one that is not available, or when `fn` is a class (a call would construct it, not score)."""
    if inspect.isclass(fn):
        raise TypeError(f"reward function {name} is a class; calling it would create an object, not score the "
                        f"completions: pass an instance (reward = {name}()), whose __call__ scores")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: pass everything
        return available
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        kwargs = available
    else:
        kwargs = {k: v for k, v in available.items() if k in signature.parameters}
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        fix = "rename its parameters to these, or give them defaults"
        if not kwargs:  # no parameter is a reward keyword or a column: a factory's settings, as TRL's get_*_reward
            fix = (f"its parameters look like settings of a factory that makes a reward function; make one in a "
                   f"module of your own, reward = {name}(...), and name that, 'my_rewards:reward'")
        raise TypeError(f"reward function {name} cannot be called with the arguments rlcore passes ({err}); "
                        f"it is called with keywords {', '.join(available)} (the last ones are the dataset's "
                        f"columns), as TRL calls it: {fix}") from None
    return kwargs


def _call(fn: Callable, kwargs: dict):
    """fn(**kwargs), awaited when fn is async."""
    values = fn(**kwargs)
    if inspect.isawaitable(values):
        async def wait():
            return await values
        values = asyncio.run(wait())
    return values


def _check_scores(name: str, values, n: int, completions: list | None = None, first: int = 0) -> list:
    """Validate one reward function's output: a sequence of n numbers or None (`completions`,
    when given, name the sample of an infinite score; samples are numbered from `first`)."""
    if isinstance(values, (str, bytes, Mapping, Set)) or not hasattr(values, "__len__"):
        factory = (f" ({name} looks like a factory that makes a reward function, as TRL's get_*_reward are: make "
                   f"one in a module of your own, reward = {name}(...), and name that, 'my_rewards:reward')"
                   if callable(values) else "")
        raise TypeError(f"reward function {name} returned {type(values).__name__}; "
                        f"it must return a list of {n} floats or None, one per completion in order{factory}")
    if isinstance(values, Tensor) and values.dim() != 1:
        raise TypeError(f"reward function {name} returned a tensor of shape {tuple(values.shape)}; "
                        f"it must return one number per completion ({n})")
    values = [v.item() if hasattr(v, "item") and getattr(v, "ndim", 1) == 0 else v
              for v in values]  # a list, tuple, numpy array or tensor; numpy / torch scalars -> Python
    if len(values) != n:
        raise ValueError(f"reward function {name} returned {len(values)} scores for {n} "
                         "completions; it must return one float or None per completion")
    for i, value in enumerate(values):
        if value is not None and not isinstance(value, numbers.Real):
            raise TypeError(f"reward function {name} returned {value!r} ({type(value).__name__}) "
                            f"for sample {first + i}; expected a float or None")
        if value is not None and abs(value) > FLOAT32_MAX:  # False for NaN; exact for ints past any float
            sample = "" if completions is None else f" (completion={_short(completions[i])})"
            raise ValueError(f"reward function {name} returned {_short(value, 40)} for sample {first + i}{sample}; "
                             f"scores must be finite in float32, |score| <= {FLOAT32_MAX:.3g} (an infinite reward "
                             f"zeroes its whole group's advantages): return None where a completion cannot be scored")
    return values


def _score_one_by_one(fn, name, kwargs, per_row, n, on_error, batch_err, first_row: int = 0) -> list:
    """Re-run `fn` per sample after it raised on the batch: name the culprit, or score it None.
    `per_row`: the keys of `kwargs` that hold one value per completion (the rest are passed as is)."""
    values = []
    for i in range(n):
        one = {**kwargs, **{key: [kwargs[key][i]] for key in per_row}}
        try:
            value = _call(fn, one)
        except Exception as err:
            if on_error == "none":
                values.append(None)
                continue
            raise RewardFunctionError(
                f"reward function {name} raised {type(err).__name__}: {err} on sample {first_row + i}: "
                f"prompt={_short(kwargs.get('prompts', ['?'] * n)[i])}, "
                f"completion={_short(kwargs.get('completions', ['?'] * n)[i])}. Fix the "
                "function, or score failures as None (on_error='none'; in a config: --set "
                "loss.reward_on_error=none)", err) from err
        values += _check_scores(name, value, 1, [kwargs.get("completions", ["?"] * n)[i]], first_row + i)
    if on_error == "raise":
        raise RewardFunctionError(f"reward function {name} raised {type(batch_err).__name__}: {batch_err} "
                                  f"on the batch of {n} but on no single sample", batch_err) from batch_err
    return values


def _short(x, limit: int = 200) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


def _nanstd(x: Tensor, dim: int) -> Tensor:
    """Bessel-corrected std ignoring NaN; NaN where fewer than two values are present."""
    count = (~x.isnan()).sum(dim, keepdim=True)
    dev = x - x.nanmean(dim, keepdim=True)
    var = dev.square().nansum(dim, keepdim=True) / (count - 1)
    return var.where(count > 1, torch.nan).sqrt().squeeze(dim)


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
    valid = ~groups.isnan()
    top = groups.where(valid, -torch.inf).amax(dim=1)
    bottom = groups.where(valid, torch.inf).amin(dim=1)
    zero_std = ~(top > bottom)
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
