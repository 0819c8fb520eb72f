"""The built-in reward functions and the answer parsing they score with.

- `accuracy`: 1.0 when a completion's final answer (`extract_answer`: an `<answer>` tag,
  `\\boxed{}`, `####` or the last number) matches the `answer` column; the arithmetic task's
  reward and the default for JSONL data (`accuracy_on` reads another column).
- `format`: 1.0 for R1's `<think>...</think><answer>...</answer>` layout.
- `countdown`: 1.0 when the proposed expression uses each number once and hits the target,
  evaluated with `ast`, never `eval`.
- `soft_overlong_punishment`: DAPO's length penalty (lengths.py), made from two [loss] options.

Each has the shape rewards.py describes, `fn(prompts, completions, **columns) -> list[float | None]`;
`REWARDS` maps the names a config gives (loss.reward_funcs) to them, and for a built-in with
parameters to the factory that makes it from them (`scoring.get_reward_funcs` calls it).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from fractions import Fraction

from rlcore.rewards.lengths import soft_overlong_punishment

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number: optional sign (ASCII or Unicode minus, not a binary minus as in "7-3"), thousands
# commas, decimals, or a bare fraction part (".5").
NUMBER = re.compile(r"(?:(?<![\w.)])[-\u2212])?(?:\d+(?:,\d{3})*(?:\.\d+)?|(?<![\d,])\.\d+)")
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
    marked = marked_answer(text)
    if marked is not None:
        return marked
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def marked_answer(text: str) -> str | None:
    """Forms 1-3 of `extract_answer` (an answer the text marks as such); None without one."""
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        rest = text.rsplit("####", 1)[1].strip()
        return rest.splitlines()[0].strip() if rest else None
    return None


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
    """`"1,000"`, `"$42"`, `"-3.50"`, `".5"`, `"7."` as exact numbers; None when `s` is not a
    number (commas count only as thousands separators: `"1,2,3"` is not 123)."""
    s = s.strip().replace("\u2212", "-").removeprefix("$").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return Fraction(s) if re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)", s) else None


def answers_match(completion: str, gold) -> bool:
    """Whether a completion's final answer is the reference answer `gold`.

    `gold` is unwrapped first when it marks its answer (`\\boxed{42}`, `#### 42`). A numeric
    gold must equal the last number of the completion's `extract_answer` exactly (`"1,000"` =
    `"1000.0"`); any other gold must equal the completion's marked answer (`marked_answer`),
    or without one its whole text, up to whitespace (`"Paris"`, `"x = 5"`, `"1/2"`).
    """
    gold = str(gold).strip()
    gold = marked_answer(gold) or gold
    gold_number = parse_number(gold)
    if gold_number is not None:
        pred = extract_answer(completion)
        numbers = NUMBER.findall(pred) if pred is not None else []
        return bool(numbers) and parse_number(numbers[-1]) == gold_number
    pred = marked_answer(completion)
    return " ".join((completion if pred is None else pred).split()) == " ".join(gold.split())


def accuracy(prompts: list, completions: list, answer: list | None = None, **columns) -> list[float | None]:
    """1.0 when the completion's final answer matches the `answer` column (`answers_match`: a
    GSM8K-style "... #### 42" is compared as 42), else 0.0. The training loop reads another
    column when data.answer_column names one (`accuracy_on`).

    None for every row when there is no `answer` column, and for rows whose answer is None.
    """
    if answer is None:
        return [None] * len(completions)
    return [None if gold is None else float(answers_match(completion_text(completion), gold))
            for completion, gold in zip(completions, answer)]


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


REWARDS: dict[str, Callable] = {"accuracy": accuracy, "format": format_reward, "countdown": countdown,
                                "soft_overlong_punishment": soft_overlong_punishment}  # a factory: (L_max, L_cache)


def accuracy_on(column: str) -> Callable[..., list]:
    """`accuracy` against the reference answers of dataset column `column` (data.answer_column;
    "" = none, every score None). The columns reach reward functions as the dataset has them, so
    a column other than `answer` is read here rather than renamed."""
    if column == "answer":
        return accuracy

    def accuracy_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        return accuracy(prompts, completions, answer=columns.get(column) if column else None)
    accuracy_reward.__name__ = "accuracy"  # as errors and logs name it
    return accuracy_reward
