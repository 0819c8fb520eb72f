"""The GRPO training loop: one function, read top to bottom.

    for each round:
        rollout      G completions for each of b*S*P/G prompts      (rlcore.rollout)
        rewards      reward functions -> R[N, F]                        (rlcore.rewards.score_completions)
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
the replay; the loss; the optimizer step's metrics), and eval and checkpoint end each round.

The loop's own flags (off-policy or not, beta, TIS, the entropy bonus, a synced reference) are
`if`s in `train()`; the loss's options are one `rlcore.losses.PolicyLossOptions`, built from the
config's [loss] section. Everything before the first round (models, tokenizer, data, reward
functions, geometry, optimizer) is `rlcore.setup.setup`'s `Run`; the run's counters and RNGs are
one `rlcore.state.RunState`, which checkpoints keep; the held-out evaluation is
`rlcore.evaluation`. The helpers above `train()` do one of its passes or its bookkeeping; none of
them decides a step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.amp import GradScaler

from rlcore import RlcoreWarning, distributed, rollout, sharding
from rlcore.config import Config
from rlcore.evaluation import completion_token_ids, decode_completions, held_out
from rlcore.forward import SharedPrompts, completion_logprobs, pack
from rlcore.losses.advantages import compute_advantages
from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.entropy import EntropyBonus
from rlcore.losses.masks import entropy_mask, mask_truncated, tis_weights
from rlcore.losses.metrics import rollout_mismatch
from rlcore.losses.policy import PolicyLossOptions, policy_loss
from rlcore.model import Transformer, mix_into
from rlcore.rewards import RewardFunctionError, RewardState, reward_extras, reward_inputs, score_completions
from rlcore.rundir import resume_from_checkpoint, save_checkpoint, save_sharded_checkpoint
from rlcore.runlog import (Progress, add_reward_metrics, log_completions, log_line, memory_metrics, record_eval,
                           reduce_metrics, write_row)
from rlcore.setup import Run, setup
from rlcore.state import RunState
from rlcore.tools import ToolTurns


def clock(device: torch.device) -> float:
    """Wall-clock seconds once the device's queued work is done (CUDA runs asynchronously), so a
    phase's time is its own and not the next one's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def next_prompts(examples: list[dict], pos: int, n: int, seed: int) -> list[dict]:
    """Examples pos .. pos+n-1 of an endless stream that reshuffles every pass (seeded)."""
    out = []
    for i in range(pos, pos + n):
        data_pass, j = divmod(i, len(examples))  # a pass over the data, not the loop's replay epoch
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + data_pass))
        out.append(examples[order[j].item()])
    return out


@torch.no_grad()
def logprobs_in_batches(model: Transformer, ids: torch.Tensor, attn: torch.Tensor, Lp: int, cids: torch.Tensor, b: int,
                        temperature: float, amp: torch.dtype | None, progress: Progress) -> torch.Tensor:
    """The completions' log-probs `[n, Tc]` under `model` (the old and ref passes), b rows at a
    time, without gradients (ids, attn `[n, Lp + Tc]` and cids `[n, Tc]` as `pack` builds them);
    `progress` hears how many rows are done."""
    parts = []
    for i in range(0, len(ids), b):
        parts.append(completion_logprobs(model, ids[i:i + b], attn[i:i + b], Lp, cids[i:i + b], temperature, amp)[0])
        if i + b < len(ids):
            progress.report(f"{i + b}/{len(ids)} completions")
    return torch.cat(parts)


def optimizer_step(run: Run, state: RunState, bad_losses: int) -> tuple[torch.Tensor, bool, float]:
    """Average the gradients over the ranks, clip them and step, unless a loss (on any rank) or the
    gradient is not finite: then the step is skipped and counted. The averaged gradient and the
    summed count are the same on every rank, so every rank decides the same. Returns the gradient
    norm before clipping, whether the step was taken, and the learning rate it used."""
    model, opt, world, device = run.model, run.opt, run.world, run.device
    distributed.average_gradients(model, world)
    state.scaler.unscale_(opt)  # fp16: the gradients back to their size before clipping (else nothing)
    grad_norm = sharding.clip_grad_norm_(model, run.cfg.train.max_grad_norm or math.inf)
    losses_finite = not distributed.sum_over_ranks([bad_losses], world, device)[0]
    finite = math.isfinite(grad_norm.item()) and losses_finite
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
    return grad_norm, finite, opt.param_groups[0]["lr"]  # the rate this step used, before the schedule moves on


