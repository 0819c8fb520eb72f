"""The GRPO training loop: one function, read top to bottom.

    for each round:
        rollout      G completions for each of b*S*P/G prompts      (rlcore.rollout)
        rewards      reward functions -> R[N, F]                        (rlcore.rewards.scoring)
        (rollout.filter_groups: both again on new prompts until N/G groups' rewards differ;
         DAPO's dynamic sampling, rlcore.rollout.dynamic_sampling)
        advantages   group-normalised, over the whole round            (rlcore.losses.advantages)
        old / ref    log-probs under no_grad, only when needed          (SPEC 1)
        for replay in range(mu):                                        (mu = num_iterations)
            for each optimizer step, GA of the S micro-batches:         (S / GA steps)
                its distinct prompts, forward once                      (forward.SharedPrompts)
                for each of its micro-batches:
                    per-token loss -> aggregate -> backward             (rlcore.losses)
                the prompts' backward, grad-norm clip, optimizer step, metrics
        eval, checkpoint

The loop's comments `# 1.` to `# 6.` mark these steps (rollout; rewards and advantages; old / ref;
the replay; the loss; the optimizer step and its metrics), and eval and checkpoint end each round.

The loop's own flags (off-policy or not, beta, TIS, the entropy bonus, a synced reference, dynamic
sampling) are `if`s in `train()`; the loss's options are one `rlcore.losses.PolicyLossOptions`,
built from the config's [loss] section. Everything before the first round (models, tokenizer, data, reward
functions, geometry, optimizer, run directory) is `rlcore.run.setup`'s `Run`; the run's counters
and RNGs are one `RunState`; its directory, checkpoints and resume are `run.dir`, a `RunDir`; its
metrics rows are `StepLog`'s; the held-out evaluation is `rlcore.evaluation`. The helpers above
`train()` each do one of its passes; none of them decides a step.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch

from rlcore import RlcoreWarning
from rlcore.config import Config
from rlcore.evaluation import held_out
from rlcore.forward import SharedPrompts, completion_logprobs, pack
from rlcore.losses.advantages import compute_advantages
from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.masks import entropy_mask, mask_truncated, tis_weights
from rlcore.losses.policy import PolicyLossOptions, policy_loss
from rlcore.models.transformer import Transformer, mix_into
from rlcore.parallel import collectives, fsdp
from rlcore.parallel.sampler_ranks import RemoteRounds, serve_rounds
from rlcore.rewards.scoring import RewardFunctionError, RewardState, reward_extras, reward_inputs, score_completions
from rlcore.rollout.completions import completion_texts, completion_token_ids, sample_completions, tool_reward_kwargs
from rlcore.rollout.dynamic_sampling import GenerationBatches
from rlcore.rollout.engine import Rollout
from rlcore.rollout.sources import InlineRounds, ThreadedRounds
from rlcore.run.rundir import RunDir, resume_command
from rlcore.run.setup import Run, setup
from rlcore.run.state import RunState
from rlcore.run.steplog import MicroBatch, Progress, StepLog, Stepped
from rlcore.tools.turns import ToolCounts, ToolTurns


def next_prompts(examples: list[dict], pos: int, n: int, seed: int) -> list[dict]:
    """Examples pos .. pos+n-1 of an endless stream that reshuffles every pass (seeded)."""
    out = []
    for i in range(pos, pos + n):
        data_pass, j = divmod(i, len(examples))  # a pass over the data, not the loop's replay epoch
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + data_pass))
        out.append(examples[order[j].item()])
    return out


def sample_round(run: Run, policy: Transformer, rows: list[dict], generator: torch.Generator, label: str,
                 fresh_environments: bool = False) -> tuple[Rollout, ToolTurns | None]:
    """Sample one completion for each of `rows` (each prompt already repeated G times, so a group
    may straddle two ranks) with `policy`, the run's sampling options and `generator`; with tools,
    over several turns, and the ToolTurns that counted the calls (else None). `label` names the
    progress lines; `fresh_environments`: environments of the rows' own (a round sampled ahead
    must not reset those the trainer's round still holds)."""
    rollout_cfg = run.cfg.rollout
    progress = Progress(label, enabled=run.main)  # a real model on CPU: minutes
    rows_label = f"{len(rows)} completions" + (" on rank 0" if run.world > 1 else "")
    tool_turns = functools.partial(run.tool_turns, fresh=fresh_environments) if run.toolbox else None
    return sample_completions(
        policy, run.tok, rows, rollout_cfg.max_completion_length,
        tool_turns=tool_turns, max_turns=rollout_cfg.max_tool_calling_iterations,
        temperature=rollout_cfg.temperature, top_k=rollout_cfg.top_k, top_p=rollout_cfg.top_p,
        min_p=rollout_cfg.min_p, repetition_penalty=rollout_cfg.repetition_penalty,
        stop_sequences=run.stop_sequences, generator=generator, dtype=run.amp,
        progress=lambda tokens, finished: progress.report(f"{tokens}/{rollout_cfg.max_completion_length} tokens, "
                                                          f"{finished}/{rows_label} done"))


