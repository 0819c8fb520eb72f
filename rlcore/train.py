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
config's [loss] section. The helpers above `train()` set the run up (device, optimizer, schedule,
models, the resume check) or do one of its passes (the round's prompts, evaluation, the old / ref
log-probs); none of them decides a step.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import resource
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcore.checkpoint import (RUN_CONFIG_HEADER, CheckpointError, check_model_dir, check_new_run_dir, checkpoint_step,
                               latest_checkpoint, load_model, load_resumed_model, load_trainer_state, resolve_dtype,
                               resume_command, save_checkpoint)
from rlcore.config import (EMBEDDED_MODEL_PATHS, Config, changed_data, dump_config, embedded_model_name,
                           recorded_model, with_absolute_paths)
from rlcore import RlcoreWarning, distributed
from rlcore.data import encode_prompts, load_examples
from rlcore.embedded import build_embedded_model, cache_dir_name, why_a_model_of_its_own
from rlcore.forward import SharedPrompts, completion_logprobs, pack
from rlcore.geometry import Geometry
from rlcore.losses.advantages import compute_advantages, weighted_rewards
from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.entropy import EntropyBonus
from rlcore.losses.masks import entropy_mask, mask_truncated, tis_weights
from rlcore.losses.metrics import rollout_mismatch
from rlcore.losses.policy import PolicyLossOptions, policy_loss
from rlcore.model import Transformer, mix_into, weight_layout_difference
from rlcore.options import TrainArgs
from rlcore.rewards import (REWARD_EXTRAS, RewardFunctionError, RewardState, check_reward_funcs, dataset_columns,
                            get_reward_funcs, reward_extras, reward_inputs, score_completions)
from rlcore.rollout import Rollout, generate
from rlcore.runlog import Progress, drop_rows_after, log_completions, log_line, record_eval, reduce_metrics
from rlcore.tasks import TASK_REWARD, unique_problems
from rlcore.tokenizer import Tokenizer, check_vocab_fits
from rlcore.validation import validate, warn_bf16_weights


# ----------------------------------------------------------------------------- plumbing

def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r}, but this machine has no CUDA device torch can use; "
                         f"--set train.device=cpu (and --set train.bf16=false unless the CPU has AMX)")
    return device


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    Every micro-batch on CPU allocates the same large tensors again (the kept [N, V] softmax,
    [V, H] gradients, activations). glibc serves large requests with a fresh mmap and unmaps
    them on free, so the kernel zero-fills every page again on first touch. With mmap and
    trimming off, large blocks come from the heap and freed ones stay there for later requests
    (not every one: an aligned request of exactly a freed block's size may not fit it). At the
    shape of bench/train_step.py: 1.9M -> 0.64M page faults over 3 whole steps, and in 3
    alternating pairs of runs on a noisy machine the update took 12.6 s on average against
    13.5 s. The cost: the process keeps its peak memory until it exits. PyTorch's CPU tuning
    guide gets more of the effect by preloading jemalloc or tcmalloc.
    Returns False where this is not glibc (nothing changes then).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def adamw(model: torch.nn.Module, tc: TrainArgs) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on the weight matrices (and embeddings) only: biases and
    norm weights, the 1-D parameters, are not decayed, as in transformers' Trainer (and so TRL)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_epsilon)


def lr_lambda(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """Linear warmup ((step+1)/(warmup+1): no step is wasted at rate 0, where transformers'
    step/warmup spends step 0 at rate 0), then constant, or linear or cosine decay to zero (or
    to min_lr: cosine_with_min_lr), after the warmup transformers' formulas and arguments."""
    tc = cfg.train
    warmup = tc.warmup_steps or math.ceil(tc.warmup_ratio * total_steps)
    kwargs = tc.lr_scheduler_kwargs
    cycles = kwargs.get("num_cycles", 0.5)
    floor = kwargs.get("min_lr_rate", kwargs.get("min_lr", 0.0) / (tc.learning_rate or 1))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if tc.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if tc.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))

    return f


