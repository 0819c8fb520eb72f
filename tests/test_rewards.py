"""Built-in rewards: answer extraction, exact matching, the R1 format, the safe countdown evaluator."""

import re
import sys

import pytest

from rlcore.rewards.answers import REWARDS, accuracy, check_countdown, countdown, evaluate_expression, extract_answer, format_reward
from rlcore.rewards.scoring import check_reward_funcs, dataset_columns, get_reward_funcs, reward_inputs, score_completions


@pytest.mark.parametrize("text, answer", [
    ("so it is <answer>42</answer>", "42"),
    ("<answer>1</answer> no wait <answer> 2 </answer>", "2"),
    ("the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("48 / 2 = 24 clips\n#### 72", "72"),
    ("7+5=12", "12"),
    ("it is 3, then 5,000", "5,000"),
    ("x = -3", "-3"),
    ("7-3", "3"),
    ("no digits here", None),
])
def test_extract_answer_forms(text, answer):
    assert extract_answer(text) == answer


def test_answer_tag_takes_precedence_over_last_number():
    assert extract_answer("<answer>12</answer> and then 13") == "12"


@pytest.mark.parametrize("completion, gold, score", [
    ("12", "12", 1.0),
    ("13", "12", 0.0),
    ("12.0", "12", 1.0),
    ("<answer>$1,000</answer>", "1000", 1.0),
    ("<answer>The answer is 42.</answer>", "42", 1.0),
    ("", "12", 0.0),
    ("<answer>Paris</answer>", "paris", 0.0),
    ("<answer> Paris </answer>", "Paris", 1.0),
    # commas count only as thousands separators
    ("123", "1,2,3", 0.0),
    ("1,2,3", "1,2,3", 1.0),
    ("25", "2,5", 0.0),
    ("1000", "1,000", 1.0),
    # a gold answer that marks itself is unwrapped
    ("\\boxed{42}", "\\boxed{42}", 1.0),
    ("so 42", "\\boxed{42}", 1.0),
    ("42", "The total is 42.\n#### 42", 1.0),
    # non-numeric gold: the marked answer, else the whole completion, up to whitespace
    ("1/2", "1/2", 1.0),
    ("42%", "42%", 1.0),
    ("x =  5", "x = 5", 1.0),
    ("Paris", "Paris", 1.0),
    ("It is Paris", "Paris", 0.0),
    # other spellings of a number
    (".5", "0.5", 1.0),
    ("\u22123", "-3", 1.0),
    ("so 5-3", "-3", 0.0),
])
def test_accuracy_exact_match(completion, gold, score):
    assert accuracy(["p"], [completion], answer=[gold]) == [score]


def test_accuracy_is_none_without_answer_column():
    assert accuracy(["p", "q"], ["1", "2"]) == [None, None]


def test_accuracy_compares_a_raw_gsm8k_answer_or_number_by_its_final_number():
    gold = ["3 * 4 = <<3*4=12>>12 boxes\n#### 1,212", "#### 1,212", 42, 42]
    assert accuracy(["p"] * 4, ["so 1212", "1213", "The answer is 42", "4"], answer=gold) == [1.0, 0.0, 1.0, 0.0]


def test_the_loops_accuracy_reads_the_column_data_answer_column_names():
    from rlcore.rewards.scoring import get_reward_funcs

    columns = {"answer": ["7", "7"], "ground_truth": ["#### 3", "#### 4"]}
    (on_truth,), (on_none,) = get_reward_funcs(["accuracy"], "ground_truth"), get_reward_funcs(["accuracy"], "")
    assert on_truth(["p", "q"], ["3", "3"], **columns) == [1.0, 0.0] and on_truth.__name__ == "accuracy"
    assert on_none(["p", "q"], ["3", "7"], **columns) == [None, None]
    assert get_reward_funcs(["accuracy"])[0] is accuracy


def test_trainer_state_has_the_fields_reward_functions_read_and_names_them_for_another():
    from rlcore.rewards.scoring import RewardState

    state = RewardState(global_step=3, max_steps=10, epoch=0.5, num_train_epochs=2.0)
    assert (state.global_step, state.max_steps, state.epoch, state.num_train_epochs) == (3, 10, 0.5, 2.0)
    with pytest.raises(AttributeError, match=r"trainer_state\.log_history: rlcore's trainer_state has global_step, "
                                             r"max_steps, epoch, num_train_epochs \(TRL passes"):
        state.log_history


def test_accuracy_is_none_for_row_without_answer():
    assert accuracy(["p", "q"], ["1", "2"], answer=[None, "2"]) == [None, 1.0]


def test_accuracy_reads_conversational_completion():
    assert accuracy(["p"], [[{"role": "assistant", "content": "4"}]], answer=["4"]) == [1.0]


def test_reward_inputs_are_trls_conversational_format_and_every_column():
    rows = [{"prompt": [{"role": "user", "content": "q"}], "prompt_ids": [1], "answer": "4", "level": 2},
            {"prompt": "plain", "prompt_ids": [2], "answer": "5"}]
    columns = dataset_columns(rows)
    assert columns == ["answer", "level"]
    prompts, completions, values = reward_inputs(rows, ["four", "five"], columns)
    assert prompts == [rows[0]["prompt"], "plain"]
    assert completions == [[{"role": "assistant", "content": "four"}], "five"]
    assert values == {"answer": ["4", "5"], "level": [2, None]}


@pytest.mark.parametrize("completion, score", [
    ("<think>add them</think><answer>12</answer>", 1.0),
    ("  <think>a\nb</think>\n<answer>12</answer>\n", 1.0),
    ("<answer>12</answer>", 0.0),
    ("<think>x</think><answer>12</answer> trailing", 0.0),
    ("<think>x</think><think>y</think><answer>12</answer>", 0.0),
    ("12", 0.0),
])
def test_format_reward_requires_think_then_answer(completion, score):
    assert format_reward(["p"], [completion]) == [score]


def test_evaluate_expression_is_exact():
    value, used = evaluate_expression("(3+4)*2/7")
    assert value == 2 and used == [3, 4, 2, 7]


def test_evaluate_expression_accepts_deep_parentheses_up_to_the_length_limit():
    expr = "(" * 48 + "1" + ")" * 48 + "+11"  # exactly MAX_EXPRESSION_CHARS = 100 characters
    assert len(expr) == 100
    assert evaluate_expression(expr) == (12, [1, 11])


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')",
    "open('x')",
    "2**10",
    "-3+5",
    "1.5*2",
    "x+1",
    "(lambda: 1)()",
    "[1, 2]",
    "1/0",
    "9" * 101,
    "(" * 50 + "1" + ")" * 50,  # 101 characters: over the limit, however harmless
    "True+1",
])
def test_evaluate_expression_rejects_unsafe_or_invalid_input(expr):
    with pytest.raises(ValueError):
        evaluate_expression(expr)