def round_rows(run: Run, data_pos: int) -> list[dict]:
    """Every rank's rows of the round whose first prompt is `data_pos`: each prompt G times."""
    prompts = next_prompts(run.train_set, data_pos, run.geometry.prompts_per_round, run.cfg.train.seed)
    return [example for example in prompts for _ in range(run.geometry.G)]


def round_source(run: Run, state: RunState) -> InlineRounds | ThreadedRounds | RemoteRounds:
    """Step 1's rounds: sampled in line (rollout.max_staleness = 0), ahead by a sampler thread on
    its own copy of the weights (max_staleness > 0, or rollout.sampler_thread), or by the sampler
    ranks (rollout.rollout_ranks)."""
    rollout_cfg, geometry = run.cfg.rollout, run.geometry
    mine = slice(run.rank * geometry.completions_per_rank, (run.rank + 1) * geometry.completions_per_rank)

    def draw(data_pos: int) -> list[dict]:  # this rank's rows
        return round_rows(run, data_pos)[mine]

    rounds_left = math.ceil((geometry.max_steps - state.step) / geometry.steps_per_round)
    saved = run.saved_state.get("sampler_weights") if run.saved_state else None
    if run.ranks:
        return RemoteRounds(run.ranks, draw, run.generating, state, rollout_cfg.max_staleness,
                            rollout_cfg.weight_sync_steps, rounds_left, saved, run.toolbox, run.tok,
                            f"Resume it with: {resume_command(run.dir.path, run.ranks.world)}")
    if not (rollout_cfg.max_staleness or rollout_cfg.sampler_thread):
        return InlineRounds(functools.partial(sample_round, run), draw, run.generating)
    return ThreadedRounds(functools.partial(sample_round, run, fresh_environments=True), draw, run.generating, state,
                          rollout_cfg.max_staleness, rollout_cfg.weight_sync_steps, rounds_left,
                          geometry.prompts_per_round, saved, rollout_cfg.sampler_timeout)


def sample_for_the_trainers(run: Run) -> dict:
    """A sampler rank's run (rollout.rollout_ranks): it samples the trainer ranks' rows, round
    after round, with the weights trainer rank 0 sends (rlcore.parallel.sampler_ranks)."""
    run.model.eval()
    serve_rounds(run.ranks, run.model, functools.partial(sample_round, run, fresh_environments=True),
                 functools.partial(round_rows, run), run.geometry.completions_per_rank, run.geometry.prompts_per_round,
                 f"Resume it with: {resume_command(run.dir.path, run.ranks.world)}")
    return {"before": None, "after": None, "run_dir": str(run.dir)}


