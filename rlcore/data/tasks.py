"""Synthetic verifiable tasks, generated in-process and deterministic from a seed.

Prompts and answers are a few characters long so that the tiny embedded model (one token per
character) can learn them on a CPU in minutes; `arithmetic_question` is for a real model.

- `arithmetic`: `"27+35="` -> `"62"`; operands 0..49, addition (subtraction available, never negative).
  Scored by the `accuracy` reward (answers.py).
- `arithmetic_question`: `"What is 7 - 3? Answer with only the number."` -> `"4"`; one-digit
  operands, + and - (never negative), asked in words for a small instruct model (SmolLM2-135M,
  configs/smollm2-arithmetic.toml). Scored by `accuracy`: the last number of the reply.
- `multiplication`: `"37*482"` -> `"17834"`; a two-digit times a three-digit number, which the tiny
  model cannot do by heart: the task of the embedded tool run, with `calculator` as its tool.
- `countdown`: `"Make 14 from 2 3 4:"` -> an expression such as `"(3+4)*2"` that uses each number
  once with + - * / and equals the target. Many expressions are right; `answer` is one of them.
  Scored by the `countdown` reward (answers.py), which evaluates the expression safely (no `eval`).

Every example is a dict with `prompt` and `answer` plus the task's own columns, which reward
functions receive as keyword arguments. `train_eval_split` holds out evaluation problems that
never occur in the training set.
"""

from __future__ import annotations

import random
from fractions import Fraction

from rlcore.rewards.answers import evaluate_expression

TASKS = ("arithmetic", "countdown", "multiplication", "arithmetic_question")
# The reward that decides whether an answer is right (held-out accuracy), per data.task.
TASK_REWARD = {"arithmetic": "accuracy", "countdown": "countdown", "multiplication": "accuracy",
               "arithmetic_question": "accuracy", "jsonl": "accuracy"}


def arithmetic_problems(rng: random.Random, max_operand: int = 49, ops: str = "+") -> list[dict]:
    """Every `a+b` (and `a-b` with a >= b when "-" is in `ops`) with operands in 0..max_operand,
    in a seeded random order. The default, two-digit addition up to 49+49, has 2,500 problems:
    enough that held-out accuracy measures arithmetic rather than memory."""
    problems = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            if "+" in ops:
                problems.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b, "op": "+"})
            if "-" in ops and a >= b:
                problems.append({"prompt": f"{a}-{b}=", "answer": str(a - b), "a": a, "b": b, "op": "-"})
    rng.shuffle(problems)
    return problems


def arithmetic_questions(rng: random.Random) -> list[dict]:
    """Every one-digit `a + b` and `a - b` (a >= b) as a question that asks for only the number
    (155 problems), in a seeded random order: a task SmolLM2-135M-Instruct gets partly right at the
    start, where it writes the equation out (`"7 - 3 = 4"`), and GRPO can improve on a CPU
    (docs/real_models.md)."""
    problems = arithmetic_problems(rng, max_operand=9, ops="+-")
    for p in problems:
        p["prompt"] = f"What is {p['a']} {p['op']} {p['b']}? Answer with only the number."
    return problems


def multiplication_problems(rng: random.Random) -> list[dict]:
    """Every `a*b` of a two-digit and a three-digit number whose product has five digits (66,471
    problems), in a seeded random order. The fixed widths keep each copied digit (into the call,
    from the result) at a fixed distance, which a model of four layers learns quickly."""
    problems = [{"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b, "op": "*"}
                for a in range(10, 100) for b in range(100, 1000) if a * b >= 10000]
    rng.shuffle(problems)
    return problems


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Integers with + - * / and parentheses, e.g. "12*(3+4)".
    """
    value, _ = evaluate_expression(expression)  # parsed, never eval'd; a bad expression raises ValueError
    return str(value)


def countdown_problem(rng: random.Random, num_numbers: int = 3, max_number: int = 9,
                      max_target: int = 99) -> dict | None:
    """One countdown problem built from a random expression over + - *; None when its value is
    not an integer in 1..max_target (the caller draws again)."""
    numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
    terms = [(str(n), Fraction(n), None) for n in numbers]  # (text, value, top-level operator)
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        (lt, lv, lop), (rt, rv, rop) = terms[i], terms[i + 1]
        op = rng.choice("+-*")
        # Parentheses only where precedence needs them: a-(b+c), (a+b)*c, a*(b-c).
        if op == "*" and lop in ("+", "-"):
            lt = f"({lt})"
        if op in "-*" and rop in ("+", "-"):
            rt = f"({rt})"
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv}[op]
        terms[i:i + 2] = [(f"{lt}{op}{rt}", value, op)]
    text, value, _ = terms[0]
    if value.denominator != 1 or not 1 <= value <= max_target:
        return None
    target = int(value)
    shown = sorted(numbers)
    return {"prompt": f"Make {target} from {' '.join(map(str, shown))}:", "answer": text,
            "numbers": shown, "target": target}


def unique_problems(name: str, limit: int, seed: int) -> list[dict]:
    """Up to `limit` distinct problems of task `name` in a seeded order (fewer if the task has fewer)."""
    rng = random.Random(f"{name}-{seed}")
    if name == "arithmetic":
        return arithmetic_problems(rng)[:limit]
    if name == "multiplication":
        return multiplication_problems(rng)[:limit]
    if name == "arithmetic_question":
        return arithmetic_questions(rng)[:limit]
    if name == "countdown":
        seen, problems = set(), []
        for _ in range(50 * limit):  # draws: ample: there are about 1,900 distinct problems
            if len(problems) == limit:
                break
            p = countdown_problem(rng)
            if p is not None and (key := (tuple(p["numbers"]), p["target"])) not in seen:
                seen.add(key)
                problems.append(p)
        return problems
    raise ValueError(f"unknown task {name!r}; synthetic tasks are {', '.join(TASKS)} "
                     f"(for your own data use data.task = 'jsonl')")


def make_task(name: str, n: int, seed: int) -> list[dict]:
    """`n` examples of task `name`, distinct while the task has enough problems, then repeated."""
    problems = unique_problems(name, n, seed)
    return [dict(problems[i % len(problems)]) for i in range(n)]


def train_eval_split(name: str, num_train: int, num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """`num_train` training and `num_eval` held-out examples; no eval problem occurs in training.

    The eval set is the first `num_eval` distinct problems of the seeded order; the training set
    cycles through the rest (repeating only when the task has fewer distinct problems).
    """
    problems = unique_problems(name, num_eval + num_train, seed)
    if len(problems) <= num_eval:
        raise ValueError(f"task {name!r} has only {len(problems)} distinct problems, so "
                         f"data.num_eval = {num_eval} leaves none to train on; lower data.num_eval")
    evals, pool = problems[:num_eval], problems[num_eval:]
    return [dict(pool[i % len(pool)]) for i in range(num_train)], [dict(p) for p in evals]
