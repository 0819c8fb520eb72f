"""Rewards -> advantages (SPEC section 2), checked against hand-computed numbers."""

import math
from fractions import Fraction

import pytest
import torch

from rlcore.losses.advantages import compute_advantages
from rlcore.rewards.scoring import RewardFunctionError, check_reward_funcs, score_completions

NAN = float("nan")


def close(got, want, tol=1e-6):
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=tol, atol=tol)


def test_group_scaling_divides_by_bessel_std_plus_1e4():
    # group [1, 2, 3]: mean 2, Bessel std 1; group [0, 0, 6]: mean 2, std sqrt(12)
    rewards = torch.tensor([[1.0], [2.0], [3.0], [0.0], [0.0], [6.0]])
    adv, _ = compute_advantages(rewards, num_generations=3)
    s = math.sqrt(12) + 1e-4
    close(adv, [-1 / 1.0001, 0.0, 1 / 1.0001, -2 / s, -2 / s, 4 / s])


def test_scale_rewards_true_is_group():
    rewards = torch.tensor([[1.0], [2.0], [3.0], [0.0], [0.0], [6.0]])
    close(compute_advantages(rewards, 3, scale_rewards=True)[0],
          compute_advantages(rewards, 3, scale_rewards="group")[0].tolist())


def test_batch_scaling_divides_by_batch_std():
    # group means 2 and 12 (not the batch mean 7), so the std of the rewards differs from the
    # std of the group-centred rewards [-1, 0, 1, -2, -2, 4] (which would be sqrt(26/5))
    rewards = torch.tensor([[1.0], [2.0], [3.0], [10.0], [10.0], [16.0]])
    adv, _ = compute_advantages(rewards, num_generations=3, scale_rewards="batch")
    # batch: deviations from 7 are -6,-5,-4,3,3,9, squares sum to 176 -> Bessel var 176/5
    s = math.sqrt(176 / 5) + 1e-4
    close(adv, [-1 / s, 0.0, 1 / s, -2 / s, -2 / s, 4 / s])


@pytest.mark.parametrize("scale", ["none", False])
def test_no_scaling_is_dr_grpo_mean_centering(scale):
    rewards = torch.tensor([[1.0], [2.0], [3.0], [0.0], [0.0], [6.0]])
    adv, _ = compute_advantages(rewards, num_generations=3, scale_rewards=scale)
    close(adv, [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])


def test_rewards_are_weighted_sums_over_functions():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0]])  # r = 2*R0 + 0.5*R1 = [2.5, 0.5]
    adv, stats = compute_advantages(rewards, 2, reward_weights=[2.0, 0.5], scale_rewards="none")
    close(adv, [1.0, -1.0])
    assert stats["reward/mean"] == pytest.approx(1.5)


def test_none_reward_is_skipped_in_the_weighted_sum():
    # row 0: f0 None, f1 = 1 -> r = 1; row 1: r = 3 + 0 = 3
    rewards = torch.tensor([[NAN, 1.0], [3.0, 0.0]])
    adv, _ = compute_advantages(rewards, 2, scale_rewards="none")
    close(adv, [-1.0, 1.0])


def test_unscorable_row_gets_zero_advantage_and_leaves_group_stats():
    # r = [1, NaN, 3]: the group mean and std use 1 and 3 only (mean 2, std sqrt(2))
    rewards = torch.tensor([[1.0], [NAN], [3.0]])
    adv, stats = compute_advantages(rewards, num_generations=3)
    s = math.sqrt(2) + 1e-4
    close(adv, [-1 / s, 0.0, 1 / s])
    assert stats["reward/mean"] == pytest.approx(2.0)