@dataclass
class RoundScores:
    """A round's rewards and advantages, over every rank's rows, and what the metrics need of them."""
    prompts: list  # this rank's rows, as the reward functions saw them
    completions: list
    rewards: torch.Tensor  # R [N, F]: each reward function's score, NaN where it gave none
    advantages: torch.Tensor  # [N]
    stats: dict  # reward statistics and reward/accuracy, on every step's metrics row
    logged: dict[str, float]  # the reward functions' log_metric values, averaged over the round
    extra_columns: dict[str, list]  # their log_extra columns, this rank's rows
    accuracy: torch.Tensor  # [N]: the task's accuracy of each completion, NaN where it cannot score one


def round_advantages(run: Run, rewards: torch.Tensor, accuracy: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The group-normalised advantages `[N]` of a round's rewards R `[N, F]` (SPEC 2), and the
    statistics of its metrics rows: the rewards', and reward/accuracy from the task's `accuracy`
    `[N]` (NaN, a completion the task cannot score, such as one without an answer, counts as 0)."""
    loss_cfg = run.cfg.loss
    advantages, reward_stats = compute_advantages(rewards, run.geometry.G, run.reward_weights, loss_cfg.scale_rewards,
                                                  reward_names=run.reward_names,
                                                  multi_objective_aggregation=loss_cfg.multi_objective_aggregation)
    stats = {**reward_stats,
             "reward/accuracy": None if accuracy.isnan().all() else accuracy.nan_to_num(0.0).mean().item()}
    return advantages, stats


def score_round(run: Run, state: RunState, rows: list[dict], rollout: Rollout, completion_ids: list[list[int]],
                round_start: dict, turns: ToolTurns | None = None) -> RoundScores:
    """Call the reward functions on this rank's rows, then gather every rank's scores and compute
    the group-normalised advantages over the whole round (SPEC 2). A reward function that fails on
    any rank stops every rank; the round has changed no weight yet, so the run is checkpointed at
    its start (`round_start`) first. With tools (`turns`) each completion is its messages, and the
    reward functions also get `tool_mask` and the rows' environments (TRL's `environments=`)."""
    cfg, world, device, n = run.cfg, run.world, run.device, run.geometry.completions_per_rank
    loss_cfg, N, G = cfg.loss, run.geometry.completions_per_round, run.geometry.G
    texts = completion_texts(run.tok, completion_ids, turns)
    prompts, completions, column_values = reward_inputs(rows, texts, run.columns)
    logged, extra_columns = defaultdict(list), {}  # what reward functions report (log_metric, log_extra)
    reward_state = RewardState(state.step, run.geometry.max_steps, (state.data_pos - N // G) / len(run.train_set),
                               cfg.train.num_train_epochs)
    reward_kwargs = reward_extras(
        completion_ids, reward_state, log_metric=lambda name, value: logged[name].append(float(value)),
        log_extra=lambda column, values: extra_columns.setdefault(column, []).extend(values))
    reward_kwargs.update(tool_reward_kwargs(rollout, turns))
    R = failure = None
    try:  # a failure on one rank's rows stops every rank with it (else the others wait at the next all-gather)
        R = score_completions(run.reward_funcs, prompts, completions, column_values, loss_cfg.reward_on_error,
                              reward_kwargs, first_row=run.rank * n)
    except (ValueError, TypeError, RuntimeError) as e:  # RewardFunctionError is a RuntimeError
        failure = e
    with run.dir.saved_on_failure(run, state, round_start, (Exception,)):  # to --resume once the function works
        collectives.raise_together(failure, world)
    logged = collectives.concat_over_ranks(logged, world)  # every rank's log_metric values
    R = collectives.gather_rows(R.to(device), world)  # R (and acc below) from here: every rank's rows
    if run.main and R.isnan().all():
        warnings.warn(f"no reward function scored any completion of round {state.data_pos // (N // G)} (all "
                      f"returned None or NaN), so every advantage is 0 and its steps learn nothing; check "
                      f"loss.reward_funcs and the columns they need (data.answer_column)", RlcoreWarning, stacklevel=3)
    acc = run.accuracy_fn(prompts=prompts, completions=completions, **column_values)
    acc = collectives.gather_rows(torch.tensor([math.nan if a is None else float(a) for a in acc], device=device),
                                  world)  # NaN: a completion the task cannot score (no answer)
    advantages, stats = round_advantages(run, R, acc)
    return RoundScores(prompts, completions, R, advantages, stats, {k: sum(v) / len(v) for k, v in logged.items()},
                       extra_columns, acc)


def new_generation_batches(run: Run) -> GenerationBatches | None:
    """A round's generation batches under dynamic sampling (rollout.filter_groups), judged on the
    weighted total reward or on rollout.filter_groups_metric's scores; None without it."""
    rollout_cfg = run.cfg.rollout
    if not rollout_cfg.filter_groups:
        return None
    metric = rollout_cfg.filter_groups_metric
    return GenerationBatches(run.geometry.prompts_per_round, run.geometry.G, rollout_cfg.max_num_gen_batches,
                             run.reward_weights, None if metric is None else run.cfg.loss.reward_funcs.index(metric))


