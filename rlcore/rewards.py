"""Built-in reward functions, shaped like TRL's: `fn(prompts, completions, **columns) -> list[float | None]`.

`completions[i]` is the decoded completion (a string, or a list of chat messages whose last
`content` is used). Each dataset column arrives as a keyword argument holding one value per
completion (a prompt's columns repeated for its G completions). A function returns one float
per completion, or None where it cannot score that completion (for example, the row has no
reference answer); SPEC section 2 says how None enters the advantages.

Your own reward function has the same shape; name it in the config as "module:function".
"""

from __future__ import annotations

import ast
import importlib
import re
from fractions import Fraction
from typing import Callable

RewardFunc = Callable[..., list]

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number: optional sign (not a binary minus, as in "7-3"), thousands commas, decimals.
NUMBER = re.compile(r"(?:(?<![\w.)])-)?\d+(?:,\d{3})*(?:\.\d+)?")
THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
MAX_EXPRESSION_CHARS = 100  # countdown answers are short; longer input is rejected before parsing


def completion_text(completion) -> str:
    """The text of a completion: a string, or the last message's content in a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return completion["content"]
    return completion[-1]["content"]


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, from the first of these forms that occurs (the last match of it):

    1. `<answer>...</answer>` (R1 style)  2. `\\boxed{...}` (math)  3. `#### ...` (GSM8K)
    4. the last number in the text. None when there is none of these.
    """
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        rest = text.rsplit("####", 1)[1].strip()
        return rest.splitlines()[0].strip() if rest else None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def parse_number(s: str) -> Fraction | None:
    """`"1,000"`, `"$42"`, `"-3.50"`, `"7."` as exact numbers; None when `s` is not a number."""
    s = s.strip().replace(",", "").removeprefix("$").rstrip(".")
    try:
        return Fraction(s) if re.fullmatch(r"-?\d+(\.\d+)?", s) else None
    except ValueError:
        return None


def answers_match(pred: str, gold) -> bool:
    """Numeric gold: the last number in `pred` equals it exactly. Otherwise: equal up to whitespace."""
    gold = str(gold).strip()
    gold_number = parse_number(gold)
    if gold_number is not None:
        numbers = NUMBER.findall(pred)
        return bool(numbers) and parse_number(numbers[-1]) == gold_number
    return " ".join(pred.split()) == " ".join(gold.split())


def accuracy(prompts: list, completions: list, answer: list | None = None, **columns) -> list[float | None]:
    """1.0 when the completion's final answer (`extract_answer`) matches the `answer` column, else 0.0.

    None for every row when there is no `answer` column, and for rows whose answer is None.
    """
    if answer is None:
        return [None] * len(completions)
    scores = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            scores.append(None)
            continue
        pred = extract_answer(completion_text(completion))
        scores.append(float(pred is not None and answers_match(pred, gold)))
    return scores


def format_reward(prompts: list, completions: list, **columns) -> list[float]:
    """1.0 when the completion is exactly `<think>...</think>` then `<answer>...</answer>`, each once."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        ok = (THINK_ANSWER.fullmatch(text) is not None and text.count("<think>") == 1
              and text.count("<answer>") == 1)
        scores.append(float(ok))
    return scores


def evaluate_expression(expr: str) -> tuple[Fraction, list[int]]:
    """Value (exact) and the integer literals of an arithmetic expression of ints, + - * / and parentheses.

    Parsed with `ast`, never `eval`: anything else (names, calls, unary minus, powers, floats,
    over MAX_EXPRESSION_CHARS) raises ValueError, as does division by zero.
    """
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an expression: {expr!r}") from e
    used = []
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return ops[type(node.op)](left, right)
        raise ValueError(f"only integers, + - * / and parentheses are allowed, not {ast.dump(node)[:40]}")

    return value(tree.body), used


def countdown_expression(text: str) -> str:
    """The expression a countdown completion proposes: the last `<answer>` tag, else the first line;
    the left side when it is written as an equation (`3*4+2=14`)."""
    tags = ANSWER_TAG.findall(text)
    expr = tags[-1] if tags else next((ln for ln in text.splitlines() if ln.strip()), "")
    return expr.split("=")[0].strip()


def check_countdown(expr: str, numbers: list[int], target: int) -> bool:
    """Whether `expr` uses each of `numbers` exactly once (and no other number) and equals `target`."""
    try:
        val, used = evaluate_expression(expr)
    except ValueError:
        return False
    return sorted(used) == sorted(numbers) and val == target


def countdown(prompts: list, completions: list, numbers: list | None = None,
              target: list | None = None, **columns) -> list[float | None]:
    """1.0 when the completion's expression uses each of `numbers` once and equals `target`, else 0.0.

    None for every row when the `numbers` or `target` column is missing.
    """
    if numbers is None or target is None:
        return [None] * len(completions)
    return [float(check_countdown(countdown_expression(completion_text(c)), nums, tgt))
            for c, nums, tgt in zip(completions, numbers, target)]


REWARDS: dict[str, RewardFunc] = {"accuracy": accuracy, "format": format_reward, "countdown": countdown}


def get_reward_funcs(names: list[str]) -> list[RewardFunc]:
    """The reward functions for config names: built-in (REWARDS) or "module:function" of your own."""
    funcs = []
    for name in names:
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except Exception as e:  # ImportError, AttributeError, or any error the module raises
                raise ValueError(f"loss.reward_funcs entry {name!r} cannot be loaded ({type(e).__name__}: {e}); give "
                                 f"'module:function' with the module importable (on PYTHONPATH)") from e
            if not callable(fn):
                raise ValueError(f"loss.reward_funcs entry {name!r} is a {type(fn).__name__}, not a function")
            funcs.append(fn)
        elif name in REWARDS:
            funcs.append(REWARDS[name])
        else:
            raise ValueError(f"unknown reward {name!r} in loss.reward_funcs; built-in rewards are "
                             f"{', '.join(REWARDS)}, or give your own as 'module:function'")
    return funcs