def test_equal_rewards_give_exactly_zero_advantage():
    # seven weighted rewards 0.3 * 0.1 sum to a mean that is not exactly 0.3 * 0.1 in fp64
    # (r - mean is ~3e-18, and ~3e-14 after dividing by the std + 1e-4); the group must get 0
    rewards = torch.tensor([[0.1]] * 7 + [[0.0]] * 6 + [[1.0]])
    r = 0.3 * rewards[:7, 0].double()
    assert (r - r.mean()).abs().max() > 0  # the input exercises the rounding
    for scale in ("group", "batch", "none"):
        adv, _ = compute_advantages(rewards, 7, reward_weights=[0.3], scale_rewards=scale)
        assert adv[:7].tolist() == [0.0] * 7


def test_frac_reward_zero_std_counts_groups_without_signal():
    # groups: [1,1] equal, [0,1] signal, [NaN,2] one valid value, [NaN,NaN] unscorable
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [NAN], [2.0], [NAN], [NAN]])
    adv, stats = compute_advantages(rewards, num_generations=2)
    assert stats["frac_reward_zero_std"] == pytest.approx(3 / 4)
    assert adv[[0, 1, 4, 5, 6, 7]].tolist() == [0.0] * 6


def test_a_group_with_a_tiny_reward_difference_is_not_zero_std():
    rewards = torch.tensor([[0.0], [5e-4], [1.0], [1.0]])
    adv, stats = compute_advantages(rewards, num_generations=2, scale_rewards="none")
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 2)
    close(adv[:2], [-2.5e-4, 2.5e-4])


def test_stats_report_reward_and_advantage_summaries_as_floats():
    rewards = torch.tensor([[1.0, 0.0], [3.0, NAN], [5.0, 2.0], [5.0, 2.0]])
    adv, stats = compute_advantages(rewards, 2, scale_rewards="none",
                                    reward_names=["accuracy", "format"])
    # r = [1, 3, 7, 7] -> A = [-1, 1, 0, 0]
    assert stats == pytest.approx({
        "reward/mean": 4.5,
        "reward/std": math.sqrt(((1 - 4.5) ** 2 + (3 - 4.5) ** 2 + 2 * (7 - 4.5) ** 2) / 3),
        "reward/accuracy/mean": 3.5,
        "reward/format/mean": 4 / 3,
        "reward/accuracy/std": math.sqrt(((1 - 3.5) ** 2 + (3 - 3.5) ** 2 + 2 * (5 - 3.5) ** 2) / 3),
        "reward/format/std": math.sqrt(((0 - 4 / 3) ** 2 + 2 * (2 - 4 / 3) ** 2) / 2),  # NaN left out, as TRL's
        "frac_reward_zero_std": 0.5,
        "advantage/mean": 0.0,
        "advantage/abs_mean": 0.5,
    })
    assert all(type(v) is float for v in stats.values())


def test_wrong_reward_weights_length_names_both_lengths():
    with pytest.raises(ValueError, match="reward_weights has 3 entries but there are 2"):
        compute_advantages(torch.zeros(4, 2), 2, reward_weights=[1.0, 1.0, 1.0])


def test_batch_not_divisible_by_num_generations_raises():
    with pytest.raises(ValueError, match="num_generations=4"):
        compute_advantages(torch.zeros(6, 1), num_generations=4)


def test_unknown_scale_rewards_raises():
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(torch.zeros(4, 1), 2, scale_rewards="global")


# score_completions ------------------------------------------------------------------------

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]
COLUMNS = {"answer": ["a", "x", "ccc"]}