def kept_round(run: Run, state: RunState, batches: GenerationBatches,
               round_start: dict) -> tuple[Rollout, ToolCounts | None, RoundScores]:
    """The round dynamic sampling trains on (`GenerationBatches.take`: this rank's rows of its N/G
    groups), with the advantages and metrics of those groups. Short of N/G kept groups at the cap,
    a warning (dropped groups fill the round); none kept is an error, once the round's start is
    checkpointed."""
    groups, cap = run.geometry.prompts_per_round, run.cfg.rollout.max_num_gen_batches
    if batches.kept == 0:
        with run.dir.saved_on_failure(run, state, round_start, (ValueError,)):
            raise ValueError(
                f"dynamic sampling kept no group in {len(batches.batches)} generation batches of {groups} prompts "
                f"(rollout.max_num_gen_batches = {cap}): the G completions of every prompt scored alike; check "
                f"that the task is neither too hard nor too easy for the model and that the reward functions "
                f"tell its completions apart, raise rollout.max_num_gen_batches (0 = no cap), or set "
                f"rollout.filter_groups = false")
    if batches.kept < groups and run.main:
        warnings.warn(f"step {state.step + 1}: dynamic sampling kept {batches.kept} of {groups} groups in "
                      f"{len(batches.batches)} generation batches (rollout.max_num_gen_batches = {cap}); the round "
                      f"trains on them and on {groups - batches.kept} more that the filter dropped", RlcoreWarning,
                      stacklevel=3)
    taken = batches.take(run.rank, run.geometry.completions_per_rank, run.world, run.tok.pad_token_id)
    advantages, stats = round_advantages(run, taken.rewards, taken.accuracy)
    stats.update({**batches.metrics(), "dynamic_sampling/prompts_consumed": state.data_pos})
    return taken.rollout, taken.tools, RoundScores(taken.prompts, taken.completions, taken.rewards, advantages, stats,
                                                   taken.logged, taken.extra_columns, taken.accuracy)


