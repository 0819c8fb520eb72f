"""Setting a run up: everything the loop needs before its first round, in one `Run`.

`setup` checks and loads the inputs in an order that lets a bad one fail before anything is
written (the run directory, the data and the reward functions, then the model), builds the
batch geometry, writes the run's config.toml, and returns the models, tokenizer, data, reward
functions, optimizer and schedule. The helpers above it each build one of those.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcore import RlcoreWarning
from rlcore.config.geometry import Geometry
from rlcore.config.options import EMBEDDED_MODEL_PATHS, Config, LoraArgs, RolloutArgs, TrainArgs
from rlcore.config.validation import warn_bf16_weights
from rlcore.data.datasets import encode_prompts, format_prompt, load_examples
from rlcore.data.tasks import TASK_REWARD, unique_problems
from rlcore.models.embedded import EMBEDDED_TASKS, build_embedded_model, cache_dir_name, why_a_model_of_its_own
from rlcore.models.hf_checkpoint import CheckpointError, check_model_dir, load_model, resolve_dtype
from rlcore.models.lora import apply_lora, keep_as_reference, load_adapter, reference_adapters, set_dropout
from rlcore.models.tokenizer import Tokenizer, check_vocab_fits
from rlcore.models.transformer import Transformer, weight_layout_difference
from rlcore.parallel import collectives, fsdp
from rlcore.parallel.sampler_ranks import Ranks
from rlcore.rewards.reward_model import RewardModel
from rlcore.rewards.scoring import REWARD_EXTRAS, check_reward_funcs, dataset_columns, get_reward_funcs
from rlcore.run.checkpoints import load_resumed_model, way_back
from rlcore.run.rundir import RunDir
from rlcore.run.tracking import check_installed
from rlcore.tools.calls import tool_call_format
from rlcore.tools.toolbox import Toolbox, load_environment_factory, load_tool, reset_environment
from rlcore.tools.turns import ToolTurns, is_prefix_preserving, tool_suffix_ids, training_chat_template


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


def adamw(model: torch.nn.Module, train_cfg: TrainArgs) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on the weight matrices (and embeddings) only: biases and
    norm weights, the 1-D parameters, are not decayed, as in transformers' Trainer (and so TRL).
    Only trainable parameters: with LoRA, the adapters."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train_cfg.learning_rate, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
                             eps=train_cfg.adam_epsilon)


def lr_lambda(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """Linear warmup ((step+1)/(warmup+1): no step is wasted at rate 0, where transformers'
    step/warmup spends step 0 at rate 0), then constant, or linear or cosine decay to zero (or
    to min_lr: cosine_with_min_lr), after the warmup transformers' formulas and arguments."""
    train_cfg = cfg.train
    warmup = train_cfg.warmup_steps or math.ceil(train_cfg.warmup_ratio * total_steps)
    kwargs = train_cfg.lr_scheduler_kwargs
    cycles = kwargs.get("num_cycles", 0.5)
    floor = kwargs.get("min_lr_rate", kwargs.get("min_lr", 0.0) / (train_cfg.learning_rate or 1))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if train_cfg.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if train_cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))

    return f


def reference_model(cfg: Config, model, model_dir: Path, checkpoint: Path | None, dtype: str,
                    device) -> torch.nn.Module:
    """The KL reference: model.ref_path or the initial policy, or on --resume the copy a checkpoint
    holds once loss.sync_ref_model has changed it. sync_ref_model needs the policy's architecture."""
    synced = checkpoint / "ref_model" if checkpoint and (checkpoint / "ref_model").is_dir() else None
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