def clock(device: torch.device) -> float:
    """Wall-clock seconds once the device's queued work is done (CUDA runs asynchronously), so a
    phase's time is its own and not the next one's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def check_resumed_model(run: Path, cfg: Config) -> None:
    """A resumed run keeps the model it started from (its config.toml's), and needs it: the
    tokenizer, and with beta the reference model, come from there. Another spelling of the same
    directory is the same model, and so is a new place once the recorded one is gone (moved).
    The embedded model is the one data.seed and data.num_eval built."""
    embedded = cfg.model.path in EMBEDDED_MODEL_PATHS
    started = recorded_model(run / "config.toml")
    now = embedded_model_name(cfg.data.seed, cfg.data.num_eval) if embedded else cfg.model.path
    if not embedded and not Path(now).exists():
        needed = "the tokenizer and the reference model are" if cfg.loss.beta else "the tokenizer is"
        raise FileNotFoundError(f"--resume {run}: the run's model.path {now} is gone (a relative path is taken "
                                f"from the current directory); {needed} read from it: restore it, or give its "
                                f"new place with --set model.path=...")
    if started is None or started == now:
        return
    if embedded or started.startswith("embedded (") or Path(started).exists() and not os.path.samefile(started, now):
        what = ("drop the new data.seed / data.num_eval, which choose the embedded model and its held-out set"
                if embedded and started.startswith("embedded (") else "drop the new model.path")
        raise ValueError(f"--resume {run}: model.path = {now}, but the run started from {started} (its "
                         f"config.toml); a resumed run keeps its model and tokenizer: {what}, or start a new run "
                         f"from a checkpoint's model/ directory")


def reference_model(cfg: Config, model, model_dir: Path, ck: Path | None, dtype: str, device) -> torch.nn.Module:
    """The KL reference: model.ref_path or the initial policy, or on --resume the copy a checkpoint
    holds once loss.sync_ref_model has changed it. sync_ref_model needs the policy's architecture."""
    synced = ck / "ref_model" if ck and (ck / "ref_model").is_dir() else None
    try:
        ref = load_model(synced or cfg.model.ref_path or model_dir, dtype, device).eval()
    except CheckpointError as e:
        if synced or not cfg.model.ref_path:
            raise
        raise CheckpointError(f"model.ref_path: {e}") from None
    differ = weight_layout_difference(ref, model) if cfg.loss.sync_ref_model else None
    if differ:
        raise ValueError(f"loss.sync_ref_model mixes the policy into the reference weight by weight, but "
                         f"model.ref_path = {cfg.model.ref_path} is another architecture ({differ}); use a "
                         f"checkpoint of the policy's architecture or leave model.ref_path unset")
    return ref


def embedded_model_dir(cfg: Config, rank: int = 0, world: int = 1) -> Path:
    """The embedded default checkpoint, built on first run from the task's training problems.

    Cached under $RLCORE_CACHE (default ~/.cache/rlcore), keyed by what decides its contents,
    so the held-out problems of `data.seed` / `data.num_eval` are never in its SFT data.
    Under torchrun local rank 0 of each machine builds it while the other ranks wait, then they
    find it cached (several machines sharing one cache each build apart and keep the first).
    """
    d = cfg.data
    cache = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))
    where = cache / cache_dir_name(d.seed, d.num_eval)
    if d.task != "arithmetic":
        raise ValueError(f"the embedded model is built for data.task = 'arithmetic', not {d.task!r}; set model.path "
                         f"to a Hugging Face checkpoint directory for other tasks (the embedded model, once built, is "
                         f"one: --set model.path={where} trains it on a task its character tokenizer can write)")
    pool = unique_problems("arithmetic", 10**6, d.seed)[d.num_eval:]  # everything but the eval set
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun: the rank on this machine (its cache may be its own)
    if local != 0:
        distributed.barrier(world)
    elif why := why_a_model_of_its_own(cache, d.seed, d.num_eval):
        print(why, flush=True)
    path = build_embedded_model(where, pool)
    if local == 0:
        distributed.barrier(world)
    return path


def next_prompts(examples: list[dict], pos: int, n: int, seed: int) -> list[dict]:
    """Examples pos .. pos+n-1 of an endless stream that reshuffles every pass (seeded)."""
    out = []
    for i in range(pos, pos + n):
        data_pass, j = divmod(i, len(examples))  # a pass over the data, not the loop's replay epoch
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + data_pass))
        out.append(examples[order[j].item()])
    return out


def completion_token_ids(ro: Rollout) -> list[list[int]]:
    """Each completion's token ids, without its padding."""
    return [ids[:n].tolist() for ids, n in zip(ro.completion_ids, ro.lengths.tolist())]


def decode_completions(tok: Tokenizer, completion_ids: list[list[int]]) -> list[str]:
    """Text of each completion, for the reward functions only (training uses the token ids)."""
    return [tok.decode(ids, skip_special_tokens=True) for ids in completion_ids]


@dataclass
class EvalRewards:
    """The reward functions, for `evaluate`: their metric names (loss.reward_funcs), weights
    (loss.reward_weights) and `score(prompts, completions, columns, completion_ids, logged)`,
    which returns R [n, F] (score_completions') and appends log_metric values to `logged`."""
    names: list[str]
    weights: list[float]
    score: Callable[..., torch.Tensor]