@dataclass
class RoundBatch:
    """This rank's rows of a round as training tensors on the device: prompt (left-padded to Lp) +
    completion (right-padded to Tc) in `ids` and `attn` `[n, Lp + Tc]`; `completion_ids`, the loss
    `mask` and the engine's log-probs `samp` `[n, Tc]`; `lengths`, `truncated`, `advantages` `[n]`."""
    ids: torch.Tensor
    attn: torch.Tensor
    Lp: int
    completion_ids: torch.Tensor
    mask: torch.Tensor
    samp: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor
    advantages: torch.Tensor

    @classmethod
    def of(cls, rollout: Rollout, completion_ids: list[list[int]], advantages: torch.Tensor, pad_token_id: int,
           device: torch.device, mask_truncated_completions: bool) -> RoundBatch:
        ids, attn, cids, mask, Lp = pack(rollout.prompt_ids, completion_ids, pad_token_id)
        # the engine's log-probs before the repetition penalty and top-k/top-p/min-p when it kept
        # them: the policy's own (SPEC 4)
        samp = rollout.full_logprobs if rollout.full_logprobs is not None else rollout.sampling_logprobs
        mask, lengths = mask.to(device), rollout.lengths.to(device)
        if rollout.tool_mask is not None:  # tool results are in the sequence, not the model's: out of the loss (TRL)
            mask = mask * rollout.tool_mask[:, :cids.shape[1]].to(device)
            lengths = mask.sum(1).long()  # the model's own tokens, as TRL counts completion lengths
        truncated = rollout.truncated.to(device)
        # SPEC 4.5 applies it last, per micro-batch; once here for the round (as TRL does) the loss is the same,
        # but the entropy mask's quantile and the mismatch metrics skip truncated rows too (docs/losses.md)
        if mask_truncated_completions:
            mask = mask_truncated(mask, truncated)
        return cls(ids.to(device), attn.to(device), Lp, cids.to(device), mask, samp[:, :cids.shape[1]].to(device),
                   lengths, truncated, advantages.to(device))


@torch.no_grad()
def logprobs_in_batches(model: Transformer, batch: RoundBatch, b: int, temperature: float, amp: torch.dtype | None,
                        progress: Progress) -> torch.Tensor:
    """The completions' log-probs `[n, Tc]` under `model` (the old and ref passes), b rows at a
    time, without gradients; `progress` hears how many rows are done."""
    parts, n = [], len(batch.ids)
    for i in range(0, n, b):
        rows = slice(i, i + b)
        parts.append(completion_logprobs(model, batch.ids[rows], batch.attn[rows], batch.Lp,
                                         batch.completion_ids[rows], temperature, amp)[0])
        if i + b < n:
            progress.report(f"{i + b}/{n} completions")
    return torch.cat(parts)


def optimizer_step(run: Run, state: RunState, bad_losses: int) -> Stepped:
    """Average the gradients over the ranks, clip them and step, unless a loss (on any rank) or the
    gradient is not finite: then the step is skipped and counted. The averaged gradient and the
    summed count are the same on every rank, so every rank decides the same. The entropy bonus's
    controller and the learning-rate schedule move on either way."""
    model, opt, world, device, bonus = run.model, run.opt, run.world, run.device, state.bonus
    loss_scale = state.scaler.get_scale() if run.cfg.train.fp16 else None  # the scale this step used
    collectives.average_gradients(model, world)
    state.scaler.unscale_(opt)  # fp16: the gradients back to their size before clipping (else nothing)
    grad_norm = fsdp.clip_grad_norm_(model, run.cfg.train.max_grad_norm or math.inf).item()
    losses_finite = not collectives.sum_over_ranks([bad_losses], world, device)[0]
    finite = math.isfinite(grad_norm) and losses_finite
    if finite:
        state.scaler.step(opt)  # opt.step()
        state.nonfinite_in_row = 0
    elif run.cfg.train.fp16 and losses_finite:  # the loss scale overflowed fp16: update() lowers it
        state.overflow_skips += 1
        if run.main:
            print(f"step {state.step + 1}: fp16 gradients overflowed at loss scale {state.scaler.get_scale():g}; "
                  f"optimizer step skipped, the scale is halved", flush=True)
    else:
        state.nonfinite_in_row += 1
        state.nonfinite_total += 1
        if run.main:
            print(f"step {state.step + 1}: non-finite loss or gradient, optimizer step skipped "
                  f"({state.nonfinite_in_row} in a row)", flush=True)
    state.scaler.update()
    opt.zero_grad(set_to_none=True)
    stepped = Stepped(grad_norm, finite, opt.param_groups[0]["lr"], loss_scale, bonus.applied())
    bonus.end_step(functools.partial(collectives.sum_over_ranks, world=world, device=device))
    with warnings.catch_warnings():  # a skipped step: torch's "scheduler before optimizer" warning
        warnings.simplefilter("ignore" if not finite else "default", UserWarning)
        run.sched.step()
    return stepped


