"""TRL compatibility: what a config written for TRL's `GRPOConfig` means in rlcore.

rlcore's options are TRL's `GRPOConfig` names (and the `TrainingArguments` ones a GRPO run sets),
so a TRL config mostly loads as it is; rlcore/config.py reads TRL's flat keys (`beta = 0.04` at
the top level) into the one section that has the field. This module holds the rest: TRL's other
names for rlcore fields (`FLAT_ALIASES`, `rlcore_field`), the tables TRL takes whole
(`generation_kwargs`, `model_init_kwargs`), the `loss_type` values that are a policy loss in
rlcore (`LOSS_TYPES`), and the TRL names without an rlcore field (`TRL_ONLY`). A value of one of
those that changes nothing about how rlcore trains (`use_vllm = false`, a `vllm_*` server
setting) is dropped with a warning that says why; any other value is a
`ConfigError` that says what to set instead. Without that table they would be "unknown config
key" errors with a spelling hint that points at an unrelated option. `FOREIGN` does the same for
names users bring from verl and Unsloth: their "unknown config key" error names rlcore's
equivalent, or why there is none. `TRL_DEFAULTS` names rlcore defaults that are not TRL's, which
a file in TRL's flat keys is warned about.
"""

from __future__ import annotations

import typing
import warnings

from rlcore import ConfigError, RlcoreWarning

if typing.TYPE_CHECKING:
    from rlcore.config.options import Config

# Top-level keys that are not a field name of exactly one section: TRL names and the shared seed.
FLAT_ALIASES = {"seed": ("train", "seed"), "model_name_or_path": ("model", "path"),
                "activation_checkpointing": ("train", "gradient_checkpointing"),  # transformers 5's name
                "num_generations_eval": ("train", "eval_num_generations"),
                # TRL's ModelConfig (PEFT's LoraConfig names)
                "use_peft": ("lora", "enabled"), "lora_r": ("lora", "r"), "lora_alpha": ("lora", "alpha"),
                "lora_dropout": ("lora", "dropout"), "lora_target_modules": ("lora", "target_modules")}

GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_completion_length",
                     "max_tokens": "max_completion_length", "stop_strings": "stop", "stop": "stop"}
"""generation_kwargs keys (transformers' GenerationConfig and vLLM's SamplingParams names) -> rollout fields."""

ANY = object()  # every value is harmless: warn and drop
# for trackio's Hub options
LOCAL_TRACKIO = ("rlcore's report_to = 'trackio' logs to trackio's local store (TRACKIO_DIR); trackio's own "
                 "TRACKIO_SPACE_ID environment variable syncs it to a Space")
# for the options that pick a best checkpoint
NEWEST = "rlcore keeps the newest checkpoints; its held-out accuracy and rewards are in eval.jsonl"