@torch.no_grad()
def evaluate(model: Transformer, tok: Tokenizer, examples: list[dict], accuracy_fn: Callable, max_new_tokens: int,
             batch_size: int = 128, rank: int = 0, world: int = 1, device: torch.device | None = None,
             rewards: EvalRewards | None = None, stop_sequences: list[list[int]] = ()) -> dict:
    """Held-out metrics of greedy completions: `eval/accuracy`, the fraction of prompts whose
    greedy answer scores 1 (a prompt the accuracy function cannot score, None, counts as wrong),
    or None when it scores none of them (no held-out prompts, data.num_eval = 0, or none with an
    answer to check). With `rewards` (EvalRewards), the reward functions score the same
    completions too, as TRL's evaluation does: `eval/reward/mean` (the weighted sum, over the
    prompts some function scored), `eval/reward/<name>/mean` per function, and `eval/<name>` per
    log_metric name, each None when nothing was scored. A completion ends at EOS or at one of
    `stop_sequences` (token ids: the rollout's, rollout.stop). Each of the `world` ranks answers
    every world-th prompt; every rank must call it, and a reward function's failure on one rank
    stops every rank. A long evaluation (a real model on CPU) says how many prompts rank 0 has done."""
    correct, scored, columns = 0.0, 0, dataset_columns(examples)
    mine, progress = examples[rank::world], Progress("held-out eval", enabled=rank == 0)
    share = f" (rank 0's share of {len(examples)})" if world > 1 else ""
    # [sum, count] of the weighted reward (column 0) and of each reward function's scores
    totals = torch.zeros(2, 1 + (len(rewards.names) if rewards else 0), dtype=torch.float64)
    weights = torch.tensor(rewards.weights if rewards else [], dtype=torch.float64)
    logged, failure = defaultdict(list), None
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        ro = generate(model, [ex["prompt_ids"] for ex in chunk], 1, max_new_tokens,
                      eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id, temperature=0.0,
                      stop_sequences=stop_sequences)
        completion_ids = completion_token_ids(ro)
        prompts, completions, values = reward_inputs(chunk, decode_completions(tok, completion_ids), columns)
        scores = accuracy_fn(prompts=prompts, completions=completions, **values)
        correct += sum(1.0 for s in scores if s is not None and s >= 1.0)
        scored += sum(s is not None for s in scores)
        if rewards:
            try:
                R = rewards.score(prompts, completions, values, completion_ids, logged)
            except (ValueError, TypeError, RuntimeError) as e:  # RewardFunctionError is a RuntimeError
                failure = e
                break  # the ranks raise it together below
            R = R.double()
            both = torch.cat([weighted_rewards(R, weights)[:, None], R], dim=1)
            totals += torch.stack([both.nansum(dim=0), (~both.isnan()).sum(dim=0)])
        if i + len(chunk) < len(mine):
            progress.report(f"{i + len(chunk)}/{len(mine)} prompts{share}")
    if rewards:
        distributed.raise_together(failure, world)
        logged = distributed.concat_over_ranks(logged, world)
    correct, scored, *flat = distributed.sum_over_ranks([correct, scored, *totals.flatten().tolist()], world, device)
    out = {"eval/accuracy": correct / len(examples) if scored else None}
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


@torch.no_grad()
def logprobs_in_batches(model: Transformer, ids: torch.Tensor, attn: torch.Tensor, Lp: int, cids: torch.Tensor, b: int,
                        temperature: float, amp: bool, progress: Progress) -> torch.Tensor:
    """The completions' log-probs `[n, Tc]` under `model` (the old and ref passes), b rows at a
    time, without gradients (ids, attn `[n, Lp + Tc]` and cids `[n, Tc]` as `pack` builds them);
    `progress` hears how many rows are done."""
    parts = []
    for i in range(0, len(ids), b):
        parts.append(completion_logprobs(model, ids[i:i + b], attn[i:i + b], Lp, cids[i:i + b], temperature, amp)[0])
        if i + b < len(ids):
            progress.report(f"{i + b}/{len(ids)} completions")
    return torch.cat(parts)


# ----------------------------------------------------------------------------- the loop