@pytest.mark.parametrize("expr, ok", [
    ("(3+4)*2", True),
    ("2*(4+3)", True),
    ("3+4*2", False),      # 11, not 14
    ("(3+4)*2+0", False),  # 0 is not one of the numbers
    ("7*2", False),        # 7 is not a given number
    ("(3+4)", False),      # 2 is not used
    ("(3+3)*2", False),    # 3 used twice, 4 not at all
])
def test_check_countdown_needs_each_number_once_and_the_target(expr, ok):
    assert check_countdown(expr, [2, 3, 4], 14) is ok


@pytest.mark.parametrize("completion, score", [
    ("(3+4)*2", 1.0),
    ("(3+4)*2=14", 1.0),
    ("<think>try</think><answer>2*(3+4)</answer>", 1.0),
    ("(3+4)*2\nmore text", 1.0),
    ("14", 0.0),
    ("import os", 0.0),
])
def test_countdown_reward(completion, score):
    assert countdown(["p"], [completion], numbers=[[2, 3, 4]], target=[14]) == [score]


def test_countdown_is_none_without_its_columns():
    assert countdown(["p"], ["(3+4)*2"]) == [None]


def test_get_reward_funcs_returns_registry_entries():
    assert get_reward_funcs(["accuracy", "format"]) == [REWARDS["accuracy"], REWARDS["format"]]


