"""The held-out evaluation: greedy completions of the held-out prompts, scored by the task's
accuracy and by the run's reward functions, before training, every train.eval_steps, and after.
With train.eval_num_generations = n > 1, also n sampled completions per prompt, scored as papers
report them: mean@n, pass@k (Chen et al.'s unbiased estimator) and maj@n (`evaluate_sampled`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch

from rlcore.losses.advantages import weighted_rewards
from rlcore.models.tokenizer import Tokenizer
from rlcore.models.transformer import Transformer
from rlcore.parallel import collectives
from rlcore.rewards.answers import completion_text, extract_answer, parse_number
from rlcore.rewards.scoring import RewardState, dataset_columns, reward_extras, reward_inputs, score_completions
from rlcore.rollout.completions import (ToolRows, completion_texts, completion_token_ids, sample_completions,
                                        tool_reward_kwargs)
from rlcore.run.setup import Run
from rlcore.run.state import RunState
from rlcore.run.steplog import Progress


@dataclass
class EvalRewards:
    """The reward functions, for `evaluate`: their metric names (Run.reward_names), weights
    (Run.reward_weights) and `score(prompts, completions, columns, completion_ids, logged,
    tool_kwargs)`, which returns R [n, F] (score_completions') and appends log_metric values to
    `logged`; `tool_kwargs` is what a rollout with tools adds to the reward call ({} without)."""
    names: list[str]
    weights: list[float]
    score: Callable[..., torch.Tensor]


@torch.no_grad()
def evaluate(model: Transformer, tok: Tokenizer, examples: list[dict], accuracy_fn: Callable, max_new_tokens: int,
             batch_size: int = 128, rank: int = 0, world: int = 1, device: torch.device | None = None,
             rewards: EvalRewards | None = None, stop_sequences: list[list[int]] = (),
             tool_turns: ToolRows | None = None,
             max_turns: int | None = None) -> dict:
    """Held-out metrics of greedy completions: `eval/accuracy`, the fraction of prompts whose
    greedy answer scores 1 (a prompt the accuracy function cannot score, None, counts as wrong),
    or None when it scores none of them (no held-out prompts, data.num_eval = 0, or none with an
    answer to check). With `rewards` (EvalRewards), the reward functions score the same
    completions too, as TRL's evaluation does: `eval/reward/mean` (the weighted sum, over the
    prompts some function scored), `eval/reward/<name>/mean` per function, and `eval/<name>` per
    log_metric name, each None when nothing was scored. A completion ends at EOS or at one of
    `stop_sequences` (token ids: the rollout's, rollout.stop). Each of the `world` ranks answers
    every world-th prompt; every rank must call it, and a reward function's failure on one rank
    stops every rank. With tools, `tool_turns(rows)` gives the rows' prompts and the rollout's
    end_of_turn (Run.tool_turns), completions run over up to `max_turns` tool-calling turns, the
    reward functions get them as messages (and `environments=`), and `eval/tools/used_frac` and
    `eval/tools/call_frequency` say how often the greedy policy called a tool.
    A long evaluation (a real model on CPU) says how many prompts rank 0 has done."""
    correct, scored, columns = 0.0, 0, dataset_columns(examples)
    mine, progress = examples[rank::world], Progress("held-out eval", enabled=rank == 0)
    share = f" (rank 0's share of {len(examples)})" if world > 1 else ""
    # [sum, count] of the weighted reward (column 0) and of each reward function's scores
    totals = torch.zeros(2, 1 + (len(rewards.names) if rewards else 0), dtype=torch.float64)
    weights = torch.tensor(rewards.weights if rewards else [], dtype=torch.float64)
    logged, failure, used, calls = defaultdict(list), None, 0, 0
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        rollout, turns = sample_completions(model, tok, chunk, max_new_tokens, tool_turns=tool_turns,
                                            max_turns=max_turns, temperature=0.0, stop_sequences=stop_sequences)
        completion_ids = completion_token_ids(rollout)
        prompts, completions, values = reward_inputs(chunk, completion_texts(tok, completion_ids, turns), columns)
        scores = accuracy_fn(prompts=prompts, completions=completions, **values)
        correct += sum(1.0 for s in scores if s is not None and s >= 1.0)
        scored += sum(s is not None for s in scores)
        if turns:
            used += sum(count > 0 for count in turns.calls)
            calls += sum(turns.calls)
        if rewards:
            try:
                R = rewards.score(prompts, completions, values, completion_ids, logged,
                                  tool_reward_kwargs(rollout, turns))
            except (ValueError, TypeError, RuntimeError) as e:  # RewardFunctionError is a RuntimeError
                failure = e
                break  # the ranks raise it together below
            R = R.double()
            both = torch.cat([weighted_rewards(R, weights)[:, None], R], dim=1)
            totals += torch.stack([both.nansum(dim=0), (~both.isnan()).sum(dim=0)])
        if i + len(chunk) < len(mine):
            progress.report(f"{i + len(chunk)}/{len(mine)} prompts{share}")
    if rewards:
        collectives.raise_together(failure, world)
        logged = collectives.concat_over_ranks(logged, world)
    correct, scored, used, calls, *flat = collectives.sum_over_ranks(
        [correct, scored, used, calls, *totals.flatten().tolist()], world, device)
    out = {"eval/accuracy": correct / len(examples) if scored else None}
    if tool_turns and examples:
        out.update({"eval/tools/used_frac": used / len(examples), "eval/tools/call_frequency": calls / len(examples)})
    if rewards:
        means = [total / count if count else None for total, count in torch.tensor(flat).view(2, -1).T.tolist()]
        out["eval/reward/mean"] = means[0]
        out.update({f"eval/reward/{name}/mean": mean for name, mean in zip(rewards.names, means[1:])})
        if taken := sorted(name for name in logged if f"eval/{name}" in out):  # every rank has every name
            raise ValueError(f"a reward function's log_metric name {taken[0]!r} is logged as eval/{taken[0]} in the "
                             f"held-out evaluation, one of rlcore's own held-out metrics; log it under another name "
                             f"(e.g. 'custom/{taken[0]}')")
        out.update({f"eval/{name}": sum(v) / len(v) for name, v in logged.items()})
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n completions of a prompt, c of them correct (Chen et al.
    2021, arXiv:2107.03374, eq. 1): the chance that k of the n, drawn without replacement, hold a
    correct one, 1 - C(n - c, k) / C(n, k). Exact integers, one rounding in the division."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def answer_key(completion) -> Fraction | str | None:
    """What a completion votes for in maj@n: its final answer (`extract_answer`), a number as a
    number ("1,000" = "1000.0"), other text up to whitespace; None without one (no vote)."""
    answer = extract_answer(completion_text(completion))
    if answer is None:
        return None
    number = parse_number(answer)
    return number if number is not None else " ".join(answer.split())


def majority_vote(keys: list) -> int | None:
    """The index of the completion that carries the vote over `keys` (answer_key's, None = no vote):
    the first completion with the most frequent answer, ties going to the answer given first;
    None when no completion has an answer."""
    votes = Counter(key for key in keys if key is not None)
    if not votes:
        return None
    most = max(votes.values())
    return next(i for i, key in enumerate(keys) if key is not None and votes[key] == most)


@dataclass
class SampledEval:
    """The n > 1 held-out evaluation: `n` completions per prompt, sampled with generate's keywords
    `sampling` (temperature, top_k, ...) and a generator seeded with `seed`, and the `ks` of pass@k."""
    n: int
    ks: list[int]
    seed: int
    sampling: dict


EVAL_SEED_OFFSET = 2**32
"""The sampled evaluation's generator is seeded rollout.seed + EVAL_SEED_OFFSET + rank at every
evaluation: the same draws each time, and none of the training sampler's (rollout.seed + rank)."""


@torch.no_grad()
def evaluate_sampled(model: Transformer, tok: Tokenizer, examples: list[dict], accuracy_fn: Callable,
                     max_new_tokens: int, sampled: SampledEval, batch_size: int = 128, rank: int = 0, world: int = 1,
                     device: torch.device | None = None, stop_sequences: list[list[int]] = (),
                     tool_turns: ToolRows | None = None, max_turns: int | None = None) -> dict:
    """Held-out metrics of `sampled.n` sampled completions per prompt, each prompt's c of n correct
    (the accuracy function scores 1; None counts as wrong), averaged over the prompts:
    `eval/mean@n` = c / n, `eval/pass@k` = `pass_at_k(n, c, k)` for each k of `sampled.ks`, and
    `eval/maj@n` = whether the answer most of the n give (`majority_vote`) is right. Each is None
    when the accuracy function scores no completion. Seeded by `sampled.seed` alone, so the same
    weights give the same figures whenever they are evaluated (in the same batches: of
    `batch_size` completions, each of the `world` ranks taking every world-th prompt; every rank
    must call it)."""
    n, columns = sampled.n, dataset_columns(examples)
    mine, progress = examples[rank::world], Progress("held-out eval, sampled", enabled=rank == 0)
    generator = torch.Generator().manual_seed(sampled.seed)
    per_batch = max(1, batch_size // n)  # prompts per batch
    scored, mean, majority, passed = 0, 0.0, 0, [0.0] * len(sampled.ks)
    for i in range(0, len(mine), per_batch):
        chunk = mine[i:i + per_batch]
        rows = [example for example in chunk for _ in range(n)]
        rollout, turns = sample_completions(model, tok, rows, max_new_tokens, tool_turns=tool_turns,
                                            max_turns=max_turns, stop_sequences=stop_sequences, generator=generator,
                                            **sampled.sampling)
        prompts, completions, values = reward_inputs(rows, completion_texts(tok, completion_token_ids(rollout), turns),
                                                     columns)
        scores = accuracy_fn(prompts=prompts, completions=completions, **values)
        for first in range(0, len(rows), n):
            correct = [s is not None and s >= 1.0 for s in scores[first:first + n]]
            scored += any(s is not None for s in scores[first:first + n])
            c = sum(correct)
            mean += c / n
            passed = [total + pass_at_k(n, c, k) for total, k in zip(passed, sampled.ks)]
            winner = majority_vote([answer_key(completion) for completion in completions[first:first + n]])
            majority += winner is not None and correct[winner]
        if i + len(chunk) < len(mine):
            progress.report(f"{i + len(chunk)}/{len(mine)} prompts")
    scored, mean, majority, *passed = collectives.sum_over_ranks([scored, mean, majority, *passed], world, device)

    def over_prompts(total: float) -> float | None:
        return total / len(examples) if scored else None

    return {f"eval/mean@{n}": over_prompts(mean),
            **{f"eval/pass@{k}": over_prompts(total) for k, total in zip(sampled.ks, passed)},
            f"eval/maj@{n}": over_prompts(majority)}


def held_out(run: Run, state: RunState) -> dict:
    """`evaluate` of the run's policy on its held-out prompts, with its reward functions told the
    run's progress (`trainer_state`) as at `state`; with train.eval_num_generations > 1, then
    `evaluate_sampled`, with the rollout's sampling options at train.eval_temperature."""
    cfg, rollout_cfg = run.cfg, run.cfg.rollout

    def score(prompts, completions, values, completion_ids, logged, tool_kwargs) -> torch.Tensor:
        reward_state = RewardState(state.step, run.geometry.max_steps, state.data_pos / len(run.train_set),
                                   cfg.train.num_train_epochs)
        reward_kwargs = reward_extras(  # completions.jsonl holds the rounds' log_extra columns only
            completion_ids, reward_state, log_metric=lambda name, value: logged[name].append(float(value)),
            log_extra=lambda column, values: None)
        return score_completions(run.reward_funcs, prompts, completions, values, cfg.loss.reward_on_error,
                                 {**reward_kwargs, **tool_kwargs})

    rewards = EvalRewards(run.reward_names, run.reward_weights or [1.0] * len(run.reward_funcs), score)
    tools = {"tool_turns": run.tool_turns if run.toolbox else None, "max_turns": rollout_cfg.max_tool_calling_iterations}
    run.model.eval()  # greedy completions of the policy without LoRA dropout
    with run.generating() as policy:  # under FSDP a plain copy, its full weights gathered once
        out = evaluate(policy, run.tok, run.eval_set, run.accuracy_fn, cfg.train.eval_max_completion_length,
                       rank=run.rank, world=run.world, device=run.device, rewards=rewards,
                       stop_sequences=run.stop_sequences, **tools)
        if cfg.train.eval_num_generations > 1:
            temperature = rollout_cfg.temperature if cfg.train.eval_temperature is None else cfg.train.eval_temperature
            sampling = {"temperature": temperature, "top_k": rollout_cfg.top_k, "top_p": rollout_cfg.top_p,
                        "min_p": rollout_cfg.min_p, "repetition_penalty": rollout_cfg.repetition_penalty}
            sampled = SampledEval(cfg.train.eval_num_generations, cfg.train.eval_pass_at_k,
                                  seed=rollout_cfg.seed + EVAL_SEED_OFFSET + run.rank, sampling=sampling)
            out.update(evaluate_sampled(policy, run.tok, run.eval_set, run.accuracy_fn,
                                        cfg.train.eval_max_completion_length, sampled, rank=run.rank,
                                        world=run.world, device=run.device, stop_sequences=run.stop_sequences,
                                        **tools))
    return out