def exact_match(prompts, completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def length_or_none(prompts, completions, **kwargs):
    return [None if len(c) == 2 else float(len(c)) for c in completions]


def test_scores_stack_per_function_with_none_as_nan():
    scores = score_completions([exact_match, length_or_none], PROMPTS, COMPLETIONS, COLUMNS)
    expected = torch.tensor([[1.0, 1.0], [0.0, NAN], [1.0, 3.0]])
    torch.testing.assert_close(scores, expected, equal_nan=True)


def fails_on_bb(prompts, completions, **kwargs):
    return [1 / (len(c) - 2) for c in completions]  # ZeroDivisionError on "bb"


def test_raising_function_names_itself_and_the_sample():
    with pytest.raises(RewardFunctionError, match=r"fails_on_bb raised ZeroDivisionError.*sample 1.*'p1'.*'bb'") as e:
        score_completions([fails_on_bb], PROMPTS, COMPLETIONS, COLUMNS)
    assert e.value.frames[0].name == "fails_on_bb"  # the function's own frames, none of rlcore's
    assert {frame.filename for frame in e.value.frames} == {__file__}


def parse_int(text):
    return int(text)  # ValueError on "x"


def raises_in_a_helper(prompts, completions, **kwargs):
    scores = []
    for completion in completions:
        scores.append(parse_int(completion))
    return scores


async def raises_when_awaited(prompts, completions, **kwargs):
    return raises_in_a_helper(prompts, completions)


@pytest.mark.parametrize("func, names", [(raises_in_a_helper, ["raises_in_a_helper", "parse_int"]),
                                         (raises_when_awaited, ["raises_when_awaited", "raises_in_a_helper",
                                                                "parse_int"])])
def test_reward_function_error_keeps_only_the_functions_own_frames(func, names):
    with pytest.raises(RuntimeError, match="raised ValueError: invalid literal.*on sample 1") as caught:
        score_completions([func], ["p0", "p1"], ["1", "x"], {})
    err = RewardFunctionError(str(caught.value), caught.value.__cause__)  # rlcore's and asyncio's frames left out
    assert isinstance(err, RuntimeError) and str(err) == str(caught.value)
    assert [frame.name for frame in err.frames] == names and {frame.filename for frame in err.frames} == {__file__}
    assert err.trace.startswith("Traceback of the reward function (most recent call last):\n")
    assert err.trace.count('File "') == len(names)
    assert f'line {parse_int.__code__.co_firstlineno + 1}, in parse_int\n    return int(text)' in err.trace


def test_reward_function_error_without_the_error_has_no_frames():
    err = RewardFunctionError("reward function f raised ValueError: no on sample 0")
    assert list(err.frames) == [] and err.trace == ""


def test_on_error_none_scores_only_the_failing_sample_as_nan():
    scores = score_completions([fails_on_bb], PROMPTS, COMPLETIONS, COLUMNS, on_error="none")
    torch.testing.assert_close(scores, torch.tensor([[-1.0], [NAN], [1.0]]), equal_nan=True)


def test_wrong_number_of_scores_names_the_function():
    def too_short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="too_short returned 1 scores for 3 completions"):
        score_completions([too_short], PROMPTS, COMPLETIONS, COLUMNS)


def test_non_numeric_score_names_the_function_and_value():
    def says_yes(prompts, completions, **kwargs):
        return ["yes"] * len(completions)

    with pytest.raises(TypeError, match="says_yes returned 'yes'"):
        score_completions([says_yes], PROMPTS, COMPLETIONS, COLUMNS)


def test_numpy_scores_are_accepted():
    np = pytest.importorskip("numpy")

    def as_array(prompts, completions, **kwargs):
        return np.array([len(c) for c in completions], dtype=np.float32)

    scores = score_completions([as_array], PROMPTS, COMPLETIONS, COLUMNS)
    torch.testing.assert_close(scores, torch.tensor([[1.0], [2.0], [3.0]]))


def test_a_single_number_instead_of_a_list_names_the_function():
    def scalar(prompts, completions, **kwargs):
        return 1.0

    with pytest.raises(TypeError, match="scalar returned float; it must return a list of 3"):
        score_completions([scalar], PROMPTS, COMPLETIONS, COLUMNS)


