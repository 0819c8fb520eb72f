"""Calling reward functions as TRL does: `fn(prompts, completions, **kwargs) -> list[float | None]`.

The keywords are TRL's (`reward_inputs` builds them):
- `prompts`: each completion's prompt as the dataset holds it (a string or a list of messages);
- `completions`: the decoded completion, a string, or `[{"role": "assistant", "content": text}]`
  when the prompt is a list of messages (TRL's conversational format);
- `completion_ids`: its token ids (a list of ints per completion);
- `trainer_state`: an object with `global_step` (optimizer steps done) and `max_steps`;
- `log_metric(name, value)`: adds `name` to the step's metrics (the mean of the values logged
  while scoring the round, on all ranks; one of rlcore's own metric names is an error);
  `log_extra(column, values)` adds a column (one value per completion) to completions.jsonl
  when train.log_completions is on, else it is dropped;
- every dataset column, one value per completion, as the file holds it (a prompt's columns
  repeated for its G completions; None where a row lacks a column other rows have). A column
  named as one of the keywords above is an error when the dataset loads;
- with tools (rollout.tools), `tool_mask`: per completion, 1 for each of its `completion_ids`
  the model wrote and 0 for each of a tool result's (TRL keeps it to itself; rlcore's
  `soft_overlong_punishment` counts the model's tokens with it), and with an environment
  factory `environments`, one per completion.
A function with `**kwargs` receives all of them; one without gets those it names. It returns
one float (or bool) per completion, or None (or NaN) where it cannot score that completion (for
example, the row has no reference answer); SPEC section 2 says how None enters the advantages.
An infinite score (or one past float32's range) is an error. Async functions are awaited.
`score_completions` makes these calls and stacks the scores into R [N, F].

The built-in ones (`accuracy`, `format`, `countdown`) are in answers.py, `soft_overlong_punishment`
is in lengths.py, and a reward model (a sequence classifier's checkpoint directory) is
reward_model.py's `RewardModel`. Your own has the same shape; name it in the config as
"module:function", with the module importable: from the current directory (the command line puts
it on the path) or PYTHONPATH. An object with `__call__` works too (name the instance, not its
class). Its signature is checked against these keywords before the run starts
(`check_reward_funcs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import importlib
import inspect
import numbers
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rlcore.rewards.answers import REWARDS, accuracy_on

RewardFunc = Callable[..., list]
NOT_COLUMNS = ("prompt", "prompt_ids")  # example keys that are not passed as columns


@dataclass
class RewardState:
    """`trainer_state` for reward functions: the fields of TRL's TrainerState (transformers'
    `TrainerState`) that reward functions read, such as a schedule over the run."""

    global_step: int
    """optimizer steps done before this round"""
    max_steps: int
    """optimizer steps the run takes"""
    epoch: float = 0.0
    """passes over the training prompts done before this round (fractional, as TRL counts them)"""
    num_train_epochs: float = 1.0
    """train.num_train_epochs"""

    def __getattr__(self, name: str):  # only for names that are not fields
        fields = ", ".join(f.name for f in dataclasses.fields(self))
        raise AttributeError(f"trainer_state.{name}: rlcore's trainer_state has {fields} (TRL passes transformers' "
                             f"whole TrainerState; these are the fields a reward function reads)")


# How rlcore calls a reward function: from its own files, through asyncio for an async one.
CALLER_DIRS = tuple(os.path.dirname(os.path.realpath(path)) + os.sep for path in (__file__, asyncio.__file__))


class RewardFunctionError(RuntimeError):
    """A reward function raised `error` while scoring: `str(self)` names the function, the error
    and the sample. `frames` are the traceback entries of the function's own code, from the
    first one outside rlcore and asyncio on (rlcore's call into it left out), and `trace` those
    formatted as a traceback ("" when there are none), to print under the message in place of
    the whole chained traceback."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        frames = traceback.extract_tb(error.__traceback__) if error is not None else []
        first = next((i for i, frame in enumerate(frames)
                      if not os.path.realpath(frame.filename).startswith(CALLER_DIRS)), len(frames))
        self.frames = traceback.StackSummary.from_list(frames[first:])
        self.trace = ("Traceback of the reward function (most recent call last):\n" + "".join(self.frames.format())
                      if self.frames else "")


def reward_extras(completion_ids: list[list[int]], trainer_state: RewardState,
                  log_metric: Callable[[str, float], None], log_extra: Callable[[str, list], None]) -> dict:
    """What a reward function gets besides prompts, completions and the dataset's columns, by
    keyword (REWARD_EXTRAS, the names the signature check allows)."""
    return {"completion_ids": completion_ids, "trainer_state": trainer_state, "log_metric": log_metric,
            "log_extra": log_extra}


REWARD_EXTRAS = tuple(inspect.signature(reward_extras).parameters)
REWARD_KEYWORDS = ("prompts", "completions", *REWARD_EXTRAS)  # what no dataset column may be named (data.load_jsonl)


def dataset_columns(examples: list[dict]) -> list[str]:
    """The columns of a dataset: every key of any example (in order of first appearance)."""
    return list(dict.fromkeys(k for ex in examples for k in ex if k not in NOT_COLUMNS))


def reward_inputs(rows: list[dict], texts: list[str], columns: list[str]) -> tuple[list, list, dict[str, list]]:
    """(prompts, completions, columns) for the reward functions, as TRL passes them.

    A completion of a prompt given as chat messages becomes `[{"role": "assistant", "content":
    text}]`; one of several turns (tools) is already its list of messages. Every dataset column
    (`dataset_columns`) is passed, None where a row lacks it.
    """
    prompts = [ex["prompt"] for ex in rows]
    completions = [[{"role": "assistant", "content": text}] if isinstance(ex["prompt"], list) and isinstance(text, str)
                   else text for ex, text in zip(rows, texts)]
    return prompts, completions, {k: [ex.get(k) for ex in rows] for k in columns}


FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards are stored as float32


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
    log_metric, log_extra, with an environment factory environments, and with tools tool_mask, one
    per row); a function without **kwargs gets only the arguments it names. An
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
        per_row = [key for key in kwargs if key in columns or
                   key in ("prompts", "completions", "completion_ids", "environments", "tool_mask")]
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


