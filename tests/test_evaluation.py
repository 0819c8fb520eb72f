"""Sampled held-out evaluation (train.eval_num_generations = n > 1): mean@n, pass@k and maj@n, each
against a brute-force enumeration, then seeded and apart from the training sampler in the loop."""

import itertools
import json
from collections import defaultdict
from fractions import Fraction

import pytest

from rlcore.data.tasks import unique_problems
from rlcore.evaluation import SampledEval, answer_key, evaluate_sampled, majority_vote, pass_at_k
from rlcore.models.hf_checkpoint import load_model
from rlcore.models.tokenizer import Tokenizer
from rlcore.train import train

from conftest import EMBEDDED_SEED
from test_train import config, rows, weights
from test_resume import run_and_crash

pytestmark = pytest.mark.usefixtures("embedded_dir")


# ---- the estimators

@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_completion(n):
    """Chen et al.'s estimator against every k-subset of n completions, c of them correct."""
    for c in range(n + 1):
        correct = [i < c for i in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            share = Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))
            assert pass_at_k(n, c, k) == pytest.approx(float(share), rel=1e-12, abs=1e-15), (n, c, k)


@pytest.mark.parametrize("n", range(1, 7))
def test_mean_at_n_is_pass_at_1_the_mean_over_single_completions(n):
    for c in range(n + 1):
        assert pass_at_k(n, c, 1) == pytest.approx(sum(i < c for i in range(n)) / n, rel=1e-12, abs=1e-15)


def brute_force_winner(keys: list):
    """maj@n's rule, spelt out: count every answer; of the most frequent, the one given first; the
    index of its first completion (None without answers)."""
    counts, first = defaultdict(int), {}
    for i, key in enumerate(keys):
        if key is not None:
            counts[key] += 1
            first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[key] for key in counts if counts[key] == best)


@pytest.mark.parametrize("n", range(1, 6))
def test_majority_vote_over_every_assignment_of_answers_breaks_ties_to_the_answer_given_first(n):
    for keys in itertools.product([None, 1, 2, 3], repeat=n):
        assert majority_vote(list(keys)) == brute_force_winner(list(keys)), keys


def test_answers_vote_as_numbers_and_text_up_to_whitespace():
    assert answer_key("so 1,000") == answer_key("<answer>1000.0</answer>") == Fraction(1000)
    assert answer_key([{"role": "assistant", "content": "#### x  = 5"}]) == "x = 5"
    assert answer_key("no answer here") is None
    assert majority_vote([answer_key(t) for t in ["7", "it is 8", "8.0", "7"]]) == 0  # 7 and 8 tie: 7 came first


# ---- on the embedded model

def held_out_problems(tok, count=12):
    problems = unique_problems("arithmetic", 10**6, EMBEDDED_SEED)[:count]
    return [{**p, "prompt_ids": tok.encode(p["prompt"])} for p in problems]


def test_sampled_evaluation_counts_each_prompts_correct_completions(embedded_dir, monkeypatch):
    """The figures are the estimators applied to each prompt's completions, averaged over prompts;
    the same seed gives the same completions and figures, another seed other completions."""
    tok, model = Tokenizer.from_dir(embedded_dir), load_model(embedded_dir)
    examples, n = held_out_problems(tok), 4
    sampled = SampledEval(n, [1, 2, 4], seed=7, sampling={"temperature": 1.0})
    seen = []

    def first_digit_right(prompts, completions, answer, **columns):
        """An accuracy the tiny test model often passes and often fails: the answer's first digit."""
        scores = [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]
        seen.extend(zip(prompts, completions, scores))
        return scores

    got = evaluate_sampled(model, tok, examples, first_digit_right, 4, sampled, batch_size=8)
    assert list(got) == ["eval/mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@4"]
    assert len(seen) == n * len(examples) and [p for p, _, _ in seen[::n]] == [e["prompt"] for e in examples]
    per_prompt = [seen[i:i + n] for i in range(0, len(seen), n)]
    counts = [sum(s == 1.0 for _, _, s in group) for group in per_prompt]
    assert 0 < sum(counts) < n * len(examples)  # some right, some wrong: the figures are not trivially 0 or 1
    assert got["eval/mean@4"] == pytest.approx(sum(counts) / n / len(examples))
    assert got["eval/pass@1"] == pytest.approx(got["eval/mean@4"])
    assert got["eval/pass@4"] == pytest.approx(sum(c > 0 for c in counts) / len(examples))
    assert got["eval/pass@1"] <= got["eval/pass@2"] <= got["eval/pass@4"]
    votes = [brute_force_winner([answer_key(c) for _, c, _ in group]) for group in per_prompt]
    assert got["eval/maj@4"] == pytest.approx(
        sum(w is not None and group[w][2] == 1.0 for w, group in zip(votes, per_prompt)) / len(examples))
    first, seen[:] = list(seen), []
    assert evaluate_sampled(model, tok, examples, first_digit_right, 4, sampled, batch_size=8) == got
    assert seen == first
    seen.clear()
    evaluate_sampled(model, tok, examples, first_digit_right, 4, SampledEval(n, [1], 8, {"temperature": 1.0}))
    assert [c for _, c, _ in seen] != [c for _, c, _ in first]


# ---- in the loop

SAMPLED = ["train.eval_num_generations=4", "train.eval_pass_at_k=[1,4]", "train.eval_temperature=0.8",
           "train.eval_steps=2"]


def evals(run) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def test_sampled_evaluation_leaves_training_as_it_was_and_reports_beside_greedy_accuracy(tmp_path):
    """With n = 4 the held-out evaluation draws from a generator of its own: the metrics rows and
    weights are those of the same run evaluated greedily, and eval.jsonl has the greedy figures
    unchanged and the sampled ones after them."""
    greedy, sampled = tmp_path / "greedy", tmp_path / "sampled"
    out = train(config(greedy, "train.max_steps=4", "train.eval_steps=2"))
    assert train(config(sampled, "train.max_steps=4", *SAMPLED))["after"] == out["after"]
    assert rows(sampled) == [{**r, **{k: v for k, v in s.items() if k.startswith(("time/", "tokens_per_s/", "memory/"))}}
                             for r, s in zip(rows(greedy), rows(sampled))]
    wa, wb = weights(greedy / "checkpoint-4" / "model"), weights(sampled / "checkpoint-4" / "model")
    assert all((wa[k] == wb[k]).all() for k in wa)
    for plain, both in zip(evals(greedy), evals(sampled)):
        assert list(both) == [*plain, "eval/mean@4", "eval/pass@1", "eval/pass@4", "eval/maj@4"]
        assert {k: both[k] for k in plain} == plain
        assert both["eval/pass@1"] == pytest.approx(both["eval/mean@4"]) and both["eval/pass@4"] >= both["eval/pass@1"]
    assert [e["step"] for e in evals(sampled)] == [0, 2, 4]


def test_a_run_with_sampled_evaluation_resumes_as_if_uninterrupted(tmp_path):
    """A crash at the last checkpoint and a resume from the one before: the same weights, metrics
    rows and eval.jsonl, the sampled figures included (each evaluation seeds its own generator)."""
    run_and_crash(tmp_path, ["train.max_steps=4", "train.save_steps=2", *SAMPLED])
    from rlcore.cli import main

    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    wa, wb = weights(a / "checkpoint-4" / "model"), weights(b / "checkpoint-4" / "model")
    assert all((wa[k] == wb[k]).all() for k in wa)
    assert (a / "eval.jsonl").read_text() == (b / "eval.jsonl").read_text()
    assert "eval/maj@4" in evals(b)[-1]