def train(cfg: Config, resume: str | os.PathLike | None = None) -> dict:
    """Run GRPO as configured; returns {'before': acc, 'after': acc, 'run_dir': path}.

    `resume`: a run directory to continue from its latest checkpoint. The run directory gets
    the config as config.toml (the one `rlcore train --resume` reads back) once the inputs load.
    """
    tc, lc, rc = cfg.train, cfg.loss, cfg.rollout  # the train, loss and rollout sections
    rank, world, device = distributed.init(pick_device(tc.device))  # (0, 1, device) without torchrun
    if device.type == "cpu":
        reuse_freed_memory()
    main = rank == 0  # rank 0 alone prints and writes files
    validate(cfg, world_size=world)
    run = Path(resume or tc.output_dir)
    if not resume:
        check_new_run_dir(run)
    if resume:
        check_resumed_model(run, cfg)
        if changes := changed_data(run / "config.toml", cfg.data):
            warnings.warn(f"--resume {run} with other data: {', '.join(changes)}. The checkpoint's data position "
                          f"counts rows of the old order, the held-out set is drawn again (it may hold prompts the "
                          f"run trained on), and 'before=' stays the old set's accuracy; drop those --set values to "
                          f"continue the run as it was, or start a new run from a checkpoint's model/ directory",
                          RlcoreWarning, stacklevel=2)
    torch.manual_seed(tc.seed)

    # Data and reward functions (checked before a model loads), model, tokenizer.
    train_set, eval_set = load_examples(cfg.data)
    answer_column = cfg.data.answer_column if cfg.data.task == "jsonl" else "answer"  # synthetic tasks': answer
    reward_funcs = get_reward_funcs(lc.reward_funcs, answer_column)
    columns = dataset_columns(train_set)  # passed to every reward call, None where a row lacks one
    check_reward_funcs(reward_funcs, ["prompts", "completions", *REWARD_EXTRAS, *columns])
    model_dir = (Path(cfg.model.path) if cfg.model.path not in EMBEDDED_MODEL_PATHS
                 else embedded_model_dir(cfg, rank, world))
    check_model_dir(model_dir)  # before its tokenizer: an rlcore checkpoint or a LoRA adapter is named as such
    tok = Tokenizer.from_dir(model_dir)
    ck = latest_checkpoint(Path(resume)) if resume else None
    st = load_trainer_state(ck) if ck else None  # before anything is written: a wrong rank count changes nothing
    if st is not None and len(st["sampler_rng"]) != world:
        raise ValueError(f"{ck} was saved by a run on {len(st['sampler_rng'])} rank(s), and this one has {world}; "
                         f"resume it on as many: {resume_command(run, len(st['sampler_rng']))}")
    dtype = resolve_dtype(cfg.model.dtype, model_dir)  # 'auto': the checkpoint's
    if cfg.model.dtype == "auto" and dtype == "bfloat16" and main:
        warn_bf16_weights(cfg, f"model.dtype = 'auto' on {model_dir}, a bfloat16 checkpoint")
    model = load_resumed_model(ck, dtype, device) if ck else load_model(model_dir, dtype, device)
    model.gradient_checkpointing = tc.gradient_checkpointing
    check_vocab_fits(tok, model.config.vocab_size, model_dir)
    ref = reference_model(cfg, model, model_dir, ck, dtype, device) if lc.beta else None
    for split in (train_set, eval_set):
        prompt_ids = encode_prompts(split, tok, cfg.data.system_prompt, cfg.data.use_chat_template,
                                    cfg.data.max_prompt_length, cfg.data.chat_template_kwargs)
        for ex, p in zip(split, prompt_ids):
            ex["prompt_ids"] = p
    for split, new_tokens, option in ((train_set, rc.max_completion_length, "rollout.max_completion_length"),
                                      (eval_set, tc.eval_max_completion_length, "train.eval_max_completion_length")):
        longest = max((len(ex["prompt_ids"]) for ex in split), default=0)
        if main and split and longest + new_tokens > model.config.max_position_embeddings:  # as transformers warns
            warnings.warn(f"the longest prompt ({longest} tokens) + {option} = {new_tokens} is {longest + new_tokens} "
                          f"positions, past {model_dir}'s max_position_embeddings = "
                          f"{model.config.max_position_embeddings} (config.json): the model was not trained there; "
                          f"lower {option} or data.max_prompt_length", RlcoreWarning, stacklevel=2)
    accuracy_fn = get_reward_funcs([TASK_REWARD[cfg.data.task]], answer_column)[0]
    stop_sequences = [ids for s in rc.stop for ids in tok.stop_ids(s)]  # rollout.stop as token ids

    # Batch geometry (SPEC 1): one round = b*S*P completions = that / G prompts x G samples.
    geometry = Geometry.of(cfg, world, len(train_set))  # (TRL's max_steps = -1 counts the epochs)
    G, b, GA, mu, S = geometry.G, geometry.b, geometry.GA, geometry.mu, geometry.S
    n, N = geometry.completions_per_rank, geometry.completions_per_round  # this rank's and all ranks' rows
    mine = slice(rank * n, (rank + 1) * n)
    steps_per_round, max_steps = geometry.steps_per_round, geometry.max_steps
    if main:  # the batch geometry, as TRL's "total train batch size" line gives it
        print(f"{world} rank(s) x {b * S} completions = {N // G} prompts x G={G} per round; micro-batches of {b}, "
              f"an optimizer step every {GA} ({steps_per_round} per round, mu={mu})", flush=True)
    if main and tc.max_steps == -1:
        print(f"num_train_epochs = {tc.num_train_epochs}: {len(train_set)} prompts, {len(train_set) // (N // G)} "
              f"whole rounds of {N // G} per pass, {steps_per_round} optimizer step(s) per round: "
              f"max_steps = {max_steps}", flush=True)
    off_policy = geometry.off_policy  # old log-probs need a pass of their own (SPEC 1)
    amp = tc.bf16  # bf16 autocast for the training forward passes, and a bf16 rollout
    loss_options = PolicyLossOptions.from_config(lc)

    done = checkpoint_step(ck) if ck else 0
    if done >= max_steps:  # a finished run: nothing is evaluated or rewritten
        raise ValueError(f"--resume {run}: its checkpoint is at step {done} and train.max_steps = {max_steps}, so "
                         f"there is nothing to train; continue it with --set train.max_steps={done + 100} (or any "
                         f"number above {done})")
    if main:  # every input loaded and checked: a bad one leaves no run directory behind
        try:
            run.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"train.output_dir = {str(run)!r} cannot be created ({e.strerror or e}); give a directory "
                          f"you can write to, e.g. --set train.output_dir=runs/my-run") from e
        # with absolute paths, so a --resume from another directory finds the model and data
        (run / "config.toml.tmp").write_text(RUN_CONFIG_HEADER + f"# ranks = {world}\n" +
                                             dump_config(with_absolute_paths(cfg)))
        os.replace(run / "config.toml.tmp", run / "config.toml")  # a crash leaves the previous one

    opt = adamw(model, tc)
    schedule = lr_lambda(cfg, max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    sampler = torch.Generator(device=device).manual_seed(rc.seed + rank)  # rollout sampling
    shuffler = torch.Generator(device=device).manual_seed(tc.seed)   # micro-batch order
    bonus = EntropyBonus(lc.entropy_coef, lc.use_adaptive_entropy, lc.entropy_target, lc.entropy_coef_delta,
                         lc.entropy_coef_min, lc.entropy_coef_max)
    step, data_pos, bad_in_row, bad_total = 0, 0, 0, 0
    metrics_file = run / "metrics.jsonl"

    def score_held_out(prompts, completions, values, completion_ids, logged) -> torch.Tensor:
        """The reward functions on held-out completions, as on a round's (`evaluate` calls it)."""
        state = RewardState(step, max_steps, data_pos / len(train_set), tc.num_train_epochs)
        reward_kwargs = reward_extras(  # completions.jsonl holds the rounds' log_extra columns only
            completion_ids, state, log_metric=lambda name, value: logged[name].append(float(value)),
            log_extra=lambda column, values: None)
        return score_completions(reward_funcs, prompts, completions, values, lc.reward_on_error, reward_kwargs)

    held_out_eval = functools.partial(  # the held-out evaluation: before training, every eval_steps, after
        evaluate, model, tok, eval_set, accuracy_fn, tc.eval_max_completion_length, rank=rank, world=world,
        device=device, rewards=EvalRewards(lc.reward_funcs, lc.reward_weights or [1.0] * len(reward_funcs),
                                           score_held_out), stop_sequences=stop_sequences)
    if ck:  # resume: every state the next step reads, exactly as the checkpoint left it
        if len(st["optimizer"]["param_groups"]) != len(opt.param_groups):  # one group before weight decay
            raise ValueError(f"{ck} was saved by an earlier rlcore (its optimizer state has one parameter "
                             "group, decayed or not); resume it with the rlcore version that wrote it")
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        # The saved rate came from the saved run's schedule; a resume with a larger max_steps
        # follows this run's from here on (the same rate when max_steps is unchanged).
        for group, base in zip(opt.param_groups, sched.base_lrs):
            group["lr"] = base * schedule(sched.last_epoch)
        sampler.set_state(st["sampler_rng"][rank])
        shuffler.set_state(st["shuffler_rng"])
        torch.set_rng_state(st["torch_rng"])
        step, data_pos, bad_total, before = st["step"], st["data_pos"], st["nonfinite_total"], st["before"]
        bad_in_row = st.get("nonfinite_in_row", 0)  # absent from checkpoints of earlier versions
        if lc.use_adaptive_entropy and st.get("entropy_bonus"):  # the controller's state (static: the config's)
            bonus.load_state_dict(st["entropy_bonus"])
        if main:
            if metrics_file.is_file():
                kept_rows = metrics_file.read_text().splitlines()[:step]  # one row per step; later (torn) rows go
            else:
                warnings.warn(f"{metrics_file} is missing: its rows up to step {step} are lost; the rows from step "
                              f"{step + 1} on go to a new one", RlcoreWarning, stacklevel=2)
                kept_rows = []
            metrics_file.write_text("".join(ln + "\n" for ln in kept_rows))
            drop_rows_after(run / "eval.jsonl", step)
            drop_rows_after(run / "completions.jsonl", step)
            print(f"resumed from {ck} at step {step}", flush=True)
    else:  # a new run: the baseline, held-out accuracy before any RL step (a reward function's first call)
        baseline = held_out_eval()
        before = baseline["eval/accuracy"]
        if main:
            metrics_file.write_text("")
            (run / "eval.jsonl").write_text("")
            (run / "completions.jsonl").unlink(missing_ok=True)  # a crashed attempt's, before any checkpoint
            record_eval(run, 0, baseline)
            if before is None:
                print("no held-out accuracy: " + ("data.num_eval = 0" if not eval_set else
                      f"none of the {len(eval_set)} held-out prompts has an answer to check "
                      f"(data.answer_column = {answer_column!r})"), flush=True)

    def resume_point() -> dict:
        """Where the next round starts, besides the weights and the optimizer: what a checkpoint keeps."""
        return {"data_pos": data_pos, "sampler": sampler.get_state(), "shuffler": shuffler.get_state(),
                "torch": torch.get_rng_state()}

    def checkpoint(at: dict) -> None:
        """Save the run as it is at `step`, to continue from `at` (resume_point's). Every rank calls it."""
        distributed.check_replicas_agree(model, world)
        samplers = distributed.gather_objects(at["sampler"], world)
        if main:
            state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "sampler_rng": samplers,
                     "shuffler_rng": at["shuffler"], "torch_rng": at["torch"], "step": step,
                     "data_pos": at["data_pos"], "nonfinite_total": bad_total, "nonfinite_in_row": bad_in_row,
                     "before": before, "entropy_bonus": bonus.state_dict() if lc.use_adaptive_entropy else None}
            synced = lc.sync_ref_model and step >= lc.ref_model_sync_steps
            save_checkpoint(run, step, model, Path(model_dir), state, tc.save_total_limit, ref if synced else None)

    saved = step  # the step of the newest checkpoint (0: none yet)
    while step < max_steps:
        round_start = resume_point()  # checkpointed if scoring fails (step 2), before the round changes any weight
        # 1. Rollout: G samples per prompt, token ids in and out. Every rank draws the same
        # round of prompts and samples the rows it owns (a group may straddle two ranks).
        t0 = clock(device)
        batch = next_prompts(train_set, data_pos, N // G, tc.seed)
        data_pos += N // G
        # the round's number (for the warning below) and the step it ends at (for the note after the loop);
        # counted from data_pos and step, since a resume may start after a round that max_steps cut short
        round_no, round_end = data_pos // (N // G), step + steps_per_round
        rows = [ex for ex in batch for _ in range(G)][mine]
        model.eval()  # rlcore's models have no dropout: eval() and train() below change no arithmetic
        rollout_progress = Progress(f"step {step + 1} rollout", enabled=main)  # a real model on CPU: minutes
        rows_label = f"{len(rows)} completions" + (" on rank 0" if world > 1 else "")
        # num_generations=1: `rows` already repeats each prompt G times (a group may straddle two ranks)
        ro = generate(model, [ex["prompt_ids"] for ex in rows], num_generations=1,
                      max_new_tokens=rc.max_completion_length,
                      eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                      temperature=rc.temperature, top_k=rc.top_k, top_p=rc.top_p, min_p=rc.min_p,
                      repetition_penalty=rc.repetition_penalty, stop_sequences=stop_sequences, generator=sampler,
                      dtype=torch.bfloat16 if amp else None,
                      progress=lambda tokens, finished: rollout_progress.report(
                          f"{tokens}/{rc.max_completion_length} tokens, {finished}/{rows_label} done"))
        t_rollout = clock(device) - t0

        # 2. Rewards and advantages, over the whole round (all ranks) before it is cut up.
        t0 = clock(device)
        completion_ids = completion_token_ids(ro)
        prompts, completions, column_values = reward_inputs(rows, decode_completions(tok, completion_ids), columns)
        logged, extra_columns = defaultdict(list), {}  # what reward functions report (log_metric, log_extra)
        reward_state = RewardState(step, max_steps, (data_pos - N // G) / len(train_set), tc.num_train_epochs)
        reward_kwargs = reward_extras(
            completion_ids, reward_state, log_metric=lambda name, value: logged[name].append(float(value)),
            log_extra=lambda column, values: extra_columns.setdefault(column, []).extend(values))
        R = failure = None
        try:  # a failure on one rank's rows stops every rank with it (else the others wait at the next all-gather)
            R = score_completions(reward_funcs, prompts, completions, column_values, lc.reward_on_error, reward_kwargs,
                                  first_row=mine.start)
        except (ValueError, TypeError, RuntimeError) as e:  # RewardFunctionError is a RuntimeError
            failure = e
        try:
            distributed.raise_together(failure, world)
        except Exception:  # the round has changed no weight: keep its start, to --resume once the function works
            if step > saved:
                checkpoint(round_start)
            raise
        logged = distributed.concat_over_ranks(logged, world)  # every rank's log_metric values
        R = distributed.gather_rows(R.to(device), world)  # R (and acc below) from here: every rank's rows
        if main and R.isnan().all():
            warnings.warn(f"no reward function scored any completion of round {round_no} (all returned None or "
                          f"NaN), so every advantage is 0 and its steps learn nothing; check loss.reward_funcs and "
                          f"the columns they need (data.answer_column)", RlcoreWarning, stacklevel=2)
        every_adv, reward_stats = compute_advantages(R, G, lc.reward_weights, lc.scale_rewards,
                                                     reward_names=lc.reward_funcs,
                                                     multi_objective_aggregation=lc.multi_objective_aggregation)
        adv = every_adv[mine]
        acc = accuracy_fn(prompts=prompts, completions=completions, **column_values)
        acc = distributed.gather_rows(torch.tensor([math.nan if a is None else float(a) for a in acc], device=device),
                                      world)  # NaN: a completion the task cannot score (no answer), counted as 0

        # The round as training tensors: prompt (left-padded) + completion (right-padded): ids and attn
        # [n, Lp + Tc]; cids, mask and samp [n, Tc]; adv, lengths and truncated [n].
        ids, attn, cids, mask, Lp = pack(ro.prompt_ids, completion_ids, tok.pad_token_id)
        ids, attn, cids, mask = ids.to(device), attn.to(device), cids.to(device), mask.to(device)
        # the engine's log-probs, before the repetition penalty and top-k/top-p/min-p when it kept
        # them: the policy's own (SPEC 4)
        samp = ro.full_logprobs if ro.full_logprobs is not None else ro.sampling_logprobs
        samp = samp[:, :cids.shape[1]].to(device)
        truncated = ro.truncated.to(device)
        # SPEC 4.5 applies it last, per micro-batch; once here for the round (as TRL does) the loss is the same,
        # but the entropy mask's quantile and the mismatch metrics skip truncated rows too (docs/losses.md)
        if lc.mask_truncated_completions:
            mask = mask_truncated(mask, truncated)
        adv = adv.to(device)
        lengths = ro.lengths.to(device)
        every_length = distributed.gather_rows(lengths, world)  # the round's completions, all ranks
        every_truncated = distributed.gather_rows(truncated.float(), world)
        logged = {k: sum(v) / len(v) for k, v in logged.items()}  # means over the round, added to each step's row
        round_stats = {**reward_stats,
                       "reward/accuracy": None if acc.isnan().all() else acc.nan_to_num(0.0).mean().item(),
                       "completion/len_mean": every_length.float().mean().item(),
                       "completion/len_min": every_length.min().item(), "completion/len_max": every_length.max().item(),
                       "completion/truncated_frac": every_truncated.mean().item(),
                       "tokens_per_s/rollout": every_length.sum().item() / max(t_rollout, 1e-9)}
        if tc.log_completions:  # every rank's texts and log_extra columns; rank 0 writes them
            texts = distributed.gather_objects((prompts, completions, extra_columns), world)
            if main:
                log_completions(run, step + 1, texts, R, every_adv, every_length, lc.reward_funcs,
                                tc.num_completions_to_print)
        t_score = clock(device) - t0

        # 3. old log-probs only when the round is off-policy (or TIS needs them); ref only if beta.
        t0 = clock(device)
        model.train()
        old = ref_lp = tis = None
        if off_policy or lc.tis_mode:
            old = logprobs_in_batches(model, ids, attn, Lp, cids, b, rc.temperature, amp,
                                      Progress(f"step {step + 1} old log-probs", enabled=main))
        if lc.beta:
            ref_lp = logprobs_in_batches(ref, ids, attn, Lp, cids, b, rc.temperature, amp,
                                         Progress(f"step {step + 1} ref log-probs", enabled=main))
        if lc.tis_mode:
            tis = tis_weights(old, samp, mask, lc.tis_mode, min=lc.tis_min, max=lc.tis_max)
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
        perm = torch.randperm(n, generator=shuffler, device=device)
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
                update_progress = Progress(f"step {step + 1} update", enabled=main)
                for j, mb in enumerate(step_micro, 1):  # mb: the micro-batch's rows
                    logp, entropy = completion_logprobs(model, ids[mb], attn[mb], Lp, cids[mb], rc.temperature, amp,
                                                        shared)  # entropy is differentiable: the bonus below
                    # 5. Loss: per token (SPEC 3-4), then this micro-batch's share of the step's (SPEC 5).
                    # The entropy mask (an all-gather under torchrun), once for the loss and the bonus.
                    entropy_keep = None if lc.top_entropy_quantile == 1.0 else \
                        entropy_mask(entropy.detach(), mask[mb], lc.top_entropy_quantile,
                                     functools.partial(distributed.gather_uneven, world=world))
                    # pi_old. On-policy the policy has not moved since it sampled the round, so pi_old is the
                    # current policy: the ratio is 1 in value, the gradient REINFORCE's with the group baseline,
                    # and clip_ratio/* are 0, as expected (SPEC 1).
                    old_mb = logp.detach() if old is None else old[mb]
                    per_token, diag = policy_loss(
                        logp, old_mb, adv[mb], mask[mb], options=loss_options,
                        ref=None if ref_lp is None else ref_lp[mb], tis_weights=None if tis is None else tis[mb],
                        entropy=entropy.detach(), entropy_keep=entropy_keep, samp=samp[mb])
                    loss = aggregate_loss(per_token, mask[mb], lc.loss_type, gradient_accumulation_steps=GA,
                                          max_completion_length=rc.max_completion_length,
                                          step_tokens=step_tokens, world_size=world)
                    if bonus.enabled:  # loss.entropy_coef: over the tokens the policy loss trains on
                        loss = loss - bonus.term(entropy, mask[mb] if entropy_keep is None else entropy_keep, GA)
                    loss.backward()
                    if mismatch is None:  # on-policy: from this micro-batch's own log-probs
                        diag.update(rollout_mismatch(logp.detach(), samp[mb], mask[mb]))  # its `tokens` = diag's
                    # one host sync per value: free on CPU, a wait for the GPU's queue on CUDA
                    step_metrics.append({"loss": loss.item(), **{key: float(v) for key, v in diag.items()}})
                    if j < len(step_micro):
                        update_progress.report(f"micro-batch {j}/{len(step_micro)}")

                # Optimizer step. A non-finite loss (on any rank) or gradient skips it (and is
                # counted). The averaged gradient and the summed count are the same on every rank,
                # so every rank decides the same.
                if shared is not None:
                    shared.backward()  # the prompts' pass, with the gradients its micro-batches left
                distributed.average_gradients(model, world)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm or math.inf)
                bad_losses = sum(not math.isfinite(x["loss"]) for x in step_metrics)
                finite = math.isfinite(grad_norm.item()) and not distributed.sum_over_ranks([bad_losses], world,
                                                                                          device)[0]
                if finite:
                    opt.step()
                    bad_in_row = 0
                else:
                    bad_in_row, bad_total = bad_in_row + 1, bad_total + 1
                    if main:
                        print(f"step {step + 1}: non-finite loss or gradient, optimizer step skipped "
                              f"({bad_in_row} in a row)", flush=True)
                opt.zero_grad(set_to_none=True)
                lr = opt.param_groups[0]["lr"]  # the rate this step used, before the schedule moves on
                applied = bonus.applied()  # the coefficient this step used, before adaptation
                bonus.end_step(functools.partial(distributed.sum_over_ranks, world=world, device=device))
                with warnings.catch_warnings():  # a skipped step: torch's "scheduler before optimizer" warning
                    warnings.simplefilter("ignore" if not finite else "default", UserWarning)
                    sched.step()
                step += 1
                if lc.sync_ref_model and step % lc.ref_model_sync_steps == 0:
                    mix_into(ref, model, lc.ref_model_mixup_alpha)  # TR-DPO; the next round's ref log-probs use it

                # 6. Metrics (SPEC 6): the round's statistics + this step's diagnostics, all ranks. The
                # round's phase times go on its first step (0 on the others), so times sum over steps.
                t_step = clock(device) - update_start
                met = {"step": step, "epoch": replay, **round_stats, **reduce_metrics(step_metrics, world, device),
                       **(mismatch or {}), "grad_norm": grad_norm.item(), "lr": lr, "skipped": not finite,
                       "nonfinite_total": bad_total, **round_times, "time/update": t_step,
                       "tokens_per_s/train": step_completion_tokens / max(t_step, 1e-9)}
                if bonus.enabled:  # TRL logs the coefficient after adaptation, for the next step
                    met["entropy_coef"], met["entropy_coef/applied"] = bonus.coef, applied
                if bonus.adaptive:  # what the controller compared with entropy_target (the bonus's tokens)
                    met["entropy_coef/entropy"] = bonus.last_entropy
                if taken := sorted(set(logged) & set(met)):
                    raise ValueError(f"a reward function's log_metric name {taken[0]!r} is one of rlcore's own "
                                     f"metrics; log it under another name (e.g. 'custom/{taken[0]}')")
                met.update(logged)
                round_times = dict.fromkeys(round_times, 0.0)
                if device.type == "cuda":  # the largest over ranks
                    met["memory/peak_gb"] = distributed.max_over_ranks(
                        [torch.cuda.max_memory_allocated() / 2**30], world, device)[0]
                else:  # peak resident set size of the process (Linux reports KiB)
                    met["memory/peak_rss_gb"] = distributed.max_over_ranks(
                        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], world, device)[0]
                if main:
                    with open(metrics_file, "a") as f:
                        f.write(json.dumps({key: None if isinstance(v, float) and not math.isfinite(v) else v
                                            for key, v in met.items()}) + "\n")  # strict JSON: NaN -> null
                if main and (step % tc.logging_steps == 0 or step in (1, max_steps)):
                    print(log_line(step, max_steps, met), flush=True)
                if bad_in_row >= tc.max_nonfinite_steps:  # after this step's metrics row
                    raise FloatingPointError(f"{bad_in_row} non-finite steps in a row (train.max_nonfinite_steps="
                                             f"{tc.max_nonfinite_steps}); lower the learning rate or check rewards")
                step_metrics, update_start = [], clock(device)
                if step >= max_steps:
                    break
            if step >= max_steps:
                break

        # Eval and checkpoint at round boundaries: a checkpoint holds no half round, except the
        # last one when max_steps ends the run inside a round (the note below says so).
        # (`step % k < steps_per_round`: a multiple of k fell inside the round just trained)
        if tc.eval_steps and step % tc.eval_steps < steps_per_round and step < max_steps:
            try:
                held_out = held_out_eval()
            except (RewardFunctionError, TypeError, ValueError):  # a reward function's (every rank raises it)
                if step > saved:
                    checkpoint(resume_point())
                raise
            if main:
                record_eval(run, step, held_out)
        if (tc.save_steps and step % tc.save_steps < steps_per_round) or step >= max_steps:
            checkpoint(resume_point())
            saved = step

    if main and step < round_end:
        print(f"note: max_steps={max_steps} ended the run inside a round of {steps_per_round} optimizer "
              f"steps; a --resume with a larger max_steps starts a new round (the rest of this one is "
              f"not replayed)", flush=True)
    held_out = held_out_eval()
    if main:
        record_eval(run, step, held_out)
    after = held_out["eval/accuracy"]
    distributed.barrier(world)  # the ranks leave together, so none tears its process group down under another
    return {"before": before, "after": after, "run_dir": str(run)}