def names_reward_model(name: str) -> bool:
    """Whether a loss.reward_funcs entry names a reward model's directory: neither a built-in
    reward nor "module:function"."""
    return ":" not in name and name not in REWARDS


def get_reward_funcs(names: list[str], answer_column: str = "answer",
                     load_reward_model: Callable[[str], RewardFunc] | None = None,
                     soft_punish: tuple[int | None, int | None] | None = None) -> list[RewardFunc]:
    """The reward functions for config names: built-in (REWARDS), "module:function" of your own, or
    a reward model's checkpoint directory, which `load_reward_model` loads (setup passes
    reward_model.RewardModel.load with the run's device and dtype). `answer_column`: the dataset
    column with the reference answers, which `accuracy` compares with; `soft_punish`: (L_max,
    L_cache) of `soft_overlong_punishment` (loss.soft_punish_max_completion_len, loss.soft_punish_cache)."""
    funcs = []
    for name in names:
        if ":" in name:
            funcs.append(load_reward_func(name))
        elif name == "accuracy":
            funcs.append(accuracy_on(answer_column))
        elif name == "soft_overlong_punishment":
            if soft_punish is None or soft_punish[1] is None:
                raise ValueError("the soft_overlong_punishment reward needs its L_cache: set loss.soft_punish_cache")
            funcs.append(REWARDS[name](*soft_punish))
        elif name in REWARDS:
            funcs.append(REWARDS[name])
        elif load_reward_model is not None and Path(name).is_dir():
            funcs.append(load_reward_model(name))
        else:
            raise ValueError(f"unknown reward {name!r} in loss.reward_funcs; built-in rewards are "
                             f"{', '.join(REWARDS)}, or give your own as 'module:function', or a reward model's "
                             f"checkpoint directory")
    return funcs