def test_trls_keywords_reach_functions_that_take_them():
    seen = {}

    def trl_style(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
        seen.update(ids=completion_ids, state=trainer_state, columns=sorted(kwargs))
        log_metric("m", 1.0)
        return [1.0] * len(completions)

    def names_what_it_needs(completions, answer):  # no **kwargs: gets only what it names
        return [float(c == a) for c, a in zip(completions, answer)]

    logged = []
    extra = {"completion_ids": [[1], [2, 2], [3, 3, 3]], "trainer_state": "state",
             "log_metric": lambda name, value: logged.append((name, value)), "log_extra": lambda *a: None}
    scores = score_completions([trl_style, names_what_it_needs], PROMPTS, COMPLETIONS, COLUMNS, extra=extra)
    torch.testing.assert_close(scores, torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]))
    assert seen == {"ids": [[1], [2, 2], [3, 3, 3]], "state": "state", "columns": ["answer", "log_extra"]}
    assert logged == [("m", 1.0)]


@pytest.mark.parametrize("on_error", ["raise", "none"])
def test_a_parameter_nothing_provides_is_named_whatever_on_error_says(on_error):
    def needs_difficulty(prompts, completions, difficulty):
        return [1.0] * len(completions)

    with pytest.raises(TypeError, match=r"needs_difficulty cannot be called .*'difficulty'.*keywords prompts, "
                                        r"completions, answer"):
        score_completions([needs_difficulty], PROMPTS, COMPLETIONS, COLUMNS, on_error=on_error)