def embedded_model_dir(cfg: Config, rank: int = 0) -> Path:
    """The embedded default checkpoint, built on first run from the task's training problems.

    Cached under $RLCORE_CACHE (default ~/.cache/rlcore), keyed by what decides its contents,
    so the held-out problems of `data.seed` / `data.num_eval` are never in its SFT data.
    Under torchrun local rank 0 of each machine builds it while the other ranks wait, then they
    find it cached (several machines sharing one cache each build apart and keep the first).
    """
    data_cfg = cfg.data
    cache = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))
    if data_cfg.task not in EMBEDDED_TASKS:
        where = cache / cache_dir_name(data_cfg.seed, data_cfg.num_eval)
        raise ValueError(f"the embedded models are built for data.task = {' or '.join(map(repr, EMBEDDED_TASKS))}, "
                         f"not {data_cfg.task!r}; set model.path to a Hugging Face checkpoint directory for other "
                         f"tasks (the embedded model, once built, is one: --set model.path={where} trains it on a "
                         f"task its character tokenizer can write)")
    where = cache / cache_dir_name(data_cfg.seed, data_cfg.num_eval, data_cfg.task)
    pool = unique_problems(data_cfg.task, 10**6, data_cfg.seed)[data_cfg.num_eval:]  # everything but the eval set
    local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun: the rank on this machine (its cache may be its own)
    if local != 0:
        collectives.barrier_all()
    elif data_cfg.task == "arithmetic" and (why := why_a_model_of_its_own(cache, data_cfg.seed, data_cfg.num_eval)):
        print(why, flush=True)
    path = build_embedded_model(where, pool, task=data_cfg.task)
    if local == 0:
        collectives.barrier_all()
    return path


def add_adapters(model: Transformer, lora_cfg: LoraArgs, checkpoint: Path | None) -> None:
    """LoRA on the frozen base: lora.adapter_path's adapters (kept frozen as the KL reference, the
    run's starting point), or new ones (B = 0: the model starts as the base); on --resume the
    checkpoint's trained adapters then replace the trainable ones."""
    if lora_cfg.adapter_path:  # its adapter_config.json sets r, alpha and the targets
        load_adapter(model, Path(lora_cfg.adapter_path))
        set_dropout(model, lora_cfg.dropout)
        keep_as_reference(model)
    else:
        apply_lora(model, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, lora_cfg.target_modules, lora_cfg.use_rslora)
    if checkpoint is not None:
        try:
            load_adapter(model, checkpoint / "adapter")
        except CheckpointError as e:
            raise CheckpointError(f"{e}{way_back(checkpoint)}") from None