def save(run: Run, state: RunState, at: dict) -> None:
    """Checkpoint the run as it is at `state.step`, to continue from `at` (a resume_point: the
    round's start when its scoring failed). Every rank calls it; rank 0 writes, and under
    train.fsdp every rank writes its shards."""
    distributed.check_replicas_agree(run.model, run.world)
    samplers = distributed.gather_objects(at["sampler"], run.world)
    if run.cfg.train.fsdp:  # the optimizer state is in the shards; the last checkpoint gets the full model too
        trainer_state = {"optimizer": None, "scheduler": run.sched.state_dict(), **state.state_dict(at, samplers)}
        with run.generating() if state.step >= run.geometry.max_steps else contextlib.nullcontext() as full_model:
            save_sharded_checkpoint(run, state.step, trainer_state, full_model)
    elif run.main:
        loss = run.cfg.loss
        trainer_state = {"optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(),
                         **state.state_dict(at, samplers)}
        synced = loss.sync_ref_model and state.step >= loss.ref_model_sync_steps
        save_checkpoint(run.dir, state.step, run.model, run.model_dir, trainer_state, run.cfg.train.save_total_limit,
                        run.ref if synced else None)


def sample_round(run: Run, state: RunState, rows: list[dict]) -> tuple[rollout.Rollout, ToolTurns | None]:
    """Sample one completion for each of this rank's `rows` (each prompt already repeated G times,
    so a group may straddle two ranks), with the run's sampling options and RNG; with tools, over
    several turns, and the ToolTurns that counted the calls (else None)."""
    rollout_cfg = run.cfg.rollout
    prompts, turns = run.tool_turns(rows) if run.toolbox else ([row["prompt_ids"] for row in rows], None)
    run.model.eval()  # no LoRA dropout while sampling, nor in the old and ref passes that follow
    progress = Progress(f"step {state.step + 1} rollout", enabled=run.main)  # a real model on CPU: minutes
    rows_label = f"{len(rows)} completions" + (" on rank 0" if run.world > 1 else "")
    with run.generating() as policy:  # under FSDP a plain copy, its full weights gathered once
        ro = rollout.generate(policy, prompts, num_generations=1,
                                max_new_tokens=rollout_cfg.max_completion_length,
                                eos_token_ids=run.tok.eos_token_ids, pad_token_id=run.tok.pad_token_id,
                                temperature=rollout_cfg.temperature, top_k=rollout_cfg.top_k, top_p=rollout_cfg.top_p,
                                min_p=rollout_cfg.min_p, repetition_penalty=rollout_cfg.repetition_penalty,
                                stop_sequences=run.stop_sequences, generator=state.sampler,
                                dtype=run.amp,
                                progress=lambda tokens, finished: progress.report(
                                    f"{tokens}/{rollout_cfg.max_completion_length} tokens, "
                                    f"{finished}/{rows_label} done"),
                                **({"end_of_turn": turns, "max_turns": rollout_cfg.max_tool_calling_iterations}
                                   if turns else {}))
    if turns:
        turns.run_cut_turns(completion_token_ids(ro), ro.truncated.tolist(), rollout_cfg.max_tool_calling_iterations)
    return ro, turns


def tool_metrics(turns: ToolTurns, world: int, device: torch.device) -> dict[str, float]:
    """The round's tool use over all ranks: calls per completion, failures per call, tool-calling
    turns per completion and the fraction of completions that called a tool (TRL's metrics)."""
    calls, failures, turn_count, used, rows = distributed.sum_over_ranks(
        [sum(turns.calls), sum(turns.failures), sum(turns.turns), sum(c > 0 for c in turns.calls), len(turns.calls)],
        world, device)
    return {"tools/call_frequency": calls / rows, "tools/failure_frequency": failures / max(calls, 1),
            "tools/turns": turn_count / rows, "tools/used_frac": used / rows}


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