# TRL name -> (values that change nothing in rlcore, why / what to set instead)
TRL_ONLY: dict[str, tuple[object, str]] = {
    # logging, saving and bookkeeping
    "log_level": (ANY, "rlcore prints a progress line every train.logging_steps steps"),
    "logging_first_step": (ANY, "rlcore prints a progress line every train.logging_steps steps"),
    "disable_tqdm": (ANY, "rlcore prints a progress line every train.logging_steps steps"),
    "logging_strategy": (("steps",), "rlcore logs every step; train.logging_steps sets how often it prints"),
    "save_strategy": (("steps",), "rlcore saves every train.save_steps steps (0 = only at the end) and at the end"),
    "eval_strategy": (("no", "steps"), "rlcore evaluates before and after training and every train.eval_steps steps"),
    "save_only_model": (ANY, "rlcore saves the trainer state next to the weights, for --resume"),
    "resume_from_checkpoint": ((None,), "resume a run with `rlcore train --resume RUN_DIR`"),
    "hub_model_id": (ANY, "rlcore cannot reach a model hub"),
    "push_to_hub": ((False,), "rlcore cannot reach a model hub; upload train.output_dir/checkpoint-<step>/model yourself"),
    "per_device_eval_batch_size": (ANY, "rlcore's greedy evaluation batches itself"),
    "dataloader_num_workers": (ANY, "rlcore reads its prompts in the training process"),
    # what the model and data pipeline already do
    "disable_dropout": (ANY, "rlcore's models have no dropout"),
    "cast_lm_head_to_fp32": (ANY, "rlcore computes log-probs in fp32 whatever the model's dtype"),
    "remove_unused_columns": (ANY, "every dataset column reaches the reward functions"),
    "shuffle_dataset": ((True,), "rlcore always shuffles the prompts (train.seed sets the order)"),
    "gradient_checkpointing_kwargs": (ANY, "train.gradient_checkpointing always recomputes without reentrancy"),
    "use_liger_kernel": (ANY, "rlcore's log-probs are chunked already (no [B, T, V] logits), which is the memory "
                              "Liger's fused loss saves, and on CUDA their softmax passes run in rlcore's own fused "
                              "kernels (rlcore/cuda)"),
    "activation_checkpointing_kwargs": (ANY, "train.gradient_checkpointing always recomputes without reentrancy"),
    "torch_compile": (ANY, "rlcore runs eager (the same computation; docs/benchmarks.md says what compiling gained)"),
    "use_cpu": ((False,), "set train.device = 'cpu'"),
    "tf32": (ANY, "rlcore leaves fp32 matmuls at full precision; for speed on GPU set train.bf16 = true"),
    "deepspeed": ((None,), "rlcore's data parallelism is torchrun --nproc_per_node=N (rlcore.parallel.collectives)"),
    "ddp_find_unused_parameters": (ANY, "rlcore averages every gradient itself (rlcore.parallel.collectives)"),
    "ddp_timeout": (ANY, "rlcore uses torch.distributed's default timeout"),
    "optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf"),
              "rlcore trains with torch.optim.AdamW (train.adam_beta1, adam_beta2, adam_epsilon, weight_decay)"),
    # generation
    "use_vllm": ((False,), "rlcore generates with its own engine (rlcore.rollout), set up under [rollout]"),
    "generation_kwargs": ((None,), "give it as a table of sampling settings (temperature, top_p, top_k, min_p, "
                                   "repetition_penalty, max_new_tokens, stop_strings), or set those rollout options"),
    "vllm_importance_sampling_correction": (ANY, "TRL applies it only with use_vllm = true, and rlcore's rollout "
                                                 "engine is not vLLM; rlcore's truncated importance sampling is "
                                                 "loss.tis_mode (TRL's vllm_importance_sampling_mode) with loss.tis_max"),
    "vllm_importance_sampling_mode": (ANY, "rlcore's rollout engine is not vLLM; its equivalent is loss.tis_mode"),
    "vllm_importance_sampling_cap": (ANY, "rlcore's rollout engine is not vLLM; its equivalent is loss.tis_max"),
    # run length and schedule
    # loss
    # models
    "model_init_kwargs": ((None,), "give it as a table (dtype or torch_dtype, attn_implementation), or set "
                                   "model.dtype"),
    "trust_remote_code": (ANY, "rlcore runs its own Llama / Qwen2 / Qwen3 code, never a checkpoint's"),
    "use_cache": (ANY, "rlcore's rollout engine keeps its own key/value cache; training runs without one"),
    "router_aux_loss_coef": ((None,), "rlcore has no mixture-of-experts models"),
    "neftune_noise_alpha": ((None,), "rlcore adds no NEFTune noise to embeddings"),
    "label_smoothing_factor": ((0, 0.0), "rlcore's losses use no label smoothing"),
    # the rest of transformers' TrainingArguments
    "optim_args": ((None,), "rlcore's AdamW takes train.adam_beta1, adam_beta2, adam_epsilon and weight_decay"),
    "optim_target_modules": ((None,), "rlcore's AdamW trains every parameter"),
    "average_tokens_across_devices": ((True,), "rlcore's dapo always counts the tokens of all ranks"),
    "torch_compile_backend": (ANY, "rlcore runs eager"),
    "torch_compile_mode": (ANY, "rlcore runs eager"),
    "liger_kernel_config": (ANY, "rlcore's log-probs are chunked already (no [B, T, V] logits)"),
    "torch_empty_cache_steps": (ANY, "rlcore leaves PyTorch's CUDA cache alone"),
    "auto_find_batch_size": ((False,), "set train.per_device_train_batch_size yourself"),
    "full_determinism": ((False,), "rlcore seeds every generator from train.seed; CPU runs repeat exactly"),
    "data_seed": ((None,), "train.seed sets the prompt order, data.seed which problems a task draws"),
    "ignore_data_skip": ((False,), "rlcore's --resume always continues at the saved data position"),
    "train_sampling_strategy": (("random",), "rlcore always shuffles the prompts (train.seed sets the order)"),
    "dataloader_drop_last": (ANY, "every rlcore round is a full batch of prompts"),
    "dataloader_pin_memory": (ANY, "rlcore reads its prompts in the training process"),
    "dataloader_persistent_workers": (ANY, "rlcore reads its prompts in the training process"),
    "dataloader_prefetch_factor": (ANY, "rlcore reads its prompts in the training process"),
    "dataloader_multiprocessing_context": (ANY, "rlcore reads its prompts in the training process"),
    "dataloader_in_order": (ANY, "rlcore reads its prompts in the training process"),
    "length_column_name": (ANY, "rlcore groups no batches by length"),
    "label_names": (ANY, "rlcore's data has prompts, not labels"),
    "pad_to_multiple_of": (ANY, "rlcore pads each batch to its longest row"),
    "accelerator_config": ((None,), "rlcore's data parallelism is torchrun --nproc_per_node=N (rlcore.parallel.collectives)"),
    "parallelism_config": ((None,), "rlcore's data parallelism is torchrun --nproc_per_node=N (rlcore.parallel.collectives)"),
    "fsdp_config": (ANY, "with train.fsdp rlcore shards every transformer block and the root with FSDP2 itself "
                         "(rlcore.parallel.fsdp)"),
    "ddp_backend": ((None,), "rlcore uses gloo on CPU and NCCL on GPU"),
    "ddp_bucket_cap_mb": (ANY, "rlcore averages every gradient itself (rlcore.parallel.collectives)"),
    "ddp_broadcast_buffers": (ANY, "rlcore averages every gradient itself (rlcore.parallel.collectives)"),
    "ddp_static_graph": (ANY, "rlcore averages every gradient itself (rlcore.parallel.collectives)"),
    "ds3_gather_for_generation": (ANY, "rlcore has no DeepSpeed"),
    "local_rank": (ANY, "torchrun sets each rank's"),
    "do_train": (ANY, "`rlcore train` trains"),
    "do_eval": (ANY, "rlcore evaluates before training and every train.eval_steps steps"),
    "do_predict": (ANY, "rlcore has no prediction mode"),
    "debug": (ANY, "rlcore has no debug modes"),
    "enable_jit_checkpoint": ((False,), "rlcore saves at train.save_steps and at the end"),
    "restore_callback_states_from_checkpoint": (ANY, "rlcore has no callbacks; --resume restores the loop's state"),
    "save_on_each_node": (ANY, "rank 0 writes every checkpoint"),
    "load_best_model_at_end": ((False,), NEWEST),
    "metric_for_best_model": ((None,), NEWEST),
    "greater_is_better": ((None,), NEWEST),
    # evaluation and logging
    "eval_on_start": (ANY, "rlcore evaluates before training whatever this says"),
    "eval_delay": (ANY, "rlcore evaluates before training and every train.eval_steps steps"),
    "eval_do_concat_batches": (ANY, "rlcore's greedy evaluation batches itself"),
    "eval_use_gather_object": (ANY, "rlcore's greedy evaluation batches itself"),
    "eval_accumulation_steps": (ANY, "rlcore's greedy evaluation batches itself"),
    "include_for_metrics": (ANY, "rlcore's evaluation reports held-out accuracy and rewards"),
    "batch_eval_metrics": (ANY, "rlcore's evaluation reports held-out accuracy and rewards"),
    "prediction_loss_only": (ANY, "rlcore's evaluation reports held-out accuracy and rewards"),
    "bf16_full_eval": (ANY, "rlcore evaluates in the model's dtype"),
    "fp16_full_eval": ((False,), "rlcore evaluates under the training passes' autocast (train.bf16 or train.fp16)"),
    "log_on_each_node": (ANY, "rank 0 writes the logs"),
    "log_level_replica": (ANY, "rank 0 writes the logs"),
    "logging_nan_inf_filter": (ANY, "rlcore logs every value, a non-finite one as null, and counts skipped steps"),
    "include_num_input_tokens_seen": (ANY, "metrics.jsonl has each step's completion lengths and tokens/s"),
    "skip_memory_metrics": (ANY, "metrics.jsonl has each step's peak memory"),
    "log_multimodal": (ANY, "rlcore's models are text only"),
    "log_unique_prompts": (ANY, "set train.log_completions for completions.jsonl"),
    "log_completions_hub_repo": ((None,), "rlcore cannot reach a model hub; completions.jsonl is in the run directory"),
    "trackio_space_id": (ANY, LOCAL_TRACKIO),
    "trackio_bucket_id": (ANY, LOCAL_TRACKIO),
    "trackio_static_space_id": (ANY, LOCAL_TRACKIO),
    "hub_token": (ANY, "rlcore cannot reach a model hub"),
    "hub_private_repo": (ANY, "rlcore cannot reach a model hub"),
    "hub_strategy": (ANY, "rlcore cannot reach a model hub"),
    "hub_always_push": (ANY, "rlcore cannot reach a model hub"),
    "hub_revision": (ANY, "rlcore cannot reach a model hub"),
    # TRL features rlcore does not have
    "cache_implementation": (ANY, "rlcore's rollout engine has its own static key/value cache"),
    "use_transformers_paged": ((False,), "rlcore generates with its own engine (rlcore.rollout)"),
    "use_transformers_continuous_batching": ((False,), "rlcore generates with its own engine (rlcore.rollout)"),
    "transformers_continuous_batching_config": ((None,), "rlcore generates with its own engine (rlcore.rollout)"),
}
"""Other `vllm_*` names (server, memory, parallelism settings) are dropped as well: rlcore has no vLLM."""