def test_get_reward_funcs_loads_module_function():
    assert get_reward_funcs(["rlcore.rewards.answers:accuracy"]) == [accuracy]


def test_get_reward_funcs_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown reward 'acc'.*accuracy, format, countdown"):
        get_reward_funcs(["acc"])


def test_get_reward_funcs_bad_module_path_is_named():
    with pytest.raises(ValueError, match=r"'no_such_module:fn' cannot be loaded"):
        get_reward_funcs(["no_such_module:fn"])


def reward_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    """A module `name` of the user's, importable as a config's 'name:function' names it."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_get_reward_funcs_names_an_error_raised_while_importing_the_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "broken_rewards", "def f(prompts, completions:\n    return []\n")
    with pytest.raises(ValueError, match=r"'broken_rewards:f' cannot be loaded \(SyntaxError: .*line 1"):
        get_reward_funcs(["broken_rewards:f"])


def test_a_module_that_imports_a_missing_package_names_the_package_not_the_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "judge_rewards", "import rlcore_no_such_pkg.sub\ndef f(**kw):\n    return []\n")
    with pytest.raises(ValueError, match=r"'judge_rewards:f': module judge_rewards was found, but it imports "
                                         r"rlcore_no_such_pkg, which is not installed .*pip install "
                                         r"rlcore_no_such_pkg, if"):  # was: 'give module:function importable'
        get_reward_funcs(["judge_rewards:f"])
    with pytest.raises(ValueError, match=r"'rlcore_no_such_pkg\.judge:f' cannot be loaded \(ModuleNotFoundError"):
        get_reward_funcs(["rlcore_no_such_pkg.judge:f"])  # the named module (its package) is missing: the old advice


CLASS_REWARD = """
class ClassReward:
    def __init__(self, scale=1.0):
        self.scale = scale

    def __call__(self, prompts, completions, **kwargs):
        return [self.scale * len(c) for c in completions]