def score_round(run: Run, state: RunState, rows: list[dict], completion_ids: list[list[int]], round_no: int,
                round_start: dict, saved: int, turns: ToolTurns | None = None) -> RoundScores:
    """Call the reward functions on this rank's rows, then gather every rank's scores and compute
    the group-normalised advantages over the whole round (SPEC 2). A reward function that fails on
    any rank stops every rank; the round has changed no weight yet, so its start (`round_start`) is
    checkpointed first when no checkpoint holds the steps taken since `saved`. With tools (`turns`)
    each completion is its messages, and the rows' environments are TRL's `environments=`."""
    cfg, world, device, n = run.cfg, run.world, run.device, run.geometry.completions_per_rank
    loss_cfg, N, G = cfg.loss, run.geometry.completions_per_round, run.geometry.G
    texts = turns.conversations(completion_ids) if turns else decode_completions(run.tok, completion_ids)
    prompts, completions, column_values = reward_inputs(rows, texts, run.columns)
    logged, extra_columns = defaultdict(list), {}  # what reward functions report (log_metric, log_extra)
    reward_state = RewardState(state.step, run.geometry.max_steps, (state.data_pos - N // G) / len(run.train_set),
                               cfg.train.num_train_epochs)
    reward_kwargs = reward_extras(
        completion_ids, reward_state, log_metric=lambda name, value: logged[name].append(float(value)),
        log_extra=lambda column, values: extra_columns.setdefault(column, []).extend(values))
    if turns and run.toolbox.environment_factory is not None:
        reward_kwargs["environments"] = turns.environments
    R = failure = None
    try:  # a failure on one rank's rows stops every rank with it (else the others wait at the next all-gather)
        R = score_completions(run.reward_funcs, prompts, completions, column_values, loss_cfg.reward_on_error,
                              reward_kwargs, first_row=run.rank * n)
    except (ValueError, TypeError, RuntimeError) as e:  # RewardFunctionError is a RuntimeError
        failure = e
    try:
        distributed.raise_together(failure, world)
    except Exception:  # keep the round's start, to --resume once the function works
        if state.step > saved:
            save(run, state, round_start)
        raise
    logged = distributed.concat_over_ranks(logged, world)  # every rank's log_metric values
    R = distributed.gather_rows(R.to(device), world)  # R (and acc below) from here: every rank's rows
    if run.main and R.isnan().all():
        warnings.warn(f"no reward function scored any completion of round {round_no} (all returned None or "
                      f"NaN), so every advantage is 0 and its steps learn nothing; check loss.reward_funcs and "
                      f"the columns they need (data.answer_column)", RlcoreWarning, stacklevel=3)
    advantages, reward_stats = compute_advantages(R, G, run.reward_weights, loss_cfg.scale_rewards,
                                                  reward_names=run.reward_names,
                                                  multi_objective_aggregation=loss_cfg.multi_objective_aggregation)
    acc = run.accuracy_fn(prompts=prompts, completions=completions, **column_values)
    acc = distributed.gather_rows(torch.tensor([math.nan if a is None else float(a) for a in acc], device=device),
                                  world)  # NaN: a completion the task cannot score (no answer), counted as 0
    stats = {**reward_stats, "reward/accuracy": None if acc.isnan().all() else acc.nan_to_num(0.0).mean().item()}
    return RoundScores(prompts, completions, R, advantages, stats, {k: sum(v) / len(v) for k, v in logged.items()},
                       extra_columns)


def start_new_run(run: Run, state: RunState) -> None:
    """The baseline: held-out accuracy before any RL step (a reward function's first call), and the
    run's files started afresh."""
    baseline = held_out(run, state)
    state.before = baseline["eval/accuracy"]
    if run.main:
        (run.dir / "metrics.jsonl").write_text("")
        (run.dir / "eval.jsonl").write_text("")
        (run.dir / "completions.jsonl").unlink(missing_ok=True)  # a crashed attempt's, before any checkpoint
        record_eval(run.dir, 0, baseline)
        if state.before is None:
            print("no held-out accuracy: " + ("data.num_eval = 0" if not run.eval_set else
                  f"none of the {len(run.eval_set)} held-out prompts has an answer to check "
                  f"(data.answer_column = {run.answer_column!r})"), flush=True)


# ----------------------------------------------------------------------------- the loop

def train(cfg: Config, resume: str | os.PathLike | None = None) -> dict:
    """Run GRPO as configured; returns {'before': acc, 'after': acc, 'run_dir': path}.

    `resume`: a run directory to continue from its latest checkpoint. The run directory gets
    the config as config.toml (the one `rlcore train --resume` reads back) once the inputs load.
    """
    run = setup(cfg, resume)  # models, tokenizer, data, reward functions, geometry, optimizer (rlcore.setup)
    train_cfg, loss_cfg, rollout_cfg = cfg.train, cfg.loss, cfg.rollout  # the train, loss and rollout sections
    model, ref, tok, sched = run.model, run.ref, run.tok, run.sched
    rank, world, device, main, run_dir = run.rank, run.world, run.device, run.main, run.dir
    train_set = run.train_set
    # SPEC 1's batch geometry: a round is N = b*S*world completions, N/G prompts x G samples
    G, b, GA, mu, S = run.geometry.G, run.geometry.b, run.geometry.GA, run.geometry.mu, run.geometry.S
    n, N = run.geometry.completions_per_rank, run.geometry.completions_per_round
    mine = slice(rank * n, (rank + 1) * n)  # this rank's rows of the round
    max_steps, steps_per_round = run.geometry.max_steps, run.geometry.steps_per_round
    off_policy = run.geometry.off_policy  # old log-probs need a pass of their own (SPEC 1)
    amp = run.amp  # autocast (bf16 or fp16) for the training forward passes and the rollout
    loss_options = PolicyLossOptions.from_config(loss_cfg)
    state = RunState(sampler=torch.Generator(device=device).manual_seed(rollout_cfg.seed + rank),  # rollout sampling
                     shuffler=torch.Generator(device=device).manual_seed(train_cfg.seed),  # micro-batch order
                     bonus=EntropyBonus(loss_cfg.entropy_coef, loss_cfg.use_adaptive_entropy, loss_cfg.entropy_target,
                                        loss_cfg.entropy_coef_delta, loss_cfg.entropy_coef_min,
                                        loss_cfg.entropy_coef_max),
                     scaler=GradScaler(device.type, enabled=train_cfg.fp16))  # fp16's dynamic loss scale
    bonus, metrics_file = state.bonus, run_dir / "metrics.jsonl"
    if run.checkpoint:  # resume: every state the next step reads, exactly as the checkpoint left it
        resume_from_checkpoint(run, state)
    else:
        start_new_run(run, state)

    saved = state.step  # the step of the newest checkpoint (0: none yet)
    while state.step < max_steps:
        round_start = state.resume_point()  # checkpointed if scoring fails (step 2), before any weight changes
        # 1. Rollout: G samples per prompt, token ids in and out. Every rank draws the same
        # round of prompts and samples the rows it owns (a group may straddle two ranks).
        t0 = clock(device)
        batch = next_prompts(train_set, state.data_pos, N // G, train_cfg.seed)
        state.data_pos += N // G
        # the round's number (for the warning below) and the step it ends at (for the note after the loop);
        # counted from data_pos and step, since a resume may start after a round that max_steps cut short
        round_no, round_end = state.data_pos // (N // G), state.step + steps_per_round
        rows = [ex for ex in batch for _ in range(G)][mine]
        ro, turns = sample_round(run, state, rows)
        t_rollout = clock(device) - t0

        # 2. Rewards and advantages, over the whole round (all ranks) before it is cut up.
        t0 = clock(device)
        completion_ids = completion_token_ids(ro)
        scores = score_round(run, state, rows, completion_ids, round_no, round_start, saved, turns)
        adv = scores.advantages[mine]

        # The round as training tensors: prompt (left-padded) + completion (right-padded): ids and attn
        # [n, Lp + Tc]; cids, mask and samp [n, Tc]; adv, lengths and truncated [n].
        ids, attn, cids, mask, Lp = pack(ro.prompt_ids, completion_ids, tok.pad_token_id)
        ids, attn, cids, mask = ids.to(device), attn.to(device), cids.to(device), mask.to(device)
        # the engine's log-probs, before the repetition penalty and top-k/top-p/min-p when it kept
        # them: the policy's own (SPEC 4)
        samp = ro.full_logprobs if ro.full_logprobs is not None else ro.sampling_logprobs
        samp = samp[:, :cids.shape[1]].to(device)
        lengths = ro.lengths.to(device)
        if ro.tool_mask is not None:  # tool results are in the sequence, not the model's: out of the loss (TRL)
            mask = mask * ro.tool_mask[:, :cids.shape[1]].to(device)
            lengths = mask.sum(1).long()  # the model's own tokens, as TRL counts completion lengths
        truncated = ro.truncated.to(device)
        # SPEC 4.5 applies it last, per micro-batch; once here for the round (as TRL does) the loss is the same,
        # but the entropy mask's quantile and the mismatch metrics skip truncated rows too (docs/losses.md)
        if loss_cfg.mask_truncated_completions:
            mask = mask_truncated(mask, truncated)
        adv = adv.to(device)
        every_length = distributed.gather_rows(lengths, world)  # the round's completions, all ranks
        every_truncated = distributed.gather_rows(truncated.float(), world)
        round_stats = {**scores.stats,
                       "completion/len_mean": every_length.float().mean().item(),
                       "completion/len_min": every_length.min().item(), "completion/len_max": every_length.max().item(),
                       "completion/truncated_frac": every_truncated.mean().item(),
                       "tokens_per_s/rollout": every_length.sum().item() / max(t_rollout, 1e-9),
                       **(tool_metrics(turns, world, device) if turns else {})}
        if train_cfg.log_completions:  # every rank's texts and log_extra columns; rank 0 writes them
            texts = distributed.gather_objects((scores.prompts, scores.completions, scores.extra_columns), world)
            if main:
                log_completions(run_dir, state.step + 1, texts, scores.rewards, scores.advantages, every_length,
                                run.reward_names, train_cfg.num_completions_to_print)
        t_score = clock(device) - t0

        # 3. old log-probs only when the round is off-policy (or TIS needs them); ref only if beta.
        t0 = clock(device)
        old = ref_lp = tis = None  # (the model is still in eval mode: no LoRA dropout in these passes)
        if off_policy or loss_cfg.tis_mode:
            old = logprobs_in_batches(model, ids, attn, Lp, cids, b, rollout_cfg.temperature, amp,
                                      Progress(f"step {state.step + 1} old log-probs", enabled=main))
        if loss_cfg.beta:
            with run.reference() as reference:
                ref_lp = logprobs_in_batches(reference, ids, attn, Lp, cids, b, rollout_cfg.temperature, amp,
                                             Progress(f"step {state.step + 1} ref log-probs", enabled=main))
        if loss_cfg.tis_mode:
            tis = tis_weights(old, samp, mask, loss_cfg.tis_mode, min=loss_cfg.tis_min, max=loss_cfg.tis_max)
        t_old = clock(device) - t0
        # Engine vs trainer log-probs: over the round from `old` when it was computed, else per
        # micro-batch from logp.detach() (on-policy, every micro-batch runs before the step).
        mismatch = None if old is None else reduce_metrics(
            [{k: float(v) for k, v in rollout_mismatch(old, samp, mask, tis).items()}], world, device)
        if mismatch is not None:
            mismatch.pop("tokens")
        if not off_policy:
            old = None  # on-policy: old = logp.detach() inside the loop, the ratio is exactly 1
        round_times = {"time/rollout": t_rollout, "time/scoring": t_score, "time/old_logp": t_old}

        # 4. mu-epoch replay: shuffle once, cut into S micro-batches, replay mu times in the same order.
        model.train()
        perm = torch.randperm(n, generator=state.shuffler, device=device)
        micro = [perm[k * b:(k + 1) * b] for k in range(S)]
        update_start, step_metrics = clock(device), []
        for replay in range(mu):  # the metrics' "epoch": which of the mu passes over the round
            for first in range(0, S, GA):  # an optimizer step: GA micro-batches, first .. first + GA - 1
                step_micro = micro[first:first + GA]
                step_rows = torch.cat(step_micro)
                # active tokens of the step (for dapo) and its completion tokens (for tokens/s)
                step_tokens, step_completion_tokens = distributed.sum_over_ranks(
                    [mask[step_rows].sum().item(), lengths[step_rows].sum().item()], world, device)
                # Each distinct prompt of this optimizer step's micro-batches runs forward once
                # (unless there are more than b of them: then each micro-batch runs its own).
                shared = SharedPrompts.build(model, ids[step_rows], attn[step_rows], Lp, amp, max_prompts=b)
                update_progress = Progress(f"step {state.step + 1} update", enabled=main)
                for j, mb in enumerate(step_micro, 1):  # mb: the micro-batch's rows
                    # entropy is differentiable: the bonus below
                    logp, entropy = completion_logprobs(model, ids[mb], attn[mb], Lp, cids[mb],
                                                        rollout_cfg.temperature, amp, shared)
                    # 5. Loss: per token (SPEC 3-4), then this micro-batch's share of the step's (SPEC 5).
                    # The entropy mask (an all-gather under torchrun), once for the loss and the bonus.
                    entropy_keep = None if loss_cfg.top_entropy_quantile == 1.0 else \
                        entropy_mask(entropy.detach(), mask[mb], loss_cfg.top_entropy_quantile,
                                     functools.partial(distributed.gather_uneven, world=world))
                    # pi_old. On-policy the policy has not moved since it sampled the round, so pi_old is the
                    # current policy: the ratio is 1 in value, the gradient REINFORCE's with the group baseline,
                    # and clip_ratio/* are 0, as expected (SPEC 1).
                    old_mb = logp.detach() if old is None else old[mb]
                    per_token, diagnostics = policy_loss(
                        logp, old_mb, adv[mb], mask[mb], options=loss_options,
                        ref=None if ref_lp is None else ref_lp[mb], tis_weights=None if tis is None else tis[mb],
                        entropy=entropy.detach(), entropy_keep=entropy_keep, samp=samp[mb])
                    loss = aggregate_loss(per_token, mask[mb], loss_cfg.loss_type, gradient_accumulation_steps=GA,
                                          max_completion_length=rollout_cfg.max_completion_length,
                                          step_tokens=step_tokens, world_size=world)
                    if bonus.enabled:  # loss.entropy_coef: over the tokens the policy loss trains on
                        loss = loss - bonus.term(entropy, mask[mb] if entropy_keep is None else entropy_keep, GA)
                    # FSDP reduces the step's gradients in its last backward (a no-op when replicated)
                    sharding.sync_gradients(model, last=j == len(step_micro) and shared is None)
                    state.scaler.scale(loss).backward()  # fp16: scaled so that small gradients stay normal
                    if mismatch is None:  # on-policy: from this micro-batch's own log-probs
                        diagnostics.update(rollout_mismatch(logp.detach(), samp[mb], mask[mb]))  # its `tokens` = diag's
                    # one host sync per value: free on CPU, a wait for the GPU's queue on CUDA
                    step_metrics.append({"loss": loss.item(), **{key: float(v) for key, v in diagnostics.items()}})
                    if j < len(step_micro):
                        update_progress.report(f"micro-batch {j}/{len(step_micro)}")

                if shared is not None:
                    sharding.sync_gradients(model, last=True)
                    shared.backward()  # the prompts' pass, with the gradients its micro-batches left
                bad_losses = sum(not math.isfinite(x["loss"]) for x in step_metrics)
                loss_scale = state.scaler.get_scale() if train_cfg.fp16 else None  # the scale this step used
                grad_norm, finite, lr = optimizer_step(run, state, bad_losses)
                applied = bonus.applied()  # the coefficient this step used, before adaptation
                bonus.end_step(functools.partial(distributed.sum_over_ranks, world=world, device=device))
                with warnings.catch_warnings():  # a skipped step: torch's "scheduler before optimizer" warning
                    warnings.simplefilter("ignore" if not finite else "default", UserWarning)
                    sched.step()
                state.step += 1
                if loss_cfg.sync_ref_model and state.step % loss_cfg.ref_model_sync_steps == 0:
                    # TR-DPO; the next round's ref log-probs use it
                    mix_into(ref, model, loss_cfg.ref_model_mixup_alpha)

                # 6. Metrics (SPEC 6): the round's statistics + this step's diagnostics, all ranks. The
                # round's phase times go on its first step (0 on the others), so times sum over steps.
                t_step = clock(device) - update_start
                row = {"step": state.step, "epoch": replay, **round_stats,
                       **reduce_metrics(step_metrics, world, device),
                       **(mismatch or {}), "grad_norm": grad_norm.item(), "lr": lr, "skipped": not finite,
                       "nonfinite_total": state.nonfinite_total, **round_times, "time/update": t_step,
                       "tokens_per_s/train": step_completion_tokens / max(t_step, 1e-9)}
                if bonus.enabled:  # TRL logs the coefficient after adaptation, for the next step
                    row["entropy_coef"], row["entropy_coef/applied"] = bonus.coef, applied
                if bonus.adaptive:  # what the controller compared with entropy_target (the bonus's tokens)
                    row["entropy_coef/entropy"] = bonus.last_entropy
                if train_cfg.fp16:
                    row["loss_scale"], row["overflow_skips"] = loss_scale, state.overflow_skips
                add_reward_metrics(row, scores.logged)
                round_times = dict.fromkeys(round_times, 0.0)
                row.update(memory_metrics(device, world))
                if main:
                    write_row(metrics_file, row)
                if main and (state.step % train_cfg.logging_steps == 0 or state.step in (1, max_steps)):
                    print(log_line(state.step, max_steps, row), flush=True)
                if state.nonfinite_in_row >= train_cfg.max_nonfinite_steps:  # after this step's metrics row
                    raise FloatingPointError(f"{state.nonfinite_in_row} non-finite steps in a row "
                                             f"(train.max_nonfinite_steps={train_cfg.max_nonfinite_steps}); lower the "
                                             f"learning rate or check rewards")
                step_metrics, update_start = [], clock(device)
                if state.step >= max_steps:
                    break
            if state.step >= max_steps:
                break

        # Eval and checkpoint at round boundaries: a checkpoint holds no half round, except the
        # last one when max_steps ends the run inside a round (the note below says so).
        # (`step % k < steps_per_round`: a multiple of k fell inside the round just trained)
        if train_cfg.eval_steps and state.step % train_cfg.eval_steps < steps_per_round and state.step < max_steps:
            try:
                evaluation = held_out(run, state)
            except (RewardFunctionError, TypeError, ValueError):  # a reward function's (every rank raises it)
                if state.step > saved:
                    save(run, state, state.resume_point())
                raise
            if main:
                record_eval(run_dir, state.step, evaluation)
        if (train_cfg.save_steps and state.step % train_cfg.save_steps < steps_per_round) or state.step >= max_steps:
            save(run, state, state.resume_point())
            saved = state.step

    if main and state.step < round_end:
        print(f"note: max_steps={max_steps} ended the run inside a round of {steps_per_round} optimizer "
              f"steps; a --resume with a larger max_steps starts a new round (the rest of this one is "
              f"not replayed)", flush=True)
    evaluation = held_out(run, state)
    if main:
        record_eval(run_dir, state.step, evaluation)
    distributed.barrier(world)  # the ranks leave together, so none tears its process group down under another
    return {"before": state.before, "after": evaluation["eval/accuracy"], "run_dir": str(run_dir)}