# TRL loss_type values that are a policy loss in rlcore: (loss.policy_loss, loss.loss_type), the
# latter being how TRL aggregates that loss. A config layer that sets one sets both.
LOSS_TYPES = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "vespo": ("vespo", "dapo")}

# rlcore defaults that differ from TRL 1.16's and change what a run computes (docs/trl.md's table
# of defaults that differ): (section, option) -> TRL's default. A config file written in TRL's
# flat keys that leaves one of them unset gets a warning naming it (use_bias_correction_kl only
# with beta != 0, where there is a KL term).
TRL_DEFAULTS = {("train", "lr_scheduler_type"): "linear", ("train", "bf16"): True,
                ("loss", "use_bias_correction_kl"): True}


# Other frameworks' names users bring (verl's config tree, Unsloth's loader and LoRA options):
# an "unknown config key" error adds the rlcore equivalent, or why there is none.
NO_QUANT = "rlcore trains full-precision weights (model.dtype float32 or bfloat16); leave it out"
ASYNC = ("rlcore's asynchronous rollouts are rollout.max_staleness (rounds sampled ahead; TRL's AsyncGRPOConfig "
         "name), rollout.weight_sync_steps, and rollout.rollout_ranks for ranks that only sample (docs/async.md)")
FOREIGN = {
    # TRL's AsyncGRPOConfig names beside max_staleness and weight_sync_steps, and the other frameworks'
    "queue_maxsize": "TRL's AsyncGRPOConfig; rlcore's sampler holds at most rollout.max_staleness + 1 rounds",
    "max_inflight_tasks": "TRL's AsyncGRPOConfig; rlcore samples a whole round at a time, at most "
                          "rollout.max_staleness + 1 rounds ahead",
    "heartbeat_stale_after_s": "TRL's AsyncGRPOConfig; rlcore's is rollout.sampler_timeout (seconds a trainer waits "
                               "for a round, or a sampler rank for weights, before the run stops)",
    "weight_sync_timeout": "TRL's AsyncGRPOConfig; rollout.sampler_timeout bounds every wait of rlcore's samplers",
    "async_train": "OpenRLHF's; " + ASYNC,
    "async_training": "verl's fully_async_policy tree; " + ASYNC,
    "async_level": "prime-rl's; " + ASYNC,
    "actor_rollout_ref": "verl's config tree; rlcore takes TRL's names: rollout.n -> rollout.num_generations, "
                         "rollout.response_length -> rollout.max_completion_length, actor.optim.lr -> "
                         "train.learning_rate, actor.ppo_micro_batch_size_per_gpu -> train.per_device_train_batch_size,"
                         " actor.clip_ratio_low / clip_ratio_high -> loss.epsilon / loss.epsilon_high, "
                         "actor.clip_ratio_c -> loss.delta, actor.kl_loss_coef -> loss.beta, actor.loss_agg_mode -> "
                         "loss.loss_type (`rlcore options` lists them all)",
    "algorithm": "verl's; rlcore's advantages are GRPO's (loss.scale_rewards), its KL is loss.beta, and "
                 "algorithm.filter_groups (DAPO's dynamic sampling) is rollout.filter_groups (enable), "
                 "rollout.filter_groups_metric (metric: a name in loss.reward_funcs, or none for the total "
                 "reward) and rollout.max_num_gen_batches",
    "overlong_buffer": "verl's reward_model.overlong_buffer (DAPO's overlong shaping): rlcore's is the "
                       "'soft_overlong_punishment' reward in loss.reward_funcs, len -> loss.soft_punish_cache, "
                       "penalty_factor -> its weight in loss.reward_weights",
    "overlong_buffer_len": "OpenRLHF's; rlcore's is the 'soft_overlong_punishment' reward in loss.reward_funcs "
                           "with loss.soft_punish_cache",
    "overlong_penalty_factor": "OpenRLHF's; rlcore's is the weight of 'soft_overlong_punishment' in "
                               "loss.reward_weights",
    "dynamic_filtering": "OpenRLHF's; rlcore's dynamic sampling is rollout.filter_groups, verl's rule: it keeps "
                         "the groups whose rewards differ (OpenRLHF: whose mean reward is inside a range)",
    "dynamic_filtering_reward_range": "OpenRLHF's; rlcore's dynamic sampling (rollout.filter_groups) keeps the "
                                      "groups whose rewards differ, verl's rule, and has no range",
    "trainer": "verl's; rlcore's are train.max_steps, train.save_steps, train.output_dir, ...",
    "critic": "verl's; GRPO has no critic",
    "reward_model": "verl's; rlcore's reward models are loss.reward_funcs entries: a reward model's checkpoint "
                    "directory (verl's reward_model.model.path), beside Python functions; its overlong_buffer "
                    "(DAPO's overlong shaping) is the 'soft_overlong_punishment' reward, len -> "
                    "loss.soft_punish_cache, penalty_factor -> its weight in loss.reward_weights",
    "train_files": "verl's; rlcore reads one JSONL file: data.path (data.task = 'jsonl')",
    "val_files": "verl's; rlcore's held-out file is data.eval_path",
    "train_batch_size": "verl's prompts per step; rlcore's round is train.per_device_train_batch_size x "
                        "train.steps_per_generation completions, / rollout.num_generations prompts",
    "max_response_length": "verl's; rlcore's is rollout.max_completion_length",
    "loss_agg_mode": "verl's; rlcore's is loss.loss_type: token-mean -> 'dapo', seq-mean-token-mean -> 'grpo', "
                     "seq-mean-token-sum-norm -> 'dr_grpo'",
    "kl_loss_coef": "verl's; rlcore's is loss.beta", "ppo_epochs": "verl's; rlcore's is loss.num_iterations",
    "clip_ratio_low": "verl's; rlcore's is loss.epsilon", "clip_ratio_high": "verl's; rlcore's is loss.epsilon_high",
    "clip_ratio_c": "verl's dual-clip bound; rlcore's is loss.delta",
    "clip_ratio": "verl's symmetric clip; rlcore's is loss.epsilon (and loss.epsilon_high for the upper side)",
    "kl_coef": "verl's in-reward KL (algorithm.kl_ctrl); rlcore's KL term is loss.beta",
    "lr": "rlcore's (TRL's) is train.learning_rate",
    "n": "verl's samples per prompt (rollout.n); rlcore's is rollout.num_generations",
    "response_length": "verl's; rlcore's is rollout.max_completion_length",
    "load_in_4bit": NO_QUANT, "load_in_8bit": NO_QUANT,
    "full_finetuning": "rlcore trains every weight unless lora.enabled",
    "lora_rank": "Unsloth's; rlcore's is lora.r (TRL: lora_r)",
    "target_modules": "PEFT's and Unsloth's; rlcore's is lora.target_modules (TRL: lora_target_modules)",
    "use_dora": "rlcore's adapters are LoRA's (lora.enabled); DoRA is not implemented",
    "fast_inference": "Unsloth's vLLM switch; rlcore generates with its own engine (rlcore.rollout)",
    "gpu_memory_utilization": "a vLLM setting; rlcore has no vLLM",
    "max_seq_length": "Unsloth's prompt + completion budget; rlcore's are data.max_prompt_length and "
                      "rollout.max_completion_length",
}


