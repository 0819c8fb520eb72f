"""Every option rlcore takes: the six sections of a config as dataclasses, with their defaults
and one docstring line per field, and `Config`, the six together.

Option names are TRL `GRPOConfig`'s wherever TRL has the option, so a TRL config carries across
(trl_names.py maps the rest). Each field's docstring is the string on the line after it;
`field_docs` reads them back, so `rlcore options` and the documented table come from this file.
The defaults here are rlcore's only ones: `Config` fills in those that depend on another field,
and config/default.toml is the embedded tiny model's run, a config file laid over them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Literal

from rlcore import RlcoreWarning


@dataclass
class ModelArgs:
    path: str = ""
    """Hugging Face checkpoint dir (config.json, *.safetensors, tokenizer); "" or "embedded" = the embedded tiny model"""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """dtype of the policy's (and reference's) weights; 'auto' = the checkpoint's; for mixed precision: train.bf16"""
    ref_path: str | None = None
    """checkpoint for the reference model (read only when loss.beta != 0); None = the initial policy"""


@dataclass
class DataArgs:
    task: Literal["arithmetic", "countdown", "multiplication", "arithmetic_question", "jsonl"] = "arithmetic"
    """prompts: a synthetic task generated in-process, or a JSONL file (data.path)"""
    path: str | None = None
    """JSONL file with one example per line (task "jsonl" only)"""
    eval_path: str | None = None
    """JSONL file for evaluation (task "jsonl"), its first num_eval rows; None = num_eval rows held out of data.path"""
    prompt_column: str = "prompt"
    """JSONL column with the prompt: a string, or a list of chat messages (content: text, or a list of text parts)"""
    answer_column: str = "answer"
    """JSONL column with the reference answer the accuracy reward reads ("" = none); "... #### 42" counts as 42"""
    num_train: int = 1000
    """training examples (synthetic: generated; jsonl: at most this many rows, 0 = all)"""
    num_eval: int = 32
    """held-out evaluation examples, never in the training set (0 = no evaluation)"""
    seed: int = 0
    """seed for generating and splitting the data; kept apart from train.seed so the eval set stays fixed"""
    system_prompt: str | None = None
    """system message put before every prompt; None = no system message"""
    use_chat_template: bool = True
    """format prompts with the tokenizer's chat template when it has one"""
    chat_template_kwargs: dict[str, str | int | float | bool] = field(default_factory=dict)
    """extra variables for the chat template, e.g. {enable_thinking = false} for Qwen3 (TRL's option)"""
    max_prompt_length: int = 512
    """longest prompt in tokens, after formatting; a longer prompt is an error that names it"""


@dataclass
class RolloutArgs:
    num_generations: int = 8
    """G: completions sampled per prompt; advantages are relative to these (>= 2)"""
    max_completion_length: int = 512
    """most tokens generated per completion; one that reaches it without EOS is truncated"""
    temperature: float = 1.0
    """sampling temperature; training log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling: keep the smallest token set with this much probability (1.0 = off)"""
    top_k: int = 0
    """keep only the k most likely tokens (0 = off)"""
    min_p: float = 0.0
    """drop tokens less likely than min_p times the most likely one (0.0 = off)"""
    repetition_penalty: float = 1.0
    """transformers' penalty on tokens already in prompt or completion: logit / this if > 0, else * this (1.0 = off)"""
    stop: list[str] = field(default_factory=list)
    """strings that end a completion (held-out ones too), besides EOS (matched on each string's own token ids)"""
    seed: int | None = None
    """sampling seed; None = train.seed"""
    tools: list[str] = field(default_factory=list)
    """functions the model may call, as "module:function" (type hints and a Google docstring give the schema)"""
    environment_factory: str | None = None
    """a "module:Class" making one environment per completion: reset(**row); its public methods are tools"""
    max_tool_calling_iterations: int | None = None
    """most tool-calling turns per completion (TRL's name); None = until max_completion_length"""
    tool_timeout: float = 30.0
    """seconds a tool call may run before the model gets a timeout error as its result"""
    filter_groups: bool = False
    """dynamic sampling (DAPO): keep only groups whose rewards differ, sampling more prompts until the round is full"""
    filter_groups_metric: str | None = None
    """what dynamic sampling judges: None = the weighted total reward, or one name of loss.reward_funcs"""
    max_num_gen_batches: int = 0
    """dynamic sampling: most generation batches per round (0 = no cap); at the cap the round trains on what it has"""
    max_staleness: int = 0
    """asynchronous rollouts: round r is sampled ahead with the weights from the start of round r - this (0 = synchronous)"""
    weight_sync_steps: int = 1
    """asynchronous rollouts: the trainer publishes its weights to the sampler every this many optimizer steps"""
    sampler_thread: bool = False
    """sample on a thread with its own copy of the weights even at max_staleness = 0 (on by itself above 0)"""
    rollout_ranks: int = 0
    """under torchrun: this many ranks (the last ones) only sample, the others only train (0 = each does both)"""
    sampler_timeout: float = 1800.0
    """seconds the trainer waits for a round sampled ahead (or a sampler rank for weights) before the run stops"""


