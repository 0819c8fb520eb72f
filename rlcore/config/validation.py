"""What makes a config one that can run: value ranges, the batch geometry of SPEC section 1, and
option combinations that conflict (errors) or that TRL also warns about (warnings).

`validate` collects every problem into one ConfigError, so a user fixes a config in one go.
`load_config` calls it once, for the rank count the run will have.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
import warnings

from rlcore import ConfigError, RlcoreWarning
from rlcore.config.geometry import Geometry
from rlcore.config.options import LORA_TARGETS, TRACKERS
from rlcore.data.tasks import TASK_REWARD
from rlcore.rewards.answers import REWARDS
from rlcore.rewards.scoring import names_reward_model

if typing.TYPE_CHECKING:
    from rlcore.config.options import Config


def warn_bf16_weights(config: Config, setting: str) -> None:
    """The warning for training bf16 weights (model.dtype = 'bfloat16', or 'auto' on a bf16 checkpoint)."""
    warnings.warn(f"{setting}: AdamW updates the bf16 weights themselves (no fp32 master copy), so an update "
                  f"below bf16's resolution (0.4% of the weight) is lost, as most are at learning_rate "
                  f"{config.train.learning_rate:g}; for mixed precision keep model.dtype = 'float32' and set "
                  "train.bf16 = true (TRL's bf16=True)", RlcoreWarning, stacklevel=3)


SCHEDULE_EXAMPLE = {"num_cycles": 0.5, "min_lr_rate": 0.1, "min_lr": 1e-7}  # lr_scheduler_kwargs in examples


# The options where inf reads as "no limit" and works as one; every other number must be finite.
INF_MEANS_NO_LIMIT = {"loss.epsilon_high", "loss.delta", "loss.tis_max", "loss.entropy_coef_max",
                      "loss.off_policy_mask_threshold", "train.max_grad_norm"}


def non_finite(config: Config) -> list[str]:
    """A problem for each NaN option, and each infinite one outside INF_MEANS_NO_LIMIT (loss.beta = inf
    skipped every step as non-finite; a NaN reward weight dropped its function from the reward)."""
    problems = []
    for section in dataclasses.fields(config):
        options = getattr(config, section.name)
        for option in dataclasses.fields(options):
            key, value = f"{section.name}.{option.name}", getattr(options, option.name)
            numbers = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, float)]
            nan, inf = any(map(math.isnan, numbers)), any(map(math.isinf, numbers))
            if nan or (inf and key not in INF_MEANS_NO_LIMIT):
                what = "finite numbers" if isinstance(value, list) else "a finite number"
                problems.append(f"{key} = {value} must be {what}")
    return problems


def validate(config: Config, world_size: int = 1) -> None:
    """Check ranges and batch-size consistency (SPEC section 1) on `world_size` ranks; raise one
    ConfigError listing every problem (NaN and infinite values first, alone: the range checks would
    misread them)."""
    if problems := non_finite(config):
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    problems = []
    data, rollout, loss, train = config.data, config.rollout, config.loss, config.train

    def need(ok: bool, msg: str):
        if not ok:
            problems.append(msg)

    problems += async_problems(config, world_size)
    world_size = training_ranks(config, world_size)  # the ranks that train (rollout.rollout_ranks only sample)
    # The batch geometry (SPEC 1): the checks that depend on the world size.
    geometry = Geometry.of(config, world_size)
    need(train.generation_batch_size is None or train.steps_per_generation is None,
         f"train.generation_batch_size = {train.generation_batch_size} and train.steps_per_generation = "
         f"{train.steps_per_generation} are both set; they say the same thing (generation_batch_size = "
         f"per_device_train_batch_size * steps_per_generation * world size), keep one (as TRL requires)")
    if train.steps_per_generation is None:  # set by train.generation_batch_size
        generation_batch, per_micro_batch = train.generation_batch_size, geometry.b * world_size  # all ranks
        if generation_batch < 1 or per_micro_batch < 1 or generation_batch % per_micro_batch:
            unit = max(1, per_micro_batch)
            near = sorted({max(unit, generation_batch // unit * unit), (max(0, generation_batch) // unit + 1) * unit})
            problems.append(f"train.generation_batch_size = {generation_batch} must be a positive multiple of "
                            f"per_device_train_batch_size * world size = {geometry.b} * {world_size} = "
                            f"{per_micro_batch}; set it to {' or '.join(map(str, near))}, or leave it unset "
                            f"(= {unit * max(1, geometry.GA)}, steps_per_generation = GA)")
            geometry = dataclasses.replace(geometry, S=geometry.GA)  # the rest is checked as if it were unset
    G, b, GA, S = geometry.G, geometry.b, geometry.GA, geometry.S
    need(G >= 2, f"rollout.num_generations = {G} must be >= 2: advantages compare completions "
                 f"of the same prompt" + (", and rollout.filter_groups keeps a group only when its rewards differ"
                                          if rollout.filter_groups else "") + "; use 8 (TRL's default)")
    for key, value in (("per_device_train_batch_size", b), ("gradient_accumulation_steps", GA),
                       ("steps_per_generation", S if S != GA else 1)):  # S = GA when unset: GA's error says it
        need(value >= 1, f"train.{key} = {value} must be >= 1")
    need(world_size >= 1, f"world_size = {world_size} must be >= 1")
    if G >= 2 and b >= 1 and GA >= 1 and S >= 1 and world_size >= 1:
        round_size = geometry.completions_per_round
        if round_size % G:
            step = G // math.gcd(G, S * world_size)
            batch_sizes = sorted({max(step, b // step * step), (b // step + 1) * step})
            group_sizes = [g for g in range(2, round_size + 1) if round_size % g == 0]
            problems.append(
                f"generation batch = per_device_train_batch_size * steps_per_generation * world_size "
                f"= {b} * {S} * {world_size} = {round_size} completions is not divisible by "
                f"rollout.num_generations = {G}, so it cannot hold whole groups of {G}; set "
                f"train.per_device_train_batch_size to a multiple of {step} (e.g. "
                f"{' or '.join(map(str, batch_sizes))})"
                + (f" or rollout.num_generations to one of {group_sizes}" if group_sizes else ""))
        if S % GA:
            fixes = sorted({GA * max(1, S // GA), GA * (S // GA + 1)})
            if train.steps_per_generation is None:  # S came from generation_batch_size
                what = (f"train.generation_batch_size = {train.generation_batch_size} gives steps_per_generation = "
                        f"{train.generation_batch_size} / ({b} * {world_size}) = {S}, which")
                fix = f"generation_batch_size to {' or '.join(str(f * b * world_size) for f in fixes)}"
            else:
                what, fix = f"train.steps_per_generation = {S}", f"steps_per_generation to {' or '.join(map(str, fixes))}"
            problems.append(
                f"{what} is not a multiple of train.gradient_accumulation_steps "
                f"= {GA}: an optimizer step takes GA micro-batches and must not straddle two passes "
                f"over the generation batch (steps per round = S * num_iterations / GA); set "
                f"{fix}, or leave it unset (= GA)")

    need(data.task != "jsonl" or bool(data.path), f"data.task = 'jsonl' needs data.path (now {data.path!r}) "
         f"to name a JSONL file; --set data.path=/path/to/train.jsonl")
    need(data.task == "jsonl" or (data.path is None and data.eval_path is None),
         f"data.path = {data.path!r} / data.eval_path = {data.eval_path!r} are only read when "
         f"data.task = 'jsonl' (it is {data.task!r}); set data.task = 'jsonl' or remove them")
    need(data.num_train >= (0 if data.task == "jsonl" else 1),
         f"data.num_train = {data.num_train} must be >= 1 (0 = all rows, for task jsonl only)")
    need(data.num_eval >= 0, f"data.num_eval = {data.num_eval} must be >= 0 (0 = no evaluation)")
    need(data.max_prompt_length >= 1, f"data.max_prompt_length = {data.max_prompt_length} must be >= 1")

    need(rollout.max_completion_length >= 1, f"rollout.max_completion_length = {rollout.max_completion_length} must be >= 1")
    need(rollout.temperature > 0, f"rollout.temperature = {rollout.temperature} must be > 0 (use a small "
         f"value such as 0.1 for near-greedy sampling)")
    need(0 < rollout.top_p <= 1, f"rollout.top_p = {rollout.top_p} must be in (0, 1]; 1.0 = off")
    need(rollout.top_k >= 0, f"rollout.top_k = {rollout.top_k} must be >= 0; 0 = off")
    need(0 <= rollout.min_p < 1, f"rollout.min_p = {rollout.min_p} must be in [0, 1); 0.0 = off")
    need(rollout.repetition_penalty > 0, f"rollout.repetition_penalty = {rollout.repetition_penalty} must be > 0; "
         f"1.0 = off, above 1 (e.g. 1.1) discourages repeats")
    need(all(rollout.stop), f"rollout.stop = {rollout.stop!r} contains an empty string; remove it")
    tooled = bool(rollout.tools or rollout.environment_factory)
    need(not tooled or data.use_chat_template,
         f"rollout.tools = {rollout.tools!r} / rollout.environment_factory = {rollout.environment_factory!r} need chat "
         f"prompts, and data.use_chat_template is false: the chat template shows the model its tools and renders "
         f"the tool results; set data.use_chat_template = true")
    need(rollout.max_tool_calling_iterations is None or (tooled and rollout.max_tool_calling_iterations >= 0),
         f"rollout.max_tool_calling_iterations = {rollout.max_tool_calling_iterations} must be >= 0 and needs "
         f"rollout.tools or rollout.environment_factory; none = no limit")
    need(rollout.tool_timeout > 0, f"rollout.tool_timeout = {rollout.tool_timeout} must be > 0 seconds (e.g. 30.0)")
    problems += dynamic_sampling_problems(config)

    need(loss.beta >= 0, f"loss.beta = {loss.beta} must be >= 0; 0.0 = no KL term")
    need(loss.off_policy_mask_threshold is None or loss.off_policy_mask_threshold > 0,
         f"loss.off_policy_mask_threshold = {loss.off_policy_mask_threshold} must be > 0 (e.g. 0.5), or none for off")
    for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
        need(getattr(loss, name) > 0, f"loss.{name} = {getattr(loss, name)} must be > 0 (TRL's defaults: 3.0 and 2.0)")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        need(getattr(loss, name) > 0, f"loss.{name} = {getattr(loss, name)} must be > 0 (TRL's defaults: 1.0 and 1.05)")
    if loss.sync_ref_model:
        need(loss.beta != 0, "loss.sync_ref_model = true with loss.beta = 0.0: there is no reference model to "
             "synchronize; set loss.beta (e.g. 0.04) or loss.sync_ref_model = false")
        need(0 <= loss.ref_model_mixup_alpha <= 1, f"loss.ref_model_mixup_alpha = {loss.ref_model_mixup_alpha} must be "
             f"in [0, 1] (TRL's default 0.6)")
        need(loss.ref_model_sync_steps >= 1, f"loss.ref_model_sync_steps = {loss.ref_model_sync_steps} must be >= 1")
    if loss.use_adaptive_entropy:
        need(loss.entropy_coef_delta > 0, f"loss.entropy_coef_delta = {loss.entropy_coef_delta} must be > 0 with "
             f"loss.use_adaptive_entropy = true (0.005 is TRL's default)")
        need(loss.entropy_coef_min <= loss.entropy_coef <= loss.entropy_coef_max,
             f"loss.entropy_coef = {loss.entropy_coef} must lie in [entropy_coef_min, entropy_coef_max] = "
             f"[{loss.entropy_coef_min}, {loss.entropy_coef_max}] with loss.use_adaptive_entropy = true; it is "
             f"the starting coefficient")
    need(0 < loss.epsilon < 1, f"loss.epsilon = {loss.epsilon} must be in (0, 1): ratios below 1 - epsilon are "
         f"clipped (0.2 is the usual value)")
    need(loss.epsilon_high > 0 or loss.epsilon_high == loss.epsilon,  # when equal, it is epsilon's error
         f"loss.epsilon_high = {loss.epsilon_high} must be > 0 (DAPO uses 0.28)")
    need(loss.delta is None or loss.delta > 1, f"loss.delta = {loss.delta} must be > 1 (it caps ratios "
         f"above 1; e.g. 1 + epsilon_high + 0.5), or none to turn it off")
    need(0 < loss.top_entropy_quantile <= 1, f"loss.top_entropy_quantile = {loss.top_entropy_quantile} "
         f"must be in (0, 1]; 1.0 = train on all tokens, 0.2 = the top 20% by entropy")
    need(loss.num_iterations >= 1, f"loss.num_iterations = {loss.num_iterations} must be >= 1")
    need(loss.reward_model_batch_size >= 1,
         f"loss.reward_model_batch_size = {loss.reward_model_batch_size} must be >= 1")
    need(0 <= loss.tis_min < loss.tis_max, f"loss.tis_min = {loss.tis_min}, loss.tis_max = {loss.tis_max}: "
         f"need 0 <= tis_min < tis_max")
    need(len(loss.reward_funcs) >= 1 or rollout.environment_factory is not None,  # whose get_reward may score
         "loss.reward_funcs = [] names no reward function; e.g. --set loss.reward_funcs='[\"accuracy\"]'")
    need(loss.reward_weights is None or len(loss.reward_weights) == len(loss.reward_funcs),
         f"loss.reward_weights = {loss.reward_weights} has {len(loss.reward_weights or [])} weight(s) but "
         f"loss.reward_funcs = {loss.reward_funcs} has {len(loss.reward_funcs)} function(s); give one "
         f"weight per function, or none for all 1.0")
    twice = sorted({name for name in loss.reward_funcs if loss.reward_funcs.count(name) > 1})
    need(not twice, f"loss.reward_funcs lists {twice[0] if twice else ''!r} more than once; its metrics and "
         f"completions.jsonl columns are keyed by name: list it once and weight it with loss.reward_weights")
    for name in loss.reward_funcs:
        if names_reward_model(name) and not os.path.isdir(name):  # else a reward model's directory
            close = difflib.get_close_matches(name, REWARDS, n=1)
            hub_id = "/" in name and not os.path.isabs(name) and name.count("/") == 1  # org/name
            model = (f" (a Hugging Face model id? rlcore never downloads: fetch the reward model, e.g. hf download "
                     f"{name} --local-dir ckpt/{os.path.basename(name)}, and give that directory)" if hub_id
                     else " (no such directory)" if "/" in name else "")
            problems.append(f"loss.reward_funcs has unknown reward {name!r}{model}; built-in rewards are "
                            f"{', '.join(REWARDS)}" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + ", or give your own as 'module:function', or a reward model's checkpoint directory")
    problems += overlong_problems(config)
    judge = TASK_REWARD[data.task]  # the reward that decides held-out accuracy
    need(judge == "accuracy" or judge in loss.reward_funcs,
         f"data.task = {data.task!r} is scored by the {judge!r} reward, but loss.reward_funcs = "
         f"{loss.reward_funcs}; --set loss.reward_funcs='[\"{judge}\"]'")
    if data.task == "jsonl" and not data.answer_column:  # no reference answers to compare with
        need("accuracy" not in loss.reward_funcs,
             f"loss.reward_funcs = {loss.reward_funcs} has 'accuracy', which compares each completion with its row's "
             f"reference answer, but data.answer_column = '' reads none, so every score would be None and no step "
             "would learn; name the answer column (--set data.answer_column=answer) or score with your own "
             "reward function ('module:function')")
        if data.num_eval:
            warnings.warn("data.answer_column = '': held-out accuracy compares completions with reference answers "
                          "and there are none, so the run has none to report; set data.num_eval = 0 to skip its "
                          "greedy generations (which still give the reward functions' held-out scores)",
                          RlcoreWarning, stacklevel=2)
    if config.model.ref_path and loss.beta == 0:
        warnings.warn(f"model.ref_path = {config.model.ref_path!r} is read only when loss.beta != 0, and it is 0.0: "
                      "no reference model and no KL term; set loss.beta (e.g. 0.04) or remove model.ref_path",
                      RlcoreWarning, stacklevel=2)
    if config.model.dtype == "bfloat16" and not config.lora.enabled:  # LoRA trains fp32 adapters on a frozen base
        warn_bf16_weights(config, "model.dtype = 'bfloat16'")
    if loss.loss_type == "luspo" and loss.importance_sampling_level != "sequence":
        warnings.warn(f"loss.loss_type = 'luspo' with loss.importance_sampling_level = "
                      f"{loss.importance_sampling_level!r}: LUSPO is GSPO's sequence ratio with a length-unbiased "
                      f"sum; set importance_sampling_level = 'sequence' (TRL warns the same)",
                      RlcoreWarning, stacklevel=2)
    if loss.policy_loss == "vespo" and loss.importance_sampling_level != "token":
        warnings.warn(f"loss.policy_loss = 'vespo' with loss.importance_sampling_level = "
                      f"{loss.importance_sampling_level!r}: VESPO forms its own sequence weight from the token "
                      f"ratios, so the level only changes the ratio of use_bias_correction_kl; leave it at "
                      f"'token' (TRL warns the same)", RlcoreWarning, stacklevel=2)
    if loss.policy_loss == "ppo" and loss.delta is not None and 1 < loss.delta <= 1 + loss.epsilon_high:
        bound = 1 + loss.epsilon_high
        warnings.warn(f"loss.delta = {loss.delta} <= 1 + loss.epsilon_high = {bound:g}: positive-advantage ratios "
                      f"are capped at delta, as epsilon_high = {loss.delta - 1:g} would, and negative-advantage ones "
                      f"are held at the clip bound {bound:g}, not at delta; for a dual clip at delta set it above "
                      f"{bound:g} (e.g. 4)", RlcoreWarning, stacklevel=2)
    if loss.importance_sampling_level != "token" and loss.loss_type not in ("grpo", "luspo"):
        warnings.warn(f"loss.importance_sampling_level = {loss.importance_sampling_level!r} (GSPO) with loss.loss_type = "
                      f"{loss.loss_type!r}: the GSPO objective is loss_type = 'grpo' (per-sequence mean)",
                      RlcoreWarning, stacklevel=2)

    need(bool(train.output_dir.strip()), f"train.output_dir = {train.output_dir!r} names no directory (an unset shell "
         f"variable?); the run would write into the current one; give it one, e.g. runs/my-run")
    need(train.num_completions_to_print is None or train.num_completions_to_print >= 0,
         f"train.num_completions_to_print = {train.num_completions_to_print} must be >= 0, or none to print all")
    need(train.save_total_limit is None or train.save_total_limit >= 1,
         f"train.save_total_limit = {train.save_total_limit} must be >= 1, or none to keep every checkpoint")
    need(train.max_steps >= 1 or train.max_steps == -1, f"train.max_steps = {train.max_steps} must be >= 1, or -1 to train "
         f"for train.num_train_epochs passes over the prompts")
    need(train.max_steps != -1 or train.num_train_epochs > 0, f"train.num_train_epochs = {train.num_train_epochs} must be > 0 "
         f"(with train.max_steps = -1 it sets the run's length)")
    need(train.learning_rate >= 0, f"train.learning_rate = {train.learning_rate} must be >= 0")
    need(0 <= train.warmup_ratio < 1, f"train.warmup_ratio = {train.warmup_ratio} must be in [0, 1)")
    need(train.warmup_steps >= 0, f"train.warmup_steps = {train.warmup_steps} must be >= 0")
    need(not (train.warmup_steps and train.warmup_ratio), f"train.warmup_steps = {train.warmup_steps} and "
         f"train.warmup_ratio = {train.warmup_ratio} are both set; keep one")
    allowed = {"cosine": {"num_cycles"}, "cosine_with_min_lr": {"num_cycles", "min_lr", "min_lr_rate"}}
    extra = set(train.lr_scheduler_kwargs) - allowed.get(train.lr_scheduler_type, set())
    need(not extra, f"train.lr_scheduler_kwargs = {train.lr_scheduler_kwargs} has {sorted(extra)}, which "
         f"lr_scheduler_type = {train.lr_scheduler_type!r} does not take; it takes "
         f"{sorted(allowed.get(train.lr_scheduler_type, [])) or 'none'}")
    for key, value in train.lr_scheduler_kwargs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            need(False, f"train.lr_scheduler_kwargs.{key} = {value!r} ({type(value).__name__}) must be a finite "
                 f"number, e.g. lr_scheduler_kwargs = {{{key} = {SCHEDULE_EXAMPLE.get(key, 0.5)}}}")
        elif key == "num_cycles":
            need(value > 0, f"train.lr_scheduler_kwargs.num_cycles = {value} must be > 0 (0.5: one half-cosine "
                 f"to the end)")
        elif key == "min_lr_rate":
            need(0 <= value <= 1, f"train.lr_scheduler_kwargs.min_lr_rate = {value} must be in [0, 1] (a fraction of "
                 f"train.learning_rate)")
        elif key == "min_lr":
            need(0 <= value <= train.learning_rate, f"train.lr_scheduler_kwargs.min_lr = {value} must be in "
                 f"[0, train.learning_rate = {train.learning_rate}]")
    need(train.lr_scheduler_type != "cosine_with_min_lr" or len({"min_lr", "min_lr_rate"} & set(train.lr_scheduler_kwargs)) == 1,
         f"train.lr_scheduler_type = 'cosine_with_min_lr' needs exactly one of min_lr (a rate) or min_lr_rate (a "
         f"fraction of learning_rate) in train.lr_scheduler_kwargs, got {train.lr_scheduler_kwargs}; e.g. "
         f"lr_scheduler_kwargs = {{min_lr_rate = 0.1}}")
    need(train.lr_scheduler_type != "constant" or not (train.warmup_steps or train.warmup_ratio),
         f"train.lr_scheduler_type = 'constant' has no warmup, but warmup_steps = {train.warmup_steps} / "
         f"warmup_ratio = {train.warmup_ratio}; set train.lr_scheduler_type to 'constant_with_warmup', 'cosine' "
         f"or 'linear' (TRL's default; rlcore's is 'constant')")
    need(train.weight_decay >= 0, f"train.weight_decay = {train.weight_decay} must be >= 0")
    need(0 <= train.adam_beta1 < 1 and 0 <= train.adam_beta2 < 1, f"train.adam_beta1 = {train.adam_beta1}, "
         f"train.adam_beta2 = {train.adam_beta2} must be in [0, 1)")
    need(train.adam_epsilon > 0, f"train.adam_epsilon = {train.adam_epsilon} must be > 0")
    need(train.max_grad_norm >= 0, f"train.max_grad_norm = {train.max_grad_norm} must be >= 0; 0.0 = no clipping")
    for key in ("logging_steps", "max_nonfinite_steps", "eval_max_completion_length"):
        need(getattr(train, key) >= 1, f"train.{key} = {getattr(train, key)} must be >= 1")
    for key in ("eval_steps", "save_steps"):
        need(getattr(train, key) >= 0, f"train.{key} = {getattr(train, key)} must be >= 0; 0 = only at the end")
    problems += sampled_eval_problems(config)
    need(not (train.fp16 and train.bf16), "train.fp16 and train.bf16 are both true; choose one autocast dtype "
         "(bf16 where the GPU has it: no loss scaling needed)")
    need(not train.fp16 or config.model.dtype == "float32" or config.lora.enabled,
         f"train.fp16 autocasts over fp32 master weights with loss scaling, but model.dtype = "
         f"{config.model.dtype!r}; set model.dtype = 'float32'")
    need(not (train.fsdp and train.fp16), "train.fsdp shards fp32 master weights and computes in bf16 with "
         "train.bf16; fp16 loss scaling is not supported with it: set train.fp16 = false (train.bf16 = true on a "
         "GPU with bf16)")
    need(train.fsdp or not train.fsdp_offload, "train.fsdp_offload = true offloads FSDP's shards, and "
         "train.fsdp = false: set train.fsdp = true too (or train.fsdp_offload = false)")
    need(not (train.fsdp and config.loss.sync_ref_model), "loss.sync_ref_model mixes the policy into a reference "
         "that checkpoints keep whole; it is not supported with train.fsdp: set one of them to false")
    reporting = [train.report_to] if isinstance(train.report_to, str) else train.report_to
    need(reporting in (["none"], []) or not set(reporting) - set(TRACKERS),
         f"train.report_to = {train.report_to!r}: rlcore reports to {', '.join(TRACKERS)} (a name or a list of them), "
         f"or 'none'")
    problems += lora_problems(config)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def training_ranks(config: Config, world_size: int) -> int:
    """The ranks of `world_size` that train: all but rollout.rollout_ranks (at least one)."""
    return max(1, world_size - max(0, config.rollout.rollout_ranks))


def async_problems(config: Config, world_size: int) -> list[str]:
    """Asynchronous rollouts (rollout.max_staleness, weight_sync_steps, sampler_thread, rollout_ranks)."""
    rollout = config.rollout
    problems = []
    if rollout.max_staleness < 0:
        problems.append(f"rollout.max_staleness = {rollout.max_staleness} must be >= 0: the rounds the sampler runs "
                        f"ahead of the trainer (0 = synchronous, 1 = one round sampled while the previous trains)")
    if rollout.weight_sync_steps < 1:
        problems.append(f"rollout.weight_sync_steps = {rollout.weight_sync_steps} must be >= 1 (1 = the sampler may "
                        f"get the weights after every optimizer step)")
    elif rollout.weight_sync_steps > 1 and rollout.max_staleness < 1:
        problems.append(f"rollout.weight_sync_steps = {rollout.weight_sync_steps} leaves the sampler on older weights, "
                        f"and rollout.max_staleness = {rollout.max_staleness} asks for the trainer's own; set "
                        f"max_staleness >= 1, or leave weight_sync_steps at 1")
    if not rollout.sampler_timeout > 0:
        problems.append(f"rollout.sampler_timeout = {rollout.sampler_timeout} must be > 0 seconds (e.g. 600)")
    if rollout.rollout_ranks < 0 or (rollout.rollout_ranks and rollout.rollout_ranks >= world_size):
        problems.append(f"rollout.rollout_ranks = {rollout.rollout_ranks} must be >= 0 and below the world size "
                        f"({world_size} rank(s)): at least one rank must train; launch more ranks with torchrun "
                        f"--nproc_per_node, or set rollout_ranks = 0 (every rank samples and trains)")
    if rollout.rollout_ranks and rollout.sampler_thread:
        problems.append("rollout.sampler_thread = true and rollout.rollout_ranks = "
                        f"{rollout.rollout_ranks}: rounds come from a thread or from ranks of their own, not both; "
                        "set one of them")
    if (rollout.max_staleness > 0 or rollout.sampler_thread or rollout.rollout_ranks) and rollout.filter_groups:
        problems.append("rollout.filter_groups (dynamic sampling) decides how many generation batches a round draws "
                        "from the trainer's scores, so its rounds cannot be sampled ahead; set rollout.filter_groups "
                        "= false, or rollout.max_staleness = 0, rollout.sampler_thread = false and "
                        "rollout.rollout_ranks = 0")
    return problems


def dynamic_sampling_problems(config: Config) -> list[str]:
    """rollout.filter_groups and its options (DAPO's dynamic sampling; verl's algorithm.filter_groups)."""
    rollout, loss = config.rollout, config.loss
    problems = []
    if not rollout.filter_groups:
        for key, off in (("filter_groups_metric", None), ("max_num_gen_batches", 0)):
            if getattr(rollout, key) != off:
                problems.append(f"rollout.{key} = {getattr(rollout, key)!r} is a setting of dynamic sampling, which "
                                f"is off; set rollout.filter_groups = true, or leave rollout.{key} out")
        return problems
    if rollout.max_num_gen_batches < 0:
        problems.append(f"rollout.max_num_gen_batches = {rollout.max_num_gen_batches} must be >= 0: the most "
                        f"generation batches a round samples (0 = no cap; verl's DAPO recipe uses 10)")
    metric = rollout.filter_groups_metric
    if metric is not None and metric not in loss.reward_funcs:
        close = difflib.get_close_matches(metric, loss.reward_funcs, n=1)
        problems.append(f"rollout.filter_groups_metric = {metric!r} is not one of loss.reward_funcs = "
                        f"{loss.reward_funcs}" + (f" (did you mean {close[0]!r}?)" if close else "") +
                        "; name one of them, or leave it out to judge the weighted total reward")
    return problems


def overlong_problems(config: Config) -> list[str]:
    """The soft_overlong_punishment reward's parameters (DAPO eq. 13; TRL's get_soft_overlong_punishment)."""
    loss = config.loss
    cache, longest = loss.soft_punish_cache, loss.soft_punish_max_completion_len
    if "soft_overlong_punishment" not in loss.reward_funcs:
        return [] if cache is None else [
            f"loss.soft_punish_cache = {cache} is read by the soft_overlong_punishment reward, which "
            f"loss.reward_funcs = {loss.reward_funcs} does not name; add it, or leave loss.soft_punish_cache out"]
    problems = []
    if longest < 1:
        problems.append(f"loss.soft_punish_max_completion_len = {longest} must be >= 1 (L_max, in tokens; "
                        f"none = rollout.max_completion_length)")
    if cache is None:
        problems.append(f"the soft_overlong_punishment reward needs loss.soft_punish_cache (L_cache): completions "
                        f"longer than L_max - L_cache = {longest} - L_cache score below 0; DAPO punishes the last "
                        f"fifth, e.g. loss.soft_punish_cache = {max(1, longest // 5)}")
    elif not 0 <= cache <= longest:
        problems.append(f"loss.soft_punish_cache = {cache} must be in [0, loss.soft_punish_max_completion_len = "
                        f"{longest}]: the punished lengths are the last L_cache tokens before L_max (DAPO: the "
                        f"last fifth, e.g. {max(1, longest // 5)})")
    return problems


def sampled_eval_problems(config: Config) -> list[str]:
    """train.eval_num_generations (TRL's num_generations_eval), eval_temperature and eval_pass_at_k."""
    train = config.train
    n, ks = train.eval_num_generations, train.eval_pass_at_k
    if n < 1:
        return [f"train.eval_num_generations = {n} must be >= 1 (1 = the greedy evaluation alone)"]
    problems = []
    if n == 1 and train.eval_temperature is not None:
        problems.append(f"train.eval_temperature = {train.eval_temperature} is the temperature of the sampled "
                        f"held-out completions, and train.eval_num_generations = 1 samples none (the greedy one "
                        f"alone); set train.eval_num_generations > 1 (e.g. 8), or leave eval_temperature out")
    if n > 1 and train.eval_temperature is not None and train.eval_temperature <= 0:
        problems.append(f"train.eval_temperature = {train.eval_temperature} must be > 0: the n = {n} held-out "
                        f"completions per prompt are sampled (the greedy one is always there); e.g. 0.6")
    if not ks:
        problems.append(f"train.eval_pass_at_k = {ks} names no k; e.g. [1, {n}], or leave it out for that")
    for k in ks:
        if not 1 <= k <= n:
            problems.append(f"train.eval_pass_at_k has k = {k}, outside [1, train.eval_num_generations = {n}]: "
                            f"pass@k picks k of the n completions of a prompt; raise eval_num_generations to {k}"
                            f" or drop it" if k > n else f"train.eval_pass_at_k has k = {k}; each k must be >= 1")
    if len(set(ks)) != len(ks):
        problems.append(f"train.eval_pass_at_k = {ks} lists a k twice; list each once")
    return problems


def lora_problems(config: Config) -> list[str]:
    """The [lora] section's checks (none while lora.enabled is false)."""
    lora, loss = config.lora, config.loss
    if not lora.enabled:
        return []
    problems = []
    if lora.r < 1:
        problems.append(f"lora.r = {lora.r} must be >= 1 (16 is TRL's default)")
    if lora.alpha <= 0:
        problems.append(f"lora.alpha = {lora.alpha} must be > 0 (TRL's default is 32, twice lora.r)")
    if not 0 <= lora.dropout < 1:
        problems.append(f"lora.dropout = {lora.dropout} must be in [0, 1) (TRL's default is 0.05)")
    targets = [lora.target_modules] if isinstance(lora.target_modules, str) else lora.target_modules
    if unknown := [t for t in targets if t not in (*LORA_TARGETS, "all-linear")] or not targets:
        problems.append(f"lora.target_modules = {lora.target_modules!r}: unknown {unknown or 'empty list'}; use "
                        f"'all-linear' or names among {', '.join(LORA_TARGETS)}")
    if loss.sync_ref_model and config.model.ref_path is None:
        problems.append("loss.sync_ref_model mixes the policy into a reference model of its own, but with "
                        "lora.enabled the reference is the run's starting adapters (no second model); set "
                        "loss.sync_ref_model = false, or model.ref_path to load a reference model")
    return problems