def foreign(key: str) -> str | None:
    """What rlcore has instead of another framework's `key` (a section, or a dotted or flat name)."""
    for part in (key, key.partition(".")[0], key.rpartition(".")[2]):  # verl's tree before its leaves (rollout.n)
        if part in FOREIGN:
            return FOREIGN[part]
    return None


def explain(key: str, value) -> tuple[bool, str] | None:
    """None when `key` is not one of TRL's names without an rlcore field; else (harmless, text):
    harmless when `value` changes nothing in rlcore (the text is the warning), else the text is
    the error, with what to set instead."""
    if key in TRL_ONLY:
        harmless, why = TRL_ONLY[key]
    elif key.startswith("vllm_"):
        harmless, why = ANY, "rlcore generates with its own engine (rlcore.rollout), not vLLM"
    else:
        return None
    if harmless is ANY or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in harmless):
        return True, f"TRL's {key} = {value!r} is ignored: {why}"
    settable = [v for v in harmless if v not in (None, "")]  # what TOML and --set can write
    keep = f" or set it to {' or '.join(map(repr, settable))}" if settable else ""
    return False, f"TRL's {key} = {value!r} is not an rlcore option: {why}; leave it out{keep}"


def rlcore_field(section: str, key: str, value, values: dict) -> str:
    """The field that `key` (= `value`, in `section`, beside its other keys `values`) sets: the
    field of TRL's alias, warmup_ratio for a fraction in warmup_steps (as transformers 5 writes a
    warmup ratio), else `key` itself."""
    if section == "train" and key == "warmup_steps" and isinstance(value, float) and 0 < value < 1:
        if "warmup_ratio" in values:
            raise ConfigError(f"train.warmup_steps = {value} (a ratio, as transformers 5 writes one) "
                              f"and train.warmup_ratio = {values['warmup_ratio']} are both set; keep one")
        return "warmup_ratio"
    if FLAT_ALIASES.get(key, (None,))[0] == section:  # a TRL name inside its section
        return FLAT_ALIASES[key][1]
    return key