@dataclass
class LossArgs:
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo"] = "dapo"
    """how per-token losses are averaged over an optimizer step (SPEC section 5)"""
    policy_loss: Literal["ppo", "cispo", "sapo", "vespo"] = "ppo"
    """per-token policy loss: PPO clipped ratio, CISPO (clipped IS weight), SAPO (soft gate), VESPO (gamma weight)"""
    sapo_temperature_pos: float = 1.0
    """sapo: gate temperature for tokens with positive advantage"""
    sapo_temperature_neg: float = 1.05
    """sapo: gate temperature for tokens with negative advantage"""
    vespo_k_pos: float = 2.0
    """vespo: shape k of the sequence weight for advantages >= 0"""
    vespo_lambda_pos: float = 3.0
    """vespo: rate lambda of the sequence weight for advantages >= 0"""
    vespo_k_neg: float = 3.0
    """vespo: shape k of the sequence weight for negative advantages"""
    vespo_lambda_neg: float = 2.0
    """vespo: rate lambda of the sequence weight for negative advantages"""
    beta: float = 0.0
    """KL coefficient against the reference model (k3 estimator); 0.0 loads no reference model"""
    use_bias_correction_kl: bool = False
    """multiply the KL term by the importance ratio, as TRL does by default (false: k3 alone, SPEC 4)"""
    sync_ref_model: bool = False
    """TR-DPO: every ref_model_sync_steps steps, ref = alpha x policy + (1 - alpha) x ref (needs beta != 0)"""
    ref_model_mixup_alpha: float = 0.6
    """sync_ref_model's alpha: the policy's share of the new reference weights"""
    ref_model_sync_steps: int = 512
    """sync_ref_model: optimizer steps between two syncs of the reference model"""
    epsilon: float = 0.2
    """lower clip range: ratios below 1 - epsilon are clipped"""
    epsilon_high: float | None = None
    """upper clip range, 1 + epsilon_high (DAPO: 0.28; cispo: absolute cap, e.g. 5.0); None = epsilon"""
    delta: float | None = None
    """cap on the unclipped ratio (two-sided clipping, > 1 + epsilon_high recommended); None = off"""
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    """ratio per token, per sequence (GSPO), or sequence value with per-token gradient (GSPO-token)"""
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    """divide advantages by the group std, the batch std, or not at all (Dr. GRPO); true = group, false = none"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """several reward functions: weight and sum, then normalise per group (SPEC 2), or normalise each per group first (GDPO)"""
    mask_truncated_completions: bool = False
    """exclude completions that hit max_completion_length without EOS from the loss"""
    top_entropy_quantile: float = 1.0
    """train only on the tokens in this top fraction of entropy (1.0 = all tokens)"""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2: drop negative-advantage sequences whose mean KL(rollout || policy) exceeds this (None = off)"""
    entropy_coef: float = 0.0
    """entropy bonus: loss -= entropy_coef x mean token entropy (TRL's; same scale for every loss_type; 0.0 = off)"""
    use_adaptive_entropy: bool = False
    """adapt entropy_coef each step towards entropy_target (Skywork-OR1); the bonus applies only at or below it"""
    entropy_target: float = 0.2
    """adaptive control: the entropy (nats per token) below which the bonus applies and its coefficient grows"""
    entropy_coef_delta: float = 0.005
    """adaptive control: how much entropy_coef moves per optimizer step"""
    entropy_coef_min: float = 0.0
    """adaptive control: lower bound of entropy_coef"""
    entropy_coef_max: float = 1.0
    """adaptive control: upper bound of entropy_coef"""
    num_iterations: int = 1
    """mu: passes over each generation batch"""
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None = None
    """rollout-vs-trainer importance-sampling correction; None = off"""
    tis_min: float = 0.0
    """lower bound on the TIS weight (mask modes zero weights below it)"""
    tis_max: float = 2.0
    """upper bound on the TIS weight (truncate modes clamp to it, mask modes zero above it)"""
    reward_weights: list[float] | None = None
    """weight of each reward function, same order as reward_funcs; None = all 1.0"""
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    """reward functions: built-in names (rlcore.rewards.answers.REWARDS), "module:function", or a reward model's dir"""
    reward_model_batch_size: int = 8
    """completions a reward model (a reward_funcs checkpoint dir) scores per forward pass"""
    reward_on_error: Literal["raise", "none"] = "raise"
    """a reward function that raises stops the run ("raise") or scores that completion None ("none")"""
    soft_punish_cache: int | None = None
    """soft_overlong_punishment's L_cache: lengths in (L_max - L_cache, L_max] score 0 down to -1 (DAPO eq. 13)"""
    soft_punish_max_completion_len: int | None = None
    """soft_overlong_punishment's L_max, past which a completion scores -1; None = rollout.max_completion_length"""