reward = ClassReward(scale=2.0)
"""


def test_get_reward_funcs_rejects_a_class_and_says_to_name_an_instance(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "class_reward_rejected", CLASS_REWARD)
    with pytest.raises(ValueError, match=r"'class_reward_rejected:ClassReward' is a class; .*create an instance at "
                                         r"module level .*\(reward = ClassReward\(\)\) and name that instance "
                                         r"\('class_reward_rejected:reward'\)"):
        get_reward_funcs(["class_reward_rejected:ClassReward"])


def test_a_name_that_is_not_callable_is_named_with_its_value(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "constant_reward", "SCALE = 5\n")
    with pytest.raises(ValueError, match=r"'constant_reward:SCALE' is not a function but 5 \(type int\); name a "
                                         r"function defined in constant_reward$"):
        get_reward_funcs(["constant_reward:SCALE"])


def test_an_instance_with_call_is_a_reward_function(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "class_reward_instance", CLASS_REWARD)
    funcs = get_reward_funcs(["class_reward_instance:reward"])
    check_reward_funcs(funcs, ["prompts", "completions", "answer"])
    scores = score_completions(funcs, ["p", "p"], ["a", "bb"], {"answer": [None, None]})
    assert scores.tolist() == [[2.0], [4.0]]


@pytest.mark.parametrize("name, problem", [
    ("lambda prompts, completions, **kw: [1.0]*len(completions)", "is a lambda; a config names a function"),
    ("my_rewards:make_reward(2)", "is not 'module:function': 'make_reward\\(2\\)' is not a Python name"),
])
def test_get_reward_funcs_says_a_config_cannot_hold_a_lambda_or_expression(name, problem):
    with pytest.raises(ValueError, match=rf"loss.reward_funcs entry '{re.escape(name)}' {problem}.*lambda or other "
                                         r"expression.*put a def in a .py file and name it 'module:function'"):
        get_reward_funcs([name])


@pytest.mark.parametrize("name", ["./my_rewards.py:fn", "rewards/my_rewards:fn", "my_rewards.py:fn"])
def test_a_file_path_in_place_of_a_module_says_to_name_the_module(name):
    with pytest.raises(ValueError, match=r"names a file; name its module: 'my_rewards:fn'"):
        get_reward_funcs([name])


def test_spaces_around_the_colon_are_ignored(tmp_path, monkeypatch):
    (tmp_path / "spaced_rewards.py").write_text("def fn(prompts, completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    assert get_reward_funcs(["spaced_rewards : fn"])[0](["p"], ["c"]) == [1.0]


def test_a_reward_module_shadowed_by_the_standard_library_names_both_files(tmp_path, monkeypatch):
    import code  # the standard library's, which the user's code.py below cannot replace

    (tmp_path / "code.py").write_text("def lenr(prompts, completions, **kwargs):\n    return [1.0] * len(completions)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # the current directory last, as the CLI puts it
    with pytest.raises(ValueError, match=rf"module 'code' has no attribute 'lenr'; 'code' was imported from "
                                         rf"{re.escape(code.__file__)}, not from {re.escape(str(tmp_path / 'code.py'))}"
                                         r": that file is shadowed .* rename code.py to a name no installed module"):
        get_reward_funcs(["code:lenr"])


def test_a_missing_function_names_the_imported_file_and_the_nearest_name(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "typo_rewards",
                  "def length_reward(prompts, completions, **kwargs):\n    return []\n")
    with pytest.raises(ValueError, match=rf"'typo_rewards' was imported from {re.escape(str(tmp_path))}.typo_rewards"
                                         r".py; did you mean 'length_reward'\?"):
        get_reward_funcs(["typo_rewards:length_rewrd"])


# ---- DAPO's soft overlong punishment ----

@pytest.mark.parametrize("max_len, cache", [(20, 5), (16, 16), (12, 0), (7, 1)])
def test_soft_overlong_punishment_equals_trls_on_every_length(max_len, cache):
    """Every length from 0 to past L_max, against TRL's own get_soft_overlong_punishment (the same
    float operations, so exactly equal): 0, then down to -1 over the cache, then -1."""
    trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is the reference")
    ids = [[7] * length for length in range(max_len + 4)]
    (ours,) = get_reward_funcs(["soft_overlong_punishment"], soft_punish=(max_len, cache))
    theirs = trl_rewards.get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
    assert ours(prompts=[""] * len(ids), completions=[""] * len(ids), completion_ids=ids) == theirs(ids)


def test_soft_overlong_punishment_is_dapos_eq_13():
    (reward,) = get_reward_funcs(["soft_overlong_punishment"], soft_punish=(20, 4))
    lengths = [0, 16, 17, 18, 20, 21]
    assert reward(completion_ids=[[1] * n for n in lengths]) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_soft_overlong_punishment_counts_the_models_tokens_not_the_tool_results():
    """With tools, completion_ids hold the tool results too; the reward counts the tool mask's ones,
    the completion length the trainer uses (TRL's reward counts every id)."""
    (reward,) = get_reward_funcs(["soft_overlong_punishment"], soft_punish=(10, 4))
    ids = [[1] * 12, [1] * 12]  # 12 ids: 9 the model's and 3 a tool's, then 12 the model's
    mask = [[1] * 5 + [0] * 3 + [1] * 4, [1] * 12]
    assert reward(completion_ids=ids, tool_mask=mask) == [-0.75, -1.0]
    assert reward(completion_ids=ids) == [-1.0, -1.0]


def test_soft_overlong_punishment_scores_through_score_completions_with_a_tool_mask():
    (reward,) = get_reward_funcs(["soft_overlong_punishment"], soft_punish=(4, 2))
    R = score_completions([reward], ["p", "p"], ["c", "c"], {},
                          extra={"completion_ids": [[1, 2, 3], [1, 2, 3]], "tool_mask": [[1, 1, 1], [1, 0, 0]]})
    assert R[:, 0].tolist() == [-0.5, 0.0]


def test_soft_overlong_punishment_needs_its_cache():
    with pytest.raises(ValueError, match=r"needs its L_cache: set loss\.soft_punish_cache"):
        get_reward_funcs(["soft_overlong_punishment"], soft_punish=(20, None))