def test_async_functions_are_awaited():
    async def judge(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    torch.testing.assert_close(score_completions([judge], PROMPTS, COMPLETIONS, COLUMNS),
                               torch.tensor([[1.0], [2.0], [3.0]]))


@pytest.mark.parametrize("output", [[True, False, True], torch.tensor([1.0, 0.0, 1.0]), (1, 0, 1)])
def test_bools_tensors_and_tuples_are_scores(output):
    scores = score_completions([lambda prompts, completions, **kw: output], PROMPTS, COMPLETIONS, COLUMNS)
    torch.testing.assert_close(scores, torch.tensor([[1.0], [0.0], [1.0]]))


def gdpo_reference(rows, G, weights):
    """normalize_then_sum from its definition, in plain Python floats: per function and group,
    z = (x - mean) / (Bessel std + 1e-4) over the non-None values; s = sum_f w_f z_f (None where
    every function is None); A = (s - mean(s)) / (Bessel std(s) + 1e-4) over the batch; None -> 0."""
    def mean(v):
        return sum(v) / len(v)

    def std(v):
        return math.sqrt(sum((x - mean(v)) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None

    F = len(weights)
    z = [[None] * F for _ in rows]
    for g in range(0, len(rows), G):
        for f in range(F):
            vals = [rows[i][f] for i in range(g, g + G) if rows[i][f] is not None]
            sd = std(vals)
            for i in range(g, g + G):
                if rows[i][f] is not None and sd is not None:
                    z[i][f] = (rows[i][f] - mean(vals)) / (sd + 1e-4)
    s = [None if all(x is None for x in row) else sum(w * zf for w, zf in zip(weights, zr) if zf is not None)
         for row, zr in zip(rows, z)]
    valid = [x for x in s if x is not None]
    return [0.0 if x is None else (x - mean(valid)) / (std(valid) + 1e-4) for x in s]


def test_normalize_then_sum_is_gdpo_group_normalised_per_function_then_batch_normalised():
    # function 0 on a scale of 100, function 1 of 1: summed first, function 0 would decide alone
    rows = [[100.0, 0.0], [300.0, 1.0], [200.0, 1.0], [0.0, 0.0],      # group 1
            [50.0, 1.0], [50.0, 0.0], [None, 1.0], [50.0, None],       # group 2: function 0 constant, Nones
            [None, None], [10.0, 0.0], [20.0, 1.0], [30.0, 0.0]]       # group 3: an unscorable row
    R = torch.tensor([[NAN if x is None else x for x in r] for r in rows])
    adv, stats = compute_advantages(R, 4, reward_weights=[1.0, 2.0], multi_objective_aggregation="normalize_then_sum")
    close(adv, gdpo_reference(rows, 4, [1.0, 2.0]), tol=1e-5)
    assert adv[8] == 0.0
    summed, _ = compute_advantages(R, 4, reward_weights=[1.0, 2.0])
    assert not torch.allclose(adv, summed, atol=0.1)
    assert stats["reward/mean"] == pytest.approx((100 + 302 + 202 + 0 + 52 + 50 + 2 + 50 + 10 + 22 + 30) / 11)  # raw, weighted
    with pytest.raises(ValueError, match="multi_objective_aggregation must be one of"):
        compute_advantages(R, 4, multi_objective_aggregation="mean")


def test_normalize_then_sum_does_not_zero_a_group_of_equal_summed_rewards_but_counts_it_as_zero_std():
    """docs/losses.md: under normalize_then_sum a group whose rewards are all equal is not zeroed (TRL's
    formula), and frac_reward_zero_std still counts groups of equal summed rewards. Group 1's weighted
    sums are all 4, but its functions move in opposite directions with weights 1 and 2, so its
    normalised sums s are about [1, 0, -1] and its advantages are clearly non-zero. Reference: gdpo_reference,
    the formula in plain Python."""
    rows = [[0.0, 2.0], [2.0, 1.0], [4.0, 0.0],       # group 1: r = 0 + 4, 2 + 2, 4 + 0, all 4
            [1.0, 0.0], [0.0, 1.0], [3.0, 1.0],       # group 2: r = 1, 2, 5
            [1.0, 1.0], [1.0, None], [2.0, 0.0]]      # group 3: r = 3, 1, 2, a None
    R = torch.tensor([[NAN if x is None else x for x in r] for r in rows])
    adv, stats = compute_advantages(R, 3, reward_weights=[1.0, 2.0], multi_objective_aggregation="normalize_then_sum")
    want = gdpo_reference(rows, 3, [1.0, 2.0])
    close(adv, want, tol=1e-5)
    assert min(abs(a) for a in want[:3:2]) > 0.5 and adv[:3:2].abs().min() > 0.5  # rows 0 and 2: not zeroed
    r = [sum(w * x for w, x in zip([1.0, 2.0], row) if x is not None) for row in rows]
    assert [len(set(r[g:g + 3])) < 2 for g in (0, 3, 6)] == [True, False, False]  # equal sums: group 1 only
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 3)  # group 1 counted
    summed, _ = compute_advantages(R, 3, reward_weights=[1.0, 2.0])
    assert summed[:3].tolist() == [0.0] * 3  # sum_then_normalize does zero it


def test_an_infinite_score_is_an_error_naming_the_function_and_sample_and_nan_is_none():
    def unbounded(prompts, completions, **kwargs):
        return [0.0, float("-inf"), 1.0]

    with pytest.raises(ValueError, match=r"unbounded returned -inf for sample 1 \(completion='bb'\); scores must "
                                         r"be finite in float32"):
        score_completions([unbounded], PROMPTS, COMPLETIONS, COLUMNS)
    with pytest.raises(ValueError, match=r"returned 1e\+39 for sample 2 \(completion='ccc'\)"):  # was a RuntimeError
        score_completions([lambda prompts, completions, **kw: [0.0, 1.0, 1e39]], PROMPTS, COMPLETIONS, COLUMNS)
    for huge in (10**400, -Fraction(10**400, 3)):  # past any float: was an OverflowError from math.isnan
        with pytest.raises(ValueError, match=r"returned -?(1000|Fraction).*\.\.\. for sample 0 .*finite in float32"):
            score_completions([lambda prompts, completions, **kw: [huge, 1.0, 0.0]], PROMPTS, COMPLETIONS, COLUMNS)
    assert score_completions([lambda prompts, completions, **kw: [Fraction(1, 4), 2, True]], PROMPTS, COMPLETIONS,
                             COLUMNS)[:, 0].tolist() == [0.25, 2.0, 1.0]
    nan = score_completions([lambda prompts, completions, **kw: [0.5, math.nan, None]], PROMPTS, COMPLETIONS, COLUMNS)
    assert nan[0, 0] == 0.5 and nan[1:].isnan().all()  # NaN scores as None does (TRL turns None into NaN)


@pytest.mark.parametrize("output", [{"a": 1.0, "bb": 0.0, "ccc": 1.0}, {1.0, 0.0, 2.0}])
def test_a_dict_or_set_of_scores_is_named_as_such(output):
    with pytest.raises(TypeError, match=rf"returned {type(output).__name__}; it must return a list of 3 floats"):
        score_completions([lambda prompts, completions, **kw: output], PROMPTS, COMPLETIONS, COLUMNS)


def test_check_reward_funcs_finds_a_bad_signature_without_scoring():
    def needs_difficulty(prompts, completions, difficulty):
        return [1.0] * len(completions)

    def trl_style(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, answer):
        return [1.0] * len(completions)

    keywords = ["prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "answer"]
    check_reward_funcs([trl_style], keywords)  # takes exactly what is passed: fine
    with pytest.raises(TypeError, match=r"needs_difficulty cannot be called .*'difficulty'"):
        check_reward_funcs([trl_style, needs_difficulty], keywords)


def test_a_reward_factory_named_in_place_of_its_reward_is_named_as_a_factory():
    """TRL's get_soft_overlong_punishment / get_repetition_penalty_reward make reward functions."""
    def get_overlong(max_completion_len, soft_punish_cache):
        return lambda completion_ids, **kwargs: [0.0] * len(completion_ids)

    def get_repetition(ngram_size=3, max_penalty=-1.0):
        return lambda completions, **kwargs: [0.0] * len(completions)

    factory = r"make one in a module of your own, reward = {}\(\.\.\.\), and name that, 'my_rewards:reward'"
    with pytest.raises(TypeError, match=r"get_overlong cannot be called .*'max_completion_len'.*look like settings of "
                                        r"a factory .*" + factory.format("get_overlong")):
        check_reward_funcs([get_overlong], ["prompts", "completions"])
    with pytest.raises(TypeError, match=r"get_repetition returned function; it must return a list of 3 floats .*"
                                        r"looks like a factory .*" + factory.format("get_repetition")):
        score_completions([get_repetition], PROMPTS, COMPLETIONS, COLUMNS)


@pytest.mark.parametrize("on_error", ["raise", "none"])
def test_a_missing_package_stops_the_run_naming_it_whatever_reward_on_error_says(on_error):
    def needs_math_verify(prompts, completions, **kwargs):
        __import__("math_verify_is_not_installed")
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"needs_math_verify raised ModuleNotFoundError: No module named "
                                                  r"'math_verify_is_not_installed'; install the package it imports "
                                                  r"\(pip install math_verify_is_not_installed\) and run again$"):
        score_completions([needs_math_verify], PROMPTS, COMPLETIONS, COLUMNS, on_error)


def test_a_class_is_not_a_reward_function_but_its_instance_is():
    class Length:
        def __call__(self, prompts, completions, **kwargs):
            return [float(len(c)) for c in completions]

    with pytest.raises(TypeError, match=r"reward function Length is a class; .*an instance \(reward = Length\(\)\)"):
        check_reward_funcs([Length], ["prompts", "completions"])
    with pytest.raises(TypeError, match=r"reward function Length is a class"):
        score_completions([Length], PROMPTS, COMPLETIONS, COLUMNS)
    torch.testing.assert_close(score_completions([Length()], PROMPTS, COMPLETIONS, COLUMNS),
                               torch.tensor([[1.0], [2.0], [3.0]]))