@dataclass
class TrainArgs:
    per_device_train_batch_size: int = 8
    """b: completions per micro-batch on each device"""
    gradient_accumulation_steps: int = 1
    """GA: micro-batches per optimizer step"""
    steps_per_generation: int | None = None
    """S: micro-batches per generation round; the round makes b * S * world_size completions; None = GA"""
    generation_batch_size: int | None = None
    """TRL's other way to set S: completions per round over all ranks (= b * S * world_size); None = from S"""
    max_steps: int = 100
    """optimizer steps to train for; -1 = num_train_epochs passes over the training prompts (TRL's)"""
    num_train_epochs: float = 3.0
    """passes over the training prompts when max_steps = -1 (a config giving this without max_steps sets -1)"""
    learning_rate: float = 1e-6
    """peak AdamW learning rate"""
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr"] = "constant"
    """constant (no warmup), constant_with_warmup, or linear / cosine decay to 0 (to min_lr) after a linear warmup"""
    lr_scheduler_kwargs: dict[str, float] = field(default_factory=dict)
    """transformers' schedule arguments: num_cycles (cosine), min_lr or min_lr_rate (cosine_with_min_lr)"""
    warmup_ratio: float = 0.0
    """linear warmup over ceil(this fraction of max_steps) steps"""
    warmup_steps: int = 0
    """linear warmup over this many optimizer steps: step s < W runs at lr (s+1)/(W+1) (transformers: s/W)"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay"""
    adam_beta1: float = 0.9
    """AdamW beta1"""
    adam_beta2: float = 0.999
    """AdamW beta2"""
    adam_epsilon: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (0.0 = no clipping)"""
    seed: int = 42
    """seed for the prompt order, the micro-batch shuffle and (by default) sampling"""
    bf16: bool = False
    """bfloat16 autocast for the training forward passes and a bf16 rollout (GPU; on CPU it pays only with AMX)"""
    fp16: bool = False
    """float16 autocast over fp32 weights with dynamic loss scaling, and an fp16 rollout (GPUs without bf16: T4, V100)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in backward instead of keeping them (TRL's default is True)"""
    fsdp: bool = False
    """shard weights, gradients and AdamW state over torchrun's ranks (FSDP2), with sharded checkpoints"""
    fsdp_offload: bool = False
    """with train.fsdp: keep the shards and AdamW state in CPU memory, each block's copied to the GPU to compute"""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where to run; auto = cuda when available"""
    output_dir: str = "runs/rlcore"
    """directory for metrics, checkpoints and the resolved config; "{time}" becomes the start time (with rlcore train)"""
    logging_steps: int = 1
    """print a progress line every this many optimizer steps, and at the first and last (metrics.jsonl gets every step)"""
    log_completions: bool = False
    """append every completion with its rewards and advantage to completions.jsonl, and print some"""
    num_completions_to_print: int | None = None
    """completions of each round log_completions prints (None = all, as TRL)"""
    eval_steps: int = 0
    """held-out evaluation every this many steps, at round ends (0 = only before and after training)"""
    save_steps: int = 0
    """save a checkpoint every this many optimizer steps (0 = only at the end)"""
    save_total_limit: int | None = 2
    """checkpoints kept in output_dir, the newest ones (None = all; TRL's default)"""
    max_nonfinite_steps: int = 3
    """stop after this many consecutive steps with a non-finite loss or gradient (they are skipped)"""
    eval_max_completion_length: int | None = None
    """most tokens per completion at evaluation (greedy); None = rollout.max_completion_length"""
    eval_num_generations: int = 1
    """n: completions per held-out prompt; n > 1 samples n besides the greedy one, for eval/mean@n, pass@k, maj@n"""
    eval_temperature: float | None = None
    """sampling temperature of the n > 1 held-out completions; None = rollout.temperature"""
    eval_pass_at_k: list[int] | None = None
    """the k of eval/pass@k (each <= eval_num_generations); None = [1, eval_num_generations]"""
    report_to: str | list[str] = "none"
    """trackers that also get metrics, evaluations and config: 'tensorboard', 'wandb', 'trackio', a list, or 'none'"""
    run_name: str | None = None
    """the run's name in the trackers (report_to); None = the run directory's name"""
    project: str = "huggingface"
    """the trackers' project: trackio's, and wandb's unless WANDB_PROJECT is set (TRL's default)"""


TRACKERS = ("tensorboard", "wandb", "trackio")
"""The trackers train.report_to can name, each an optional extra of the same name (pip install -e ".[wandb]")."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA adapters can go on (Hugging Face's names; 'all-linear' is every one)."""


@dataclass
class LoraArgs:
    enabled: bool = False
    """train LoRA adapters (PEFT's format) instead of every weight; the base stays frozen (TRL: use_peft)"""
    r: int = 16
    """adapter rank (TRL: lora_r)"""
    alpha: float = 32.0
    """adapter scale numerator: the update is alpha / r * B @ A (TRL: lora_alpha)"""
    dropout: float = 0.05
    """dropout on the adapters' input in the update's passes, not in the rollout, old or ref passes (TRL: lora_dropout)"""
    target_modules: str | list[str] = "all-linear"
    """'all-linear' or names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (TRL: lora_target_modules)"""
    use_rslora: bool = False
    """rank-stabilised scale alpha / sqrt(r) (Kalajdzievski 2023) instead of alpha / r (TRL: use_rslora)"""
    adapter_path: str | None = None
    """start from this PEFT adapter directory (adapter_config.json); with loss.beta it is also the KL reference"""


SECTIONS: dict[str, type] = {"model": ModelArgs, "data": DataArgs, "rollout": RolloutArgs,
                             "loss": LossArgs, "train": TrainArgs, "lora": LoraArgs}


def sections_with(key: str) -> list[str]:
    """The sections that have a field named `key`."""
    return [name for name, cls in SECTIONS.items() if key in field_names(cls)]


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def field_docs(cls: type) -> dict[str, str]:
    """`{field: docstring}` for a dataclass whose fields each have a string literal on the next line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


EMBEDDED_MODEL_PATHS = ("", "embedded")
"""The model.path values that name the embedded tiny model (built and cached on first use)."""

PATH_OPTIONS = (("model", "path"), ("model", "ref_path"), ("data", "path"), ("data", "eval_path"),
                ("lora", "adapter_path"))
"""The options that name files or directories (relative ones are taken from the current directory)."""


@dataclass
class Config:
    """The six sections; defaults that depend on another field are filled in as TRL does in
    `__post_init__`: train.steps_per_generation (= GA), loss.epsilon_high (= epsilon), rollout.seed
    (= train.seed), train.eval_max_completion_length (= max_completion_length),
    loss.soft_punish_max_completion_len (= max_completion_length) and train.eval_pass_at_k (= [1,
    eval_num_generations])."""

    model: ModelArgs = field(default_factory=ModelArgs)
    """the policy checkpoint"""
    data: DataArgs = field(default_factory=DataArgs)
    """prompts and reference answers"""
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    """sampling"""
    loss: LossArgs = field(default_factory=LossArgs)
    """rewards, advantages and the policy loss"""
    train: TrainArgs = field(default_factory=TrainArgs)
    """batching, optimizer and bookkeeping"""
    lora: LoraArgs = field(default_factory=LoraArgs)
    """LoRA adapters instead of training every weight"""

    def __post_init__(self):
        for section, key in (*PATH_OPTIONS, ("train", "output_dir")):  # "~/ckpt" as a shell would read it
            value = getattr(getattr(self, section), key)
            if isinstance(value, str) and value.startswith("~"):
                setattr(getattr(self, section), key, os.path.expanduser(value))
        # Fill the defaults that depend on another field (TRL does the same in __post_init__).
        if isinstance(self.loss.scale_rewards, bool):
            self.loss.scale_rewards = "group" if self.loss.scale_rewards else "none"
        if self.loss.epsilon_high is None:
            if self.loss.policy_loss == "cispo":
                warnings.warn("loss.policy_loss='cispo' uses loss.epsilon_high as an absolute cap "
                              "on the IS weight and it is left at epsilon; set "
                              "loss.epsilon_high=5.0 (the CISPO paper's value)", RlcoreWarning, stacklevel=2)
            self.loss.epsilon_high = self.loss.epsilon
        # (from generation_batch_size, S depends on the world size: Geometry.of resolves it)
        if self.train.steps_per_generation is None and self.train.generation_batch_size is None:
            self.train.steps_per_generation = self.train.gradient_accumulation_steps
        if self.rollout.seed is None:
            self.rollout.seed = self.train.seed
        if self.train.eval_max_completion_length is None:
            self.train.eval_max_completion_length = self.rollout.max_completion_length
        if self.loss.soft_punish_max_completion_len is None:
            self.loss.soft_punish_max_completion_len = self.rollout.max_completion_length
        if self.train.eval_pass_at_k is None:
            self.train.eval_pass_at_k = sorted({1, self.train.eval_num_generations})