def load_reward_func(name: str) -> RewardFunc:
    """The reward function a "module:function" name gives: a function, or an object with __call__
    (TRL takes any callable); not a class, which a call would construct rather than score with."""
    module_name, _, attr = (part.strip() for part in name.partition(":"))  # "mod: fn" means mod:fn
    if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):
        module = Path(module_name).with_suffix("").name if module_name.endswith(".py") else Path(module_name).name
        raise ValueError(f"loss.reward_funcs entry {name!r} names a file; name its module: '{module}:{attr}', with "
                         f"the file's directory the current one (or on PYTHONPATH)")
    fix = ("put a def in a .py file and name it 'module:function' (def my_reward(prompts, completions, "
           "**kwargs) in my_rewards.py is 'my_rewards:my_reward')")
    if re.match(r"\s*lambda\b", name):
        raise ValueError(f"loss.reward_funcs entry {name!r} is a lambda; a config names a function and cannot "
                         f"hold code (a lambda or other expression): {fix}")
    not_a_name = next((part for part in (*module_name.split("."), attr) if not part.isidentifier()), None)
    if not_a_name is not None:
        raise ValueError(f"loss.reward_funcs entry {name!r} is not 'module:function': {not_a_name!r} is not a "
                         f"Python name, and a config cannot hold code (a lambda or other expression): {fix}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error the module raises
        missing = e.name if isinstance(e, ModuleNotFoundError) else None
        if missing is not None and not (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(f"loss.reward_funcs entry {name!r}: module {module_name} was found, but it imports "
                             f"{missing}, which is not installed (ModuleNotFoundError: {e}); install it (pip install "
                             f"{missing.partition('.')[0]}, if that is its package's name)") from e
        raise ValueError(f"loss.reward_funcs entry {name!r} cannot be loaded ({type(e).__name__}: {e}); give "
                         f"'module:function' with the module importable (from the current directory or "
                         f"PYTHONPATH)") from e
    if not hasattr(module, attr):
        raise ValueError(f"loss.reward_funcs entry {name!r}: " + missing_attribute(module, module_name, attr))
    fn = getattr(module, attr)
    if inspect.isclass(fn):
        raise ValueError(f"loss.reward_funcs entry {name!r} is a class; calling it would create an object, not "
                         f"score the completions: create an instance at module level in {module_name} "
                         f"(reward = {attr}()) and name that instance ('{module_name}:reward')")
    if not callable(fn):
        raise ValueError(f"loss.reward_funcs entry {name!r} is not a function but {fn!r:.60} "
                         f"(type {type(fn).__name__}); name a function defined in {module_name}")
    return fn


def missing_attribute(module, module_name: str, attr: str) -> str:
    """Why `attr` is not in `module`, naming the file that was imported: a file of that name in the
    current directory that a standard or installed module of the same name shadows (they come
    before the current directory on the path), or a typo (the nearest name)."""
    imported = getattr(module, "__file__", None)
    local = Path.cwd() / (module_name.replace(".", "/") + ".py")
    problem = (f"module {module_name!r} has no attribute {attr!r}; {module_name!r} was imported from "
               f"{imported or 'Python itself (a built-in module)'}")
    if local.is_file() and not (imported and local.samefile(imported)):
        return (f"{problem}, not from {local}: that file is shadowed by the module of the same name (the standard "
                f"library and installed packages come before the current directory), so rename {local.name} to a "
                f"name no installed module has (e.g. my_{local.name}) and name the function by that module")
    close = difflib.get_close_matches(attr, [n for n in vars(module) if not n.startswith("_")], n=1)
    return problem + (f"; did you mean {close[0]!r}?" if close else "; name a function defined there")