def due(step: int, every: int, steps_per_round: int) -> bool:
    """Whether a multiple of `every` (0: never) fell inside the round that ended at `step`."""
    return bool(every) and step % every < steps_per_round


# ----------------------------------------------------------------------------- the loop

def train(cfg: Config, resume: str | os.PathLike | RunDir | None = None) -> dict:
    """Run GRPO as configured (`cfg` as load_config checked it); returns {'before': acc, 'after':
    acc, 'run_dir': path}. `resume`: a run directory to continue from its latest checkpoint."""
    run = setup(cfg, resume)  # models, tokenizer, data, reward functions, geometry, optimizer, run directory
    if run.ranks and run.ranks.samples:  # rollout.rollout_ranks: this rank samples for the others, and only that
        return sample_for_the_trainers(run)
    loss_cfg, rollout_cfg, train_cfg = cfg.loss, cfg.rollout, cfg.train
    model, ref, device, world, main = run.model, run.ref, run.device, run.world, run.main
    # SPEC 1's batch geometry: a round is N = b*S*world completions, N/G prompts x G samples
    G, b, GA, mu, S = run.geometry.G, run.geometry.b, run.geometry.GA, run.geometry.mu, run.geometry.S
    n, N = run.geometry.completions_per_rank, run.geometry.completions_per_round
    mine = slice(run.rank * n, (run.rank + 1) * n)  # this rank's rows of the round
    max_steps, steps_per_round = run.geometry.max_steps, run.geometry.steps_per_round
    off_policy = run.geometry.off_policy  # old log-probs need a pass of their own (SPEC 1)
    loss_options = PolicyLossOptions.from_config(loss_cfg)
    state = RunState.new(cfg, run.rank, device)
    bonus = state.bonus
    if run.checkpoint:  # resume: every state the next step reads, exactly as the checkpoint left it
        run.dir.restore(run, state)
    else:  # the baseline: held-out accuracy before any step (a reward function's first call)
        baseline = held_out(run, state)
        state.before = baseline["eval/accuracy"]
        run.dir.start(state, baseline, "data.num_eval = 0" if not run.eval_set else
                      f"none of the {len(run.eval_set)} held-out prompts has an answer to check "
                      f"(data.answer_column = {run.answer_column!r})")
    log = StepLog(run, state)
    rounds = round_source(run, state)  # in line, or sampled ahead from older weights (rollout.max_staleness)

    while state.step < max_steps:
        round_start = state.resume_point() | rounds.resume_point()  # checkpointed if scoring fails (step 2)
        round_end = state.step + steps_per_round
        batches = new_generation_batches(run)  # None unless rollout.filter_groups (DAPO's dynamic sampling)
        while batches is None or not batches.full():  # once; with dynamic sampling until N/G groups vary
            # 1. Rollout: G samples per prompt, token ids in and out. Every rank draws the same
            # round of prompts and samples the rows it owns (a group may straddle two ranks).
            # Sampled ahead, the round comes from the weights of `sampled.version`, an older policy.
            with log.timed("rollout"):
                model.eval()  # no LoRA dropout while sampling, nor in the old and ref passes that follow
                sampled = rounds.next(state)
                state.data_pos += N // G
                rows, rollout, turns = sampled.rows, sampled.rollout, sampled.turns

            # 2. Rewards and advantages, over the whole round (all ranks) before it is cut up.
            with log.timed("scoring"):
                completion_ids = completion_token_ids(rollout)
                scores = score_round(run, state, rows, rollout, completion_ids, round_start, turns)
            if batches is None:
                break
            batches.add(rollout, turns, scores)  # a generation batch: its groups whose rewards differ are kept
        with log.timed("scoring"):
            if batches is not None:  # the round: the first N/G kept groups, with advantages over them
                rollout, turns, scores = kept_round(run, state, batches, round_start)
                completion_ids = completion_token_ids(rollout)
            batch = RoundBatch.of(rollout, completion_ids, scores.advantages[mine], run.tok.pad_token_id, device,
                                  loss_cfg.mask_truncated_completions)

        # 3. old log-probs only when the round is off-policy (or TIS needs them); ref only if beta.
        with log.timed("old_logp"):
            old = ref_lp = tis = None  # (the model is still in eval mode: no LoRA dropout in these passes)
            if off_policy or loss_cfg.tis_mode:
                old = logprobs_in_batches(model, batch, b, rollout_cfg.temperature, run.amp,
                                          Progress(f"step {state.step + 1} old log-probs", enabled=main))
            if loss_cfg.beta:
                with run.reference() as reference:
                    ref_lp = logprobs_in_batches(reference, batch, b, rollout_cfg.temperature, run.amp,
                                                 Progress(f"step {state.step + 1} ref log-probs", enabled=main))
            if loss_cfg.tis_mode:
                tis = tis_weights(old, batch.samp, batch.mask, loss_cfg.tis_mode, min=loss_cfg.tis_min,
                                  max=loss_cfg.tis_max)
        log.round(scores, batch.lengths, batch.truncated, batch.mask, batch.samp, turns, old, tis,
                  staleness=state.step - sampled.version)
        if not off_policy:
            old = None  # on-policy: old = logp.detach() inside the loop, the ratio is exactly 1

        # 4. mu-epoch replay: shuffle once, cut into S micro-batches, replay mu times in the same order.
        model.train()
        perm = torch.randperm(n, generator=state.shuffler, device=device)
        micro_rows = [perm[k * b:(k + 1) * b] for k in range(S)]
        for replay in range(mu):  # the metrics' "epoch": which of the mu passes over the round
            for first in range(0, S, GA):  # an optimizer step: GA micro-batches, first .. first + GA - 1
                step_micro = micro_rows[first:first + GA]
                step_rows = torch.cat(step_micro)
                step_tokens = collectives.sum_over_ranks([batch.mask[step_rows].sum().item()], world, device)[0]
                # Each distinct prompt of this optimizer step's micro-batches runs forward once
                # (unless there are more than b of them: then each micro-batch runs its own).
                shared = SharedPrompts.build(model, batch.ids[step_rows], batch.attn[step_rows], batch.Lp, run.amp,
                                             max_prompts=b)
                progress, micro_batches = Progress(f"step {state.step + 1} update", enabled=main), []
                for j, rows in enumerate(step_micro, 1):
                    logp, entropy = completion_logprobs(model, batch.ids[rows], batch.attn[rows], batch.Lp,
                                                        batch.completion_ids[rows], rollout_cfg.temperature, run.amp,
                                                        shared)  # entropy is differentiable: the bonus below
                    # 5. Loss: per token (SPEC 3-4), then this micro-batch's share of the step's (SPEC 5).
                    # The entropy mask (an all-gather under torchrun), once for the loss and the bonus.
                    mask = batch.mask[rows]
                    entropy_keep = None if loss_cfg.top_entropy_quantile == 1.0 else entropy_mask(
                        entropy.detach(), mask, loss_cfg.top_entropy_quantile,
                        functools.partial(collectives.gather_uneven, world=world))
                    # pi_old. On-policy the policy has not moved since it sampled the round, so pi_old is the
                    # current policy: the ratio is 1 in value, the gradient REINFORCE's with the group baseline,
                    # and clip_ratio/* are 0, as expected (SPEC 1).
                    old_rows = logp.detach() if old is None else old[rows]
                    per_token, diagnostics = policy_loss(
                        logp, old_rows, batch.advantages[rows], mask, options=loss_options,
                        ref=None if ref_lp is None else ref_lp[rows], tis_weights=None if tis is None else tis[rows],
                        entropy=entropy.detach(), entropy_keep=entropy_keep, samp=batch.samp[rows])
                    loss = aggregate_loss(per_token, mask, loss_cfg.loss_type, gradient_accumulation_steps=GA,
                                          max_completion_length=rollout_cfg.max_completion_length,
                                          step_tokens=step_tokens, world_size=world)
                    if bonus.enabled:  # loss.entropy_coef: over the tokens the policy loss trains on
                        loss = loss - bonus.term(entropy, mask if entropy_keep is None else entropy_keep, GA)
                    # FSDP reduces the step's gradients in its last backward (a no-op when replicated)
                    fsdp.sync_gradients(model, last=j == len(step_micro) and shared is None)
                    state.scaler.scale(loss).backward()  # fp16: scaled so that small gradients stay normal
                    micro_batches.append(MicroBatch(loss.item(), diagnostics, logp.detach(), rows))
                    if j < len(step_micro):
                        progress.report(f"micro-batch {j}/{len(step_micro)}")
                if shared is not None:
                    fsdp.sync_gradients(model, last=True)
                    shared.backward()  # the prompts' pass, with the gradients its micro-batches left

                # 6. The optimizer step (skipped when a loss or the gradient is not finite), then its metrics.
                stepped = optimizer_step(run, state, bad_losses=sum(not math.isfinite(m.loss) for m in micro_batches))
                state.step += 1
                rounds.trained(state.step)  # a sampler ahead of the loop gets these weights when they are due
                if loss_cfg.sync_ref_model and state.step % loss_cfg.ref_model_sync_steps == 0:
                    mix_into(ref, model, loss_cfg.ref_model_mixup_alpha)  # TR-DPO; the next round's ref log-probs
                log.step(replay, step_rows, micro_batches, stepped)
                if state.nonfinite_in_row >= train_cfg.max_nonfinite_steps:  # after this step's metrics row
                    raise FloatingPointError(f"{state.nonfinite_in_row} non-finite steps in a row "
                                             f"(train.max_nonfinite_steps={train_cfg.max_nonfinite_steps}); lower the "
                                             f"learning rate or check rewards")
                if state.step >= max_steps:
                    break
            if state.step >= max_steps:
                break

        # Eval and checkpoint at round boundaries: a checkpoint holds no half round, except the
        # last one when max_steps ends the run inside a round (the note below says so).
        if due(state.step, train_cfg.eval_steps, steps_per_round) and state.step < max_steps:
            reward_failure = (RewardFunctionError, TypeError, ValueError)  # a reward function's (every rank raises it)
            with run.dir.saved_on_failure(run, state, state.resume_point() | rounds.resume_point(), reward_failure):
                evaluation = held_out(run, state)
            run.dir.record_eval(state.step, evaluation)
        if due(state.step, train_cfg.save_steps, steps_per_round) or state.step >= max_steps:
            run.dir.save(run, state, state.resume_point() | rounds.resume_point())

    rounds.close()
    if main and state.step < round_end:
        print(f"note: max_steps={max_steps} ended the run inside a round of {steps_per_round} optimizer "
              f"steps; a --resume with a larger max_steps starts a new round (the rest of this one is "
              f"not replayed)", flush=True)
    evaluation = held_out(run, state)
    run.dir.record_eval(state.step, evaluation)
    run.dir.close()  # the trackers' (train.report_to) last writes
    collectives.barrier(world)  # the ranks leave together, so none tears its process group down under another
    return {"before": state.before, "after": evaluation["eval/accuracy"], "run_dir": str(run.dir)}
