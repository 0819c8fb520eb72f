"""TRL option names rlcore has no field for, and what a config that sets one gets.

rlcore's options are TRL's `GRPOConfig` names (and the `TrainingArguments` ones a GRPO run sets),
so a TRL config mostly loads as it is. The names below are TRL's without an rlcore field. A value
that changes nothing about how rlcore trains (`report_to = "none"`, `use_vllm = false`, a
`vllm_*` server setting) is dropped with a warning that says why; any other value is a
`ConfigError` that says what to set instead. Without this table they would be "unknown config
key" errors with a spelling hint that points at an unrelated option.
"""

from __future__ import annotations

ANY = object()  # every value is harmless: warn and drop

# TRL name -> (values that change nothing in rlcore, why / what to set instead)
TRL_ONLY: dict[str, tuple[object, str]] = {
    # logging, saving and bookkeeping
    "report_to": (ANY, "rlcore logs every step to metrics.jsonl (and a PNG plot) in train.output_dir"),
    "run_name": (ANY, "the run is named by train.output_dir"),
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
    "num_generations_eval": (ANY, "rlcore evaluates one greedy completion per held-out prompt"),
    "dataloader_num_workers": (ANY, "rlcore reads its prompts in the training process"),
    # what the model and data pipeline already do
    "disable_dropout": (ANY, "rlcore's models have no dropout"),
    "cast_lm_head_to_fp32": (ANY, "rlcore computes log-probs in fp32 whatever the model's dtype"),
    "remove_unused_columns": (ANY, "every dataset column reaches the reward functions"),
    "shuffle_dataset": ((True,), "rlcore always shuffles the prompts (train.seed sets the order)"),
    "gradient_checkpointing_kwargs": (ANY, "train.gradient_checkpointing always recomputes without reentrancy"),
    "use_liger_kernel": ((False,), "rlcore's log-probs are chunked already (no [B, T, V] logits)"),
    "activation_checkpointing_kwargs": (ANY, "train.gradient_checkpointing always recomputes without reentrancy"),
    "torch_compile": ((False,), "rlcore runs eager"),
    "use_cpu": ((False,), "set train.device = 'cpu'"),
    "tf32": ((None, False), "rlcore leaves fp32 matmuls at full precision; for speed on GPU set train.bf16 = true"),
    "deepspeed": ((None,), "rlcore's data parallelism is torchrun --nproc_per_node=N (rlcore.distributed)"),
    "fsdp": (("", None), "rlcore's data parallelism is torchrun --nproc_per_node=N (rlcore.distributed)"),
    "ddp_find_unused_parameters": (ANY, "rlcore averages every gradient itself (rlcore.distributed)"),
    "ddp_timeout": (ANY, "rlcore uses torch.distributed's default timeout"),
    "optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf"),
              "rlcore trains with torch.optim.AdamW (train.adam_beta1, adam_beta2, adam_epsilon, weight_decay)"),
    "fp16": ((False,), "fp16 training is not supported; set train.bf16 = true (bf16 autocast over fp32 weights)"),
    # generation
    "use_vllm": ((False,), "rlcore generates with its own engine (rlcore.rollout), set up under [rollout]"),
    "generation_kwargs": ((None,), "set sampling with rollout.temperature, top_p, top_k, min_p and stop"),
    "generation_batch_size": ((None,), "set train.steps_per_generation = generation_batch_size / "
                                       "(per_device_train_batch_size * world size)"),
    "vllm_importance_sampling_correction": ((False,), "rlcore's rollout engine is not vLLM; for truncated "
                                                      "importance sampling set loss.tis_mode (TRL's "
                                                      "vllm_importance_sampling_mode) and loss.tis_max (its cap)"),
    "vllm_importance_sampling_mode": (ANY, "rlcore's rollout engine is not vLLM; its equivalent is loss.tis_mode"),
    "vllm_importance_sampling_cap": (ANY, "rlcore's rollout engine is not vLLM; its equivalent is loss.tis_max"),
    # run length and schedule
    "num_train_epochs": ((), "rlcore counts optimizer steps: set train.max_steps (one pass over P prompts takes "
                             "P * num_generations / (per_device_train_batch_size * gradient_accumulation_steps "
                             "* world size) steps)"),
    "lr_scheduler_kwargs": ((None,), "rlcore's schedules (train.lr_scheduler_type) take no arguments"),
    # loss
    "multi_objective_aggregation": (("sum_then_normalize",), "rlcore sums the weighted rewards, then normalises"),
    "off_policy_mask_threshold": ((None,), "rlcore has no off-policy sequence mask; see loss.tis_mode"),
    "sapo_temperature_pos": ((1.0,), "loss.policy_loss = 'sapo' uses TRL's default temperatures (1.0, 1.05)"),
    "sapo_temperature_neg": ((1.05,), "loss.policy_loss = 'sapo' uses TRL's default temperatures (1.0, 1.05)"),
    # models
    "model_init_kwargs": ((None,), "set the weights' dtype with model.dtype; rlcore takes no other loading options"),
}
"""Other `vllm_*` names (server, memory, parallelism settings) are dropped as well: rlcore has no vLLM."""

# TRL loss_type values that are a policy loss in rlcore (loss.policy_loss), or not in rlcore
LOSS_TYPES = {
    "cispo": "loss.policy_loss = 'cispo' with loss.loss_type = 'dapo' (TRL aggregates cispo as dapo)",
    "sapo": "loss.policy_loss = 'sapo' with loss.loss_type = 'grpo' (TRL aggregates sapo as grpo)",
    "luspo": "a loss rlcore does not have; choose loss.loss_type from 'grpo', 'bnpo', 'dr_grpo', 'dapo'",
    "vespo": "a loss rlcore does not have; choose loss.loss_type from 'grpo', 'bnpo', 'dr_grpo', 'dapo'",
}


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
