"""Synthetic tasks: deterministic from the seed, every stated answer verifies, held-out eval."""

import random

import pytest

from rlcore.rewards.answers import REWARDS
from rlcore.data.tasks import TASK_REWARD, TASKS, arithmetic_problems, make_task, train_eval_split, unique_problems


def score(task: str, examples: list[dict], completions: list[str]) -> list:
    columns = {k: [ex[k] for ex in examples] for k in examples[0] if k != "prompt"}
    return REWARDS[TASK_REWARD[task]]([ex["prompt"] for ex in examples], completions, **columns)


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_gives_same_examples(task):
    assert make_task(task, 200, seed=3) == make_task(task, 200, seed=3)


@pytest.mark.parametrize("task", TASKS)
def test_different_seed_gives_different_examples(task):
    assert make_task(task, 50, seed=0) != make_task(task, 50, seed=1)


@pytest.mark.parametrize("task", TASKS)
def test_every_stated_answer_scores_one(task):
    examples = make_task(task, 1000, seed=0)
    assert score(task, examples, [ex["answer"] for ex in examples]) == [1.0] * len(examples)


@pytest.mark.parametrize("task", TASKS)
def test_a_wrong_answer_scores_zero(task):
    examples = make_task(task, 200, seed=0)
    wrong = [f"{ex['answer']}+1" if task == "countdown" else str(int(ex["answer"]) + 1) for ex in examples]
    assert score(task, examples, wrong) == [0.0] * len(examples)


def test_arithmetic_example_columns():
    ex = make_task("arithmetic", 1, seed=0)[0]
    assert ex["prompt"] == f"{ex['a']}{ex['op']}{ex['b']}="
    assert int(ex["answer"]) == (ex["a"] + ex["b"] if ex["op"] == "+" else ex["a"] - ex["b"])


def test_arithmetic_answers_are_never_negative():
    problems = arithmetic_problems(random.Random(0), max_operand=9, ops="+-")
    assert {ex["op"] for ex in problems} == {"+", "-"}  # subtraction is generated, so a >= b is exercised
    assert sorted(int(ex["answer"]) for ex in problems if ex["op"] == "-") == sorted(
        a - b for a in range(10) for b in range(a + 1))


def test_arithmetic_question_asks_every_one_digit_sum_and_difference_for_only_the_number():
    problems = unique_problems("arithmetic_question", 1000, seed=0)
    asked = {(ex["a"], ex["op"], ex["b"]) for ex in problems}
    assert len(problems) == len(asked) == 155
    assert asked == {(a, "+", b) for a in range(10) for b in range(10)} | {(a, "-", b) for a in range(10)
                                                                           for b in range(a + 1)}
    for ex in problems:
        assert ex["prompt"] == f"What is {ex['a']} {ex['op']} {ex['b']}? Answer with only the number."
        assert int(ex["answer"]) == (ex["a"] + ex["b"] if ex["op"] == "+" else ex["a"] - ex["b"])


def test_countdown_example_columns():
    ex = make_task("countdown", 1, seed=0)[0]
    assert ex["prompt"] == f"Make {ex['target']} from {' '.join(map(str, ex['numbers']))}:"
    assert len(ex["numbers"]) == 3 and 1 <= ex["target"] <= 99


@pytest.mark.parametrize("task", [task for task in TASKS if task != "arithmetic_question"])
def test_prompts_and_answers_are_short(task):  # the tiny model's tasks: it reads one token per character
    examples = make_task(task, 500, seed=0)
    assert max(len(ex["prompt"]) for ex in examples) <= 20
    assert max(len(ex["answer"]) for ex in examples) <= 12


@pytest.mark.parametrize("task", TASKS)
def test_examples_are_distinct_while_the_task_has_enough(task):
    prompts = [ex["prompt"] for ex in make_task(task, 100, seed=0)]
    assert len(set(prompts)) == 100


def test_small_task_repeats_beyond_its_problem_count():
    n = len(unique_problems("arithmetic", 10_000, seed=0))
    examples = make_task("arithmetic", n + 5, seed=0)
    assert len(examples) == n + 5 and examples[n] == examples[0]


@pytest.mark.parametrize("task", TASKS)
def test_eval_problems_never_appear_in_training(task):
    train, evals = train_eval_split(task, 1000, 32, seed=0)
    assert len(train) == 1000 and len(evals) == 32
    assert not {ex["prompt"] for ex in train} & {ex["prompt"] for ex in evals}


def test_split_with_no_problems_left_to_train_is_an_error():
    with pytest.raises(ValueError, match=r"data\.num_eval = 3000 leaves none to train on"):
        train_eval_split("arithmetic", 10, 3000, seed=0)


def test_unknown_task_lists_tasks():
    with pytest.raises(ValueError, match=r"unknown task 'algebra'; synthetic tasks are arithmetic, countdown"):
        make_task("algebra", 1, seed=0)


def test_repeated_examples_are_independent_copies():
    n = len(unique_problems("arithmetic", 10_000, seed=0))
    examples = make_task("arithmetic", n + 1, seed=0)
    examples[n]["prompt"] = "changed"
    assert examples[0]["prompt"] != "changed"