@dataclass
class Run:
    """A run as `setup` built it: what stays the same from the first round to the last (the
    weights, optimizer and schedule change in place; the run's own counters are `RunState`)."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    dir: RunDir  # the run directory: config.toml, metrics, checkpoints
    model_dir: Path  # the checkpoint the model, tokenizer and (by default) the reference came from
    tok: Tokenizer
    model: Transformer
    ref: Transformer | None  # the KL reference, when loss.beta != 0
    train_set: list[dict]  # examples with their prompt_ids
    eval_set: list[dict]
    reward_funcs: list[Callable]
    reward_names: list[str]  # loss.reward_funcs, then the environment's class when it scores (get_reward)
    reward_weights: list[float] | None  # loss.reward_weights, and 1.0 for the environment's reward (TRL's)
    columns: list[str]  # dataset columns passed to every reward call
    accuracy_fn: Callable  # the task's accuracy, for the held-out evaluation and reward/accuracy
    answer_column: str
    stop_sequences: list[list[int]]  # rollout.stop as token ids
    geometry: Geometry
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    schedule: Callable[[int], float]  # the learning-rate factor of each step
    checkpoint: Path | None  # on --resume, the checkpoint it continues from
    saved_state: dict | None  # and that checkpoint's trainer state
    engine: fsdp.EngineCopy | None = None  # under FSDP, the rollout engine's plain copy of the policy
    ranks: Ranks | None = None  # rollout.rollout_ranks: which ranks train and which only sample
    toolbox: Toolbox | None = None  # rollout.tools and rollout.environment_factory, when set

    @property
    def main(self) -> bool:
        """Rank 0 alone prints and writes files."""
        return self.rank == 0

    @property
    def amp(self) -> torch.dtype | None:
        """The autocast dtype of the training passes and the rollout (train.bf16 or train.fp16)."""
        train_cfg = self.cfg.train
        return torch.bfloat16 if train_cfg.bf16 else torch.float16 if train_cfg.fp16 else None

    @contextlib.contextmanager
    def generating(self):
        """The policy as the rollout engine and the held-out evaluation run it: the model itself,
        or under FSDP a plain copy with the full weights, gathered once for the block."""
        if self.engine is None:
            yield self.model
        else:
            with self.engine.gathered(self.model) as model:
                yield model

    def tool_turns(self, rows: list[dict], fresh: bool = False) -> tuple[list[list[int]], ToolTurns]:
        """The prompts and the end_of_turn of a rollout with tools: with an environment factory,
        one environment per row (`fresh`: new ones, not the pool's), reset on it, its prompt
        re-rendered when reset returned text to append."""
        data_cfg, toolbox = self.cfg.data, self.toolbox
        prompts, environments = [row["prompt_ids"] for row in rows], None
        if toolbox.environment_factory is not None:
            environments = ([toolbox.new_environment() for _ in rows] if fresh
                            else toolbox.environments(len(rows)))
            for i, (row, environment) in enumerate(zip(rows, environments)):
                prompt = reset_environment(environment, row)
                if prompt is not row["prompt"]:
                    prompts[i] = format_prompt({**row, "prompt": prompt}, self.tok, data_cfg.system_prompt,
                                               data_cfg.use_chat_template, data_cfg.chat_template_kwargs,
                                               toolbox.schemas)
                    if len(prompts[i]) > data_cfg.max_prompt_length:
                        raise ValueError(f"the prompt {str(row['prompt'])[:60]!r} is {len(prompts[i])} tokens with "
                                         f"the text {type(environment).__name__}.reset appended, over "
                                         f"data.max_prompt_length = {data_cfg.max_prompt_length}; raise it or return "
                                         f"shorter text from reset")
        turns = ToolTurns(toolbox, self.tok, len(rows), environments, timeout=self.cfg.rollout.tool_timeout,
                          **data_cfg.chat_template_kwargs)
        return prompts, turns

    @contextlib.contextmanager
    def reference(self):
        """The KL reference model (loss.beta): a model of its own, or with LoRA the policy's model
        computing with its starting adapters (none: the base), so no second copy is held."""
        if self.ref is not None:
            try:
                yield self.ref
            finally:
                fsdp.reshard(self.ref)  # no backward follows its passes to free its gathered root
        else:
            with reference_adapters(self.model):
                yield self.model


def load_toolbox(rollout_cfg: RolloutArgs, tok: Tokenizer, model_dir: Path, main: bool = True) -> Toolbox | None:
    """The run's Toolbox (rollout.tools and rollout.environment_factory), or None without tools;
    the chat template must show tools and write calls in a format rlcore parses. A template that
    is not prefix-preserving becomes TRL's training template for it, in `tok`, for the whole run
    (prompts, held-out prompts and tool results), as GRPOTrainer renders with it; `main` prints so."""
    if not (rollout_cfg.tools or rollout_cfg.environment_factory):
        return None
    if tok.chat_template is None:
        raise ValueError(f"rollout.tools = {rollout_cfg.tools!r} needs a chat template to show the model its tools, "
                         f"and {model_dir} has none; use an instruct checkpoint with tool support (Qwen2.5 / Qwen3, "
                         f"Llama 3.1 / 3.2) or copy its chat_template.jinja into {model_dir}")
    try:
        tool_call_format(tok)
        if not is_prefix_preserving(tok) and (training := training_chat_template(tok)) is not None:
            tok.chat_template = training  # checkpoints still get the model's own (rundir copies its files)
            if main:
                print(f"{model_dir}'s chat template is not prefix-preserving, so tool results could not be "
                      f"appended; rendering this run with TRL's training template for it "
                      f"(rlcore/models/chat_templates)", flush=True)
        tool_suffix_ids(tok, [{"role": "tool", "name": "dummy", "content": "dummy"}])  # fails now, not mid-run
    except ValueError as err:
        raise ValueError(f"rollout.tools = {rollout_cfg.tools!r} with {model_dir}'s chat template: {err}") from None
    factory = load_environment_factory(rollout_cfg.environment_factory) if rollout_cfg.environment_factory else None
    return Toolbox([load_tool(name) for name in rollout_cfg.tools], factory)


def setup(cfg: Config, resume: str | os.PathLike | RunDir | None = None) -> Run:
    """Check and load everything a run needs (see the module docstring) for `cfg`, a config that
    load_config checked; `resume` is a run directory to continue from its latest checkpoint."""
    train_cfg, loss_cfg, rollout_cfg = cfg.train, cfg.loss, cfg.rollout  # the train, loss and rollout sections
    # (0, 1, device) without torchrun
    rank, world, device = collectives.init(pick_device(train_cfg.device), cpu_collectives=train_cfg.fsdp_offload)
    launched, ranks = world, None  # rollout.rollout_ranks: the last ranks only sample; `world` counts the others
    if rollout_cfg.rollout_ranks and world > 1:
        ranks = Ranks(world, rollout_cfg.rollout_ranks, rollout_cfg.sampler_timeout)
        world = ranks.trainers
    if device.type == "cpu":
        reuse_freed_memory()
    main = rank == 0  # rank 0 alone prints and writes files
    if isinstance(resume, RunDir):  # the command line checked it
        run_dir = resume
    elif resume:
        run_dir = RunDir.to_resume(resume, launched, main)
    else:
        run_dir = RunDir(train_cfg.output_dir, main)
        run_dir.check_new()
    if resume:
        run_dir.check_resumed(cfg)
    if main:  # rank 0 reports to train.report_to's trackers (run_dir.create starts them)
        check_installed(train_cfg.report_to)
    torch.manual_seed(train_cfg.seed)

    # Data and reward functions (checked before a model loads), model, tokenizer.
    train_set, eval_set = load_examples(cfg.data)
    answer_column = cfg.data.answer_column if cfg.data.task == "jsonl" else "answer"  # synthetic tasks': answer
    load_reward_model = functools.partial(  # a reward_funcs entry that is a reward model's directory
        RewardModel.load, device=device, dtype=cfg.model.dtype, batch_size=loss_cfg.reward_model_batch_size,
        chat_template_kwargs=cfg.data.chat_template_kwargs,
        conversational=any(isinstance(ex["prompt"], list) for ex in train_set + eval_set))
    reward_funcs = get_reward_funcs(loss_cfg.reward_funcs, answer_column, load_reward_model,
                                    (loss_cfg.soft_punish_max_completion_len, loss_cfg.soft_punish_cache))
    columns = dataset_columns(train_set)  # passed to every reward call, None where a row lacks one
    environments = ["environments"] if cfg.rollout.environment_factory else []  # TRL passes them to every call
    tool_mask = ["tool_mask"] if cfg.rollout.tools or cfg.rollout.environment_factory else []  # with tools
    check_reward_funcs(reward_funcs, ["prompts", "completions", *REWARD_EXTRAS, *environments, *tool_mask, *columns])
    model_dir = (Path(cfg.model.path) if cfg.model.path not in EMBEDDED_MODEL_PATHS
                 else embedded_model_dir(cfg, rank))
    check_model_dir(model_dir)  # before its tokenizer: an rlcore checkpoint or a LoRA adapter is named as such
    tok = Tokenizer.from_dir(model_dir)
    toolbox = load_toolbox(rollout_cfg, tok, model_dir, main)  # before a model loads, as the reward functions
    reward_names = [fn.__name__ if isinstance(fn, RewardModel) else name  # a reward model's: its directory's name
                    for fn, name in zip(reward_funcs, loss_cfg.reward_funcs)]
    if twice := sorted({name for name in reward_names if reward_names.count(name) > 1}):
        raise ValueError(f"loss.reward_funcs = {loss_cfg.reward_funcs} names {twice[0]!r} twice (a reward model is "
                         f"named after its directory, as in TRL), and the metrics are keyed by name: rename the "
                         f"reward model's directory")
    reward_weights = loss_cfg.reward_weights
    if toolbox and toolbox.reward_name:  # an environment that scores its rollouts is one more reward (TRL)
        reward_funcs.append(toolbox.get_reward)
        reward_names.append(toolbox.reward_name)
        reward_weights = reward_weights and [*reward_weights, 1.0]
    if not reward_funcs:
        raise ValueError(f"loss.reward_funcs = [] and rollout.environment_factory = "
                         f"{rollout_cfg.environment_factory!r} has no get_reward method: nothing scores the "
                         f"completions; name a reward function in loss.reward_funcs or give the environment "
                         f"get_reward(self) -> float")
    checkpoint, saved_state = run_dir.latest() if resume else (None, None)  # read before anything is written
    sharded = checkpoint is not None and (checkpoint / fsdp.SHARDS).is_dir()  # DCP reshards it to any rank count
    if train_cfg.fsdp and world > 1 and checkpoint and not sharded:
        raise ValueError(f"--resume {run_dir}: {checkpoint} was saved by a replicated run (its optimizer state is "
                         f"whole) and train.fsdp = true shards this one; resume it with --set train.fsdp=false, then "
                         f"start sharded runs from a checkpoint's model/ directory")
    dtype = resolve_dtype(cfg.model.dtype, model_dir)  # 'auto': the checkpoint's
    if cfg.model.dtype == "auto" and dtype == "bfloat16" and main and not cfg.lora.enabled:
        warn_bf16_weights(cfg, f"model.dtype = 'auto' on {model_dir}, a bfloat16 checkpoint")
    if cfg.lora.enabled:  # the base as it started; the adapters hold what training changed
        model = load_model(model_dir, dtype, device)
        add_adapters(model, cfg.lora, None if sharded else checkpoint)
    elif checkpoint and not sharded:
        model = load_resumed_model(checkpoint, dtype, device)
    else:  # a sharded checkpoint's weights load once the model is sharded (rundir.resume_from_checkpoint)
        model = load_model(model_dir, dtype, device)
    model.gradient_checkpointing = train_cfg.gradient_checkpointing
    check_vocab_fits(tok, model.config.vocab_size, model_dir)
    # with LoRA the reference is the policy's own model with its starting adapters (Run.reference)
    separate_ref = loss_cfg.beta and (not cfg.lora.enabled or cfg.model.ref_path) and not (ranks and ranks.samples)
    ref = reference_model(cfg, model, model_dir, checkpoint, dtype, device) if separate_ref else None
    for split in (train_set, eval_set):  # the model sees the tools' schemas in every prompt, held-out ones too
        prompt_ids = encode_prompts(split, tok, cfg.data.system_prompt, cfg.data.use_chat_template,
                                    cfg.data.max_prompt_length, cfg.data.chat_template_kwargs,
                                    toolbox.schemas if toolbox else None)
        for ex, p in zip(split, prompt_ids):
            ex["prompt_ids"] = p
    for split, new_tokens, option in ((train_set, rollout_cfg.max_completion_length, "rollout.max_completion_length"),
                                      (eval_set, train_cfg.eval_max_completion_length,
                                       "train.eval_max_completion_length")):
        longest = max((len(ex["prompt_ids"]) for ex in split), default=0)
        if main and split and longest + new_tokens > model.config.max_position_embeddings:  # as transformers warns
            warnings.warn(f"the longest prompt ({longest} tokens) + {option} = {new_tokens} is {longest + new_tokens} "
                          f"positions, past {model_dir}'s max_position_embeddings = "
                          f"{model.config.max_position_embeddings} (config.json): the model was not trained there; "
                          f"lower {option} or data.max_prompt_length", RlcoreWarning, stacklevel=2)
    accuracy_fn = get_reward_funcs([TASK_REWARD[cfg.data.task]], answer_column)[0]
    stop_sequences = [ids for s in rollout_cfg.stop for ids in tok.stop_ids(s)]  # rollout.stop as token ids

    # Batch geometry (SPEC 1): one round = b*S*P completions = that / G prompts x G samples.
    geometry = Geometry.of(cfg, world, len(train_set))  # (TRL's max_steps = -1 counts the epochs)
    G, b, GA, mu, S = geometry.G, geometry.b, geometry.GA, geometry.mu, geometry.S
    N = geometry.completions_per_round  # all ranks' rows
    steps_per_round, max_steps = geometry.steps_per_round, geometry.max_steps
    if main:  # the batch geometry, as TRL's "total train batch size" line gives it
        print(f"{world} rank(s) x {b * S} completions = {N // G} prompts x G={G} per round; micro-batches of {b}, "
              f"an optimizer step every {GA} ({steps_per_round} per round, mu={mu})"
              + (f"; {ranks.samplers} more rank(s) only sample" if ranks else ""), flush=True)
    if main and train_cfg.max_steps == -1:
        print(f"num_train_epochs = {train_cfg.num_train_epochs}: {len(train_set)} prompts, "
              f"{len(train_set) // (N // G)} whole rounds of {N // G} per pass, {steps_per_round} optimizer "
              f"step(s) per round: "
              f"max_steps = {max_steps}", flush=True)

    if main and rollout_cfg.max_staleness and not loss_cfg.tis_mode:
        warnings.warn(f"rollout.max_staleness = {rollout_cfg.max_staleness} trains on rounds sampled by older weights, "
                      f"and loss.tis_mode is off: the ratio's pi_old is the policy at the round's start, and nothing "
                      f"corrects for the older policy that sampled it (docs/async.md); set loss.tis_mode = "
                      f"'token_truncate' (with loss.tis_max) to weight each token by pi_old / pi_sampler",
                      RlcoreWarning, stacklevel=2)
    run_dir.check_steps_left(max_steps)  # a finished run: nothing is evaluated or rewritten
    run_dir.create(cfg, world)  # every input loaded and checked: a bad one leaves no run directory behind

    engine = None
    if train_cfg.fsdp and world > 1 and not (ranks and ranks.samples):  # 1 rank: nothing to shard; a sampler: whole
        engine = fsdp.EngineCopy(model)  # the rollout's plain copy, before the weights are sharded
        group = ranks.training if ranks else None  # FSDP over the training ranks alone
        fsdp.shard(model, world, device, train_cfg.bf16, train_cfg.fsdp_offload, group)
        if ref is not None:
            fsdp.shard(ref, world, device, train_cfg.bf16, train_cfg.fsdp_offload, group)
    opt = adamw(model, train_cfg)
    schedule = lr_lambda(cfg, max_steps)
    return Run(cfg=cfg, rank=rank, world=world, device=device, dir=run_dir, model_dir=model_dir, tok=tok, model=model,
               ref=ref, train_set=train_set, eval_set=eval_set, reward_funcs=reward_funcs, reward_names=reward_names,
               reward_weights=reward_weights, columns=columns,
               accuracy_fn=accuracy_fn, answer_column=answer_column, stop_sequences=stop_sequences,
               geometry=geometry, opt=opt, sched=torch.optim.lr_scheduler.LambdaLR(opt, schedule), schedule=schedule,
               checkpoint=checkpoint, saved_state=saved_state, engine=engine, toolbox=toolbox, ranks=ranks)