def expand_loss_type(layer: dict) -> None:
    """TRL's loss_type = 'cispo' / 'sapo' / 'vespo' names a policy loss and, implicitly, TRL's
    aggregation of it: one config layer (a file, or the --set overrides) that gives it sets
    loss.policy_loss and loss.loss_type, as TRL would compute that loss."""
    loss = layer.get("loss", {})
    name = loss.get("loss_type")
    if not isinstance(name, str) or name not in LOSS_TYPES:
        return
    policy, aggregation = LOSS_TYPES[name]
    if loss.get("policy_loss", policy) != policy:
        raise ConfigError(f"loss.loss_type = {name!r} (TRL's name for loss.policy_loss = {policy!r} with "
                          f"loss.loss_type = {aggregation!r}) and loss.policy_loss = {loss['policy_loss']!r} "
                          f"disagree; keep one")
    loss["policy_loss"], loss["loss_type"] = policy, aggregation


FSDP_OPTIONS = ("full_shard", "auto_wrap", "offload")
"""The entries of transformers' `fsdp` option that rlcore does: FSDP2 over every block and the root
(train.fsdp), with the shards in CPU memory (train.fsdp_offload)."""


def expand_tables(out: dict) -> None:
    """TRL's generation_kwargs (sampling settings, which win over the named options, as in TRL) and
    model_init_kwargs (how from_pretrained loads the policy) become the rlcore options they set,
    and its fsdp (transformers' FSDP options, a string or a list) becomes train.fsdp."""
    fsdp = out.get("train", {}).get("fsdp")
    if isinstance(fsdp, (str, list)) and str(fsdp).lower() not in ("true", "false"):  # those: a mistyped bool
        options = fsdp.split() if isinstance(fsdp, str) else fsdp
        if other := [o for o in options if o not in FSDP_OPTIONS]:
            raise ConfigError(f"TRL's fsdp = {fsdp!r}: rlcore has no {', '.join(map(repr, other))}; train.fsdp = "
                              f"true shards weights, gradients and optimizer state over every rank (full_shard) "
                              f"with each transformer block wrapped (auto_wrap): set fsdp = 'full_shard auto_wrap' "
                              f"or train.fsdp = true")
        out["train"]["fsdp"] = bool(options)
        if "offload" in options:
            out["train"]["fsdp_offload"] = True
    for section in list(out):
        kwargs = out[section].pop("generation_kwargs", None)
        if isinstance(kwargs, dict):
            for key, value in kwargs.items():
                if key not in GENERATION_KWARGS:
                    raise ConfigError(f"generation_kwargs key {key!r} (= {value!r}) has no rlcore equivalent; rlcore's "
                                      f"rollout takes {', '.join(GENERATION_KWARGS)}; set the others' effect some "
                                      f"other way or leave them out")
                out.setdefault("rollout", {})[GENERATION_KWARGS[key]] = value
        elif kwargs is not None:
            out[section]["generation_kwargs"] = kwargs  # not a table: config_from_dict names the problem
        kwargs = out[section].pop("model_init_kwargs", None)
        if isinstance(kwargs, dict):
            for key, value in kwargs.items():
                if key in ("dtype", "torch_dtype"):
                    out.setdefault("model", {})["dtype"] = value
                elif key in ("attn_implementation", "use_cache", "low_cpu_mem_usage"):
                    warnings.warn(f"TRL's model_init_kwargs {key} = {value!r} is ignored: rlcore's model code "
                                  f"attends with torch's SDPA and loads weights itself", RlcoreWarning, stacklevel=3)
                else:
                    raise ConfigError(f"model_init_kwargs key {key!r} (= {value!r}) has no rlcore equivalent; "
                                      f"rlcore takes dtype (or torch_dtype), as model.dtype")
        elif kwargs is not None:
            out[section]["model_init_kwargs"] = kwargs


def warn_trl_defaults(config: Config, path: str, given: set[tuple[str, str]]) -> None:
    """Warn about the options of `TRL_DEFAULTS` that a file written in TRL's flat keys
    that names a model (`path`) and the overrides (`given`, with the file's) leave to rlcore's
    default, which is not TRL's: such a file trains as TRL would only with them set."""
    unset = [f"{key} = {value!r} (TRL: {trl!r})" for (section, key), trl in TRL_DEFAULTS.items()
             if (section, key) not in given and (value := getattr(getattr(config, section), key)) != trl
             and (key != "use_bias_correction_kl" or config.loss.beta != 0)]
    if unset:
        warnings.warn(f"config file {path} is written in TRL's flat keys but leaves options unset whose value "
                      f"here is not TRL's default: {', '.join(unset)}; set them in the file to train as TRL would "
                      "(docs/trl.md, 'Defaults that differ from TRL 1.16's')", RlcoreWarning, stacklevel=3)
