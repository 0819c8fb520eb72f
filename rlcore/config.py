"""The run configuration: five dataclass sections with defaults, loaded from TOML and `--set`.

Option names are TRL `GRPOConfig`'s wherever TRL has the option, so a TRL config carries across;
a TRL-style flat key at the top level of a TOML file (`beta = 0.04`) goes to the one section
that has it. Each field's docstring is the string on the line after it; `field_docs` reads them
back, so the README's table and `rlcore options` come from this file.

Precedence: dataclass defaults < TOML file < `--set section.key=value`, applied in order. A
config file that names no model (model.path unset, "" or "embedded", in the file and the `--set`
values) trains the embedded tiny model, so its unset keys come from the embedded default run
(rlcore/default.toml), not from the dataclass defaults (which are TRL's, for real models).

Defaults that depend on another field are filled in when the config is built (as TRL does in
`__post_init__`): `train.steps_per_generation` (= GA), `loss.epsilon_high` (= epsilon),
`rollout.seed` (= train.seed), `train.eval_max_completion_length` (= max_completion_length).
This file checks each key and its type (and the TRL aliases that would set one value twice);
rlcore/validation.py checks the values and how they combine.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import math
import os
import re
import sys
import textwrap
import types
import typing
import warnings
from pathlib import Path
from dataclasses import dataclass, field
from typing import Literal

from rlcore import EMBEDDED_DEFAULT, ConfigError, RlcoreWarning, trl_options
from rlcore.checkpoint import RUN_CONFIG_HEADER
from rlcore.validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


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
    task: Literal["arithmetic", "countdown", "jsonl"] = "arithmetic"
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
    """reward functions: built-in names (rlcore.rewards.REWARDS) or "module:function" of your own"""
    reward_on_error: Literal["raise", "none"] = "raise"
    """a reward function that raises stops the run ("raise") or scores that completion None ("none")"""


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
    gradient_checkpointing: bool = False
    """recompute each layer's activations in backward instead of keeping them (TRL's default is True)"""
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


SECTIONS: dict[str, type] = {"model": ModelArgs, "data": DataArgs, "rollout": RolloutArgs,
                             "loss": LossArgs, "train": TrainArgs}

# Top-level keys that are not a field name of exactly one section: TRL names and the shared seed.
FLAT_ALIASES = {"seed": ("train", "seed"), "model_name_or_path": ("model", "path"),
                "activation_checkpointing": ("train", "gradient_checkpointing")}  # transformers 5's name


@dataclass
class Config:
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
        if self.train.generation_batch_size is not None:  # S is resolved for the world size: generation_steps()
            if self.train.steps_per_generation is not None:
                raise ConfigError(f"train.generation_batch_size = {self.train.generation_batch_size} and "
                                  f"train.steps_per_generation = {self.train.steps_per_generation} are both set; "
                                  f"they say the same thing (generation_batch_size = per_device_train_batch_size * "
                                  f"steps_per_generation * world size), keep one (as TRL requires)")
        elif self.train.steps_per_generation is None:
            self.train.steps_per_generation = self.train.gradient_accumulation_steps
        if self.rollout.seed is None:
            self.rollout.seed = self.train.seed
        if self.train.eval_max_completion_length is None:
            self.train.eval_max_completion_length = self.rollout.max_completion_length

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """Build from a nested dict `{section: {key: value}}` (flat TRL keys allowed), checking keys and types."""
        d = normalize(d)
        sections = {}
        for name, values in d.items():
            section_cls = SECTIONS[name]
            hints = typing.get_type_hints(section_cls)
            kwargs = {}
            if name == "train" and "num_train_epochs" in values and "max_steps" not in values:
                values = {**values, "max_steps": -1}  # TRL's default max_steps: count the epochs
            for key, value in values.items():
                if name == "train" and key == "warmup_steps" and isinstance(value, float) and 0 < value < 1:
                    if "warmup_ratio" in values:
                        raise ConfigError(f"train.warmup_steps = {value} (a ratio, as transformers 5 writes one) "
                                          f"and train.warmup_ratio = {values['warmup_ratio']} are both set; keep one")
                    key = "warmup_ratio"  # transformers 5 writes a warmup ratio as a fraction in warmup_steps
                if FLAT_ALIASES.get(key, (None,))[0] == name:  # a TRL name inside its section
                    key = FLAT_ALIASES[key][1]
                if key in kwargs and kwargs[key] != value:
                    raise ConfigError(f"{name}.{key} is set twice, to {kwargs[key]!r} and {value!r} (one of them "
                                      f"under another name TRL uses for it); keep one")
                if key not in hints:
                    trl = trl_options.explain(key, value)
                    if trl is None:
                        raise ConfigError(f"unknown config key {name}.{key}{_suggest(f'{name}.{key}')}")
                    harmless, text = trl
                    if not harmless:
                        raise ConfigError(text)
                    warnings.warn(text, RlcoreWarning, stacklevel=3)
                    continue
                kwargs[key] = _check_type(f"{name}.{key}", value, hints[key])
            sections[name] = section_cls(**kwargs)
        return cls(**sections)


def config_to_dict(config: Config) -> dict:
    """The config as a nested dict `{section: {key: value}}`; `Config.from_dict` inverts it."""
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    """The config as TOML text that `load_config` reads back to an equal config (None is left out
    where it is the default, and written "none" where it is not)."""
    lines = []
    for name, values in config_to_dict(config).items():
        lines.append(f"[{name}]")
        defaults = {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
        lines += [f"{key} = {_toml_value(v)}" if v is not None else f'{key} = "none"'
                  for key, v in values.items() if v is not None or defaults[key] is not None]
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def _toml_string(s: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(escapes.get(c, c if c.isprintable() else f"\\u{ord(c):04x}") for c in s) + '"'


EMBEDDED_MODEL_PATHS = ("", "embedded")
"""The model.path values that name the embedded tiny model (built and cached on first use)."""

PATH_OPTIONS = (("model", "path"), ("model", "ref_path"), ("data", "path"), ("data", "eval_path"))
"""The options that name files or directories (relative ones are taken from the current directory)."""


def with_absolute_paths(config: Config) -> Config:
    """A copy of `config` with the PATH_OPTIONS that are set made absolute (the embedded model's
    "" / "embedded" stay): what a run directory records, so a --resume from elsewhere finds them."""
    config = copy.deepcopy(config)
    for section, key in PATH_OPTIONS:
        value = getattr(getattr(config, section), key)
        if value is not None and value not in EMBEDDED_MODEL_PATHS:
            setattr(getattr(config, section), key, str(Path(value).resolve()))
    return config


def recorded_sections(config_toml: Path) -> dict | None:
    """A run directory's config.toml as written, without applying or checking it; None when absent."""
    if not config_toml.is_file():
        return None
    with open(config_toml, "rb") as f:
        return tomllib.load(f)


def recorded_model(config_toml: Path) -> str | None:
    """The model a run directory's config.toml records: its model.path, or for the embedded model
    "embedded (data.seed = S, data.num_eval = E)", the keys its build depends on; None when the
    file is absent."""
    if (recorded := recorded_sections(config_toml)) is None:
        return None
    path, data = recorded.get("model", {}).get("path", ""), recorded.get("data", {})
    if path not in EMBEDDED_MODEL_PATHS:
        return path
    return embedded_model_name(data.get("seed", DataArgs.seed), data.get("num_eval", DataArgs.num_eval))


DATA_SELECTION = ("task", "path", "eval_path", "num_train", "num_eval", "seed")  # which rows, in which order


def changed_data(config_toml: Path, data: DataArgs) -> list[str]:
    """`data.key = now (was before)` for each DATA_SELECTION option that differs from a run
    directory's config.toml (a path the same file under another spelling does not differ)."""
    recorded, defaults, changes = (recorded_sections(config_toml) or {}).get("data", {}), DataArgs(), []
    for key in DATA_SELECTION:
        was, now = recorded.get(key, getattr(defaults, key)), getattr(data, key)
        same_file = key.endswith("path") and was and now and Path(was).exists() and Path(now).exists() \
            and os.path.samefile(was, now)
        if was != now and not same_file:
            changes.append(f"data.{key} = {now!r} (was {was!r})")
    return changes


def embedded_model_name(seed: int, num_eval: int) -> str:
    """The embedded model is built from the problems that data.seed and data.num_eval hold out."""
    return f"embedded (data.seed = {seed}, data.num_eval = {num_eval})"


def load_config(path: str | None = None, overrides: list[str] = (), world_size: int = 1) -> Config:
    """Defaults (for a file that names no model, rlcore/default.toml's values), then the TOML file at
    `path` (None: none), then each `section.key=value` override.
    A layer that sets train.num_train_epochs without train.max_steps sets max_steps = -1 (count epochs).

    An override's value is read as a TOML literal (`0.04`, `true`, `["a", "b"]`), and as a bare
    string when it is not one (`model.path=/ckpt/qwen`); `none` sets an optional field to None.
    The result is checked with `validate(config, world_size)`.
    """
    d, raw = {}, b""
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read()
            d = tomllib.loads(raw.decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing TOML file "
                              f"(see configs/ for examples)") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory; pass a TOML file "
                              f"(see configs/ for examples)") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason}, byte "
                              f"{e.object[e.start:e.start + 1]!r} at offset {e.start}); save it as UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            if looks_like_yaml(path):
                raise ConfigError(f"config file {path} looks like YAML; rlcore reads TOML: write `key = value` "
                                  f"(learning_rate = 1e-6, strings quoted), TRL's flat names work as they "
                                  f"are ({e})") from None
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    empty = path is not None and not d
    trl_style = any(key not in SECTIONS for key in d)  # flat TRL keys: likely a recipe written for TRL
    d = normalize(d)
    in_file = {(section, key) for section, values in d.items() for key in values}
    layer = {}
    for item in overrides:
        section, key, value = parse_override(item)
        layer.setdefault(section, {})[key] = value
    base = None
    if path is not None and builds_on_embedded_default(path, raw, d, layer):
        with open(EMBEDDED_DEFAULT, "rb") as f:
            base = normalize(tomllib.load(f))
        train_file = d.get("train", {})
        if "num_train_epochs" in train_file and "max_steps" not in train_file:
            base["train"].pop("max_steps", None)  # the file counts epochs (as a layer of its own would)
        d = {section: {**base.get(section, {}), **d.get(section, {})} for section in {*base, *d}}
    if empty:
        warnings.warn(f"config file {path} sets nothing: the run is " + ("the embedded default (rlcore/default.toml)"
                      if base else "rlcore's defaults (rlcore options)") + " with the --set values",
                      RlcoreWarning, stacklevel=2)
    given = {(section, key) for section, values in layer.items() for key in values}
    _expand_trl_loss_type(layer)  # --set loss_type=cispo sets policy_loss too, over the file's
    for section, values in layer.items():
        d.setdefault(section, {}).update(values)
    if ("train", "num_train_epochs") in given and ("train", "max_steps") not in given:
        file_steps = d["train"].get("max_steps", -1) if ("train", "max_steps") in in_file else -1
        if file_steps != -1:  # TRL keeps a positive max_steps over num_train_epochs: say which one runs
            warnings.warn(f"--set train.num_train_epochs = {layer['train']['num_train_epochs']} replaces {path}'s "
                          f"train.max_steps = {file_steps} (the run counts epochs; in TRL a positive max_steps would "
                          f"win): add --set train.max_steps={file_steps} to keep it", RlcoreWarning, stacklevel=2)
        d["train"]["max_steps"] = -1  # the overrides mean the epochs, whatever the file's max_steps
    config = Config.from_dict(d)
    config.base = None if base is None else str(EMBEDDED_DEFAULT)  # not a field: the CLI says what it ran
    validate(config, world_size)
    if trl_style and base is None:  # (a file on the embedded default tunes rlcore's own run)
        warn_trl_defaults(config, path, in_file | given)
    return config


def warn_trl_defaults(config: Config, path: str, given: set[tuple[str, str]]) -> None:
    """Warn about the options of `trl_options.TRL_DEFAULTS` that a file written in TRL's flat keys
    that names a model (`path`) and the overrides (`given`, with the file's) leave to rlcore's
    default, which is not TRL's: such a file trains as TRL would only with them set."""
    unset = [f"{key} = {value!r} (TRL: {trl!r})" for (section, key), trl in trl_options.TRL_DEFAULTS.items()
             if (section, key) not in given and (value := getattr(getattr(config, section), key)) != trl
             and (key != "use_bias_correction_kl" or config.loss.beta != 0)]
    if unset:
        warnings.warn(f"config file {path} is written in TRL's flat keys but leaves options unset whose value "
                      f"here is not TRL's default: {', '.join(unset)}; set them in the file to train as TRL would "
                      "(README, 'Defaults that differ from TRL 1.16's')", RlcoreWarning, stacklevel=3)


def builds_on_embedded_default(path: str, raw: bytes, file: dict, overrides: dict) -> bool:
    """Whether the config file at `path` (`raw` its bytes, `file` them read and normalized,
    `overrides` the --set layer) takes its unset keys from the embedded default: it names no model,
    so it trains the embedded tiny model, which TRL's defaults do not fit (512 new tokens, lr 1e-6,
    another held-out set and so another embedded model). A run's own config.toml is complete and
    is read as it is."""
    if Path(path).resolve() == EMBEDDED_DEFAULT.resolve() or raw.startswith(RUN_CONFIG_HEADER.encode()):
        return False
    model_path = overrides.get("model", {}).get("path", file.get("model", {}).get("path", ""))
    return model_path in EMBEDDED_MODEL_PATHS


def overridden(overrides: list[str], option: str):
    """The value the `--set` values give `option` ("section.key"; the last one wins), or None."""
    values = [value for section, key, value in map(parse_override, overrides) if f"{section}.{key}" == option]
    return values[-1] if values else None


def model_in_overrides(overrides: list[str]) -> str:
    """The model.path the `--set` values give, or "" when none names a model ("embedded" names
    the embedded one, as "" does)."""
    path = overridden(overrides, "model.path")
    return "" if path is None or str(path) in EMBEDDED_MODEL_PATHS else str(path)


def looks_like_yaml(path: str) -> bool:
    """A .yaml/.yml name, or a first setting written `key: value` (TRL's and verl's recipe files)."""
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(lines) and re.match(r"^\s*[\w.-]+:(\s|$)", lines[0]) is not None


def _toml_literal(raw: str, default=None):
    """`raw` read as a TOML value (`0.04`, `true`, `["a"]`, `{k = 1}`), or `default` when it is not one."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return default


def _shell_set(assignment: str) -> str:
    """`--set key=value` as a shell takes it: quoted when the value holds quotes, brackets or spaces."""
    return f"--set '{assignment}'" if any(c in assignment for c in "[]{}\"' ") else f"--set {assignment}"


def parse_override(item: str) -> tuple[str, str, object]:
    """`"loss.beta=0.04"` -> `("loss", "beta", 0.04)`; a flat TRL key (`"beta=0.04"`) finds its section."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not section.key=value; write e.g. --set loss.beta=0.04")
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in SECTIONS:
        table = _toml_literal(raw)
        first = _field_names(SECTIONS[parts[0]])[0]
        sets = ([_shell_set(f"{parts[0]}.{k}={_toml_value(v)}") for k, v in table.items()]
                if isinstance(table, dict) and table else [f"--set {parts[0]}.{first}=..."])
        raise ConfigError(f"--set {item}: {parts[0]} is a section; set one key at a time: " + " ".join(sets))
    if len(parts) == 1:
        section, name = _flat_target(parts[0])
    elif len(parts) == 2:
        section, name = parts
        if section not in SECTIONS:
            raise _unknown_section(section)
    elif parts[0] in SECTIONS and typing.get_origin(typing.get_type_hints(SECTIONS[parts[0]]).get(parts[1])) is dict:
        inner = {".".join(parts[2:]): _toml_literal(raw, default=raw.strip())}
        raise ConfigError(f"--set {item}: {parts[0]}.{parts[1]} is a table; give it whole: "
                          + _shell_set(f"{parts[0]}.{parts[1]}={_toml_value(inner)}"))
    elif text := trl_options.foreign(key):
        raise ConfigError(f"unknown config key {key}: {text}")
    else:
        raise ConfigError(f"override key {key!r} has too many dots; write section.key=value, "
                          f"e.g. --set loss.beta=0.04")
    raw = raw.strip()
    value = _toml_literal(raw, default=raw)
    hint = typing.get_type_hints(SECTIONS[section]).get(name)
    if isinstance(value, str) and value.startswith("[") and value.endswith("]") and hint is not None \
            and _accepts(hint, list) and not _accepts(hint, str):
        value = [w.strip() for w in value[1:-1].split(",") if w.strip()]  # the shell ate the quotes: [a,b]
    if hint is not None and not isinstance(value, str) and _accepts(hint, str) and not _accepts(hint, type(value)):
        value = raw  # `data.system_prompt=42` means the text "42"
    return section, name, value


def normalize(d: dict) -> dict:
    """`{section: {key: value}}` from a TOML dict, moving flat TRL keys (`beta = 0.04`) into their section."""
    out = {}
    flat = {}
    for key, value in d.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"config section {key} = {value!r} must be a table; write "
                                  f"[{key}] and its keys under it, or {key}.<key> = value")
            out.setdefault(key, {}).update(value)
        elif isinstance(value, dict) and not _owners(key) and trl_options.explain(key, value) is None:
            raise _unknown_section(key)
        else:
            flat[key] = value
    for key, value in flat.items():
        section, name = _flat_target(key)
        if name in out.get(section, {}) and out[section][name] != value:  # equal: transformers 5 mirrors some
            raise ConfigError(f"config key {key} is set twice: flat ({key} = {value!r}) and in "
                              f"[{section}] ({name} = {out[section][name]!r}); keep one")
        out.setdefault(section, {})[name] = value
    _expand_trl_tables(out)
    _expand_trl_loss_type(out)
    return out


def _expand_trl_loss_type(layer: dict) -> None:
    """TRL's loss_type = 'cispo' / 'sapo' / 'vespo' names a policy loss and, implicitly, TRL's
    aggregation of it: one config layer (a file, or the --set overrides) that gives it sets
    loss.policy_loss and loss.loss_type, as TRL would compute that loss."""
    loss = layer.get("loss", {})
    name = loss.get("loss_type")
    if not isinstance(name, str) or name not in trl_options.LOSS_TYPES:
        return
    policy, aggregation = trl_options.LOSS_TYPES[name]
    if loss.get("policy_loss", policy) != policy:
        raise ConfigError(f"loss.loss_type = {name!r} (TRL's name for loss.policy_loss = {policy!r} with "
                          f"loss.loss_type = {aggregation!r}) and loss.policy_loss = {loss['policy_loss']!r} "
                          f"disagree; keep one")
    loss["policy_loss"], loss["loss_type"] = policy, aggregation


def _expand_trl_tables(out: dict) -> None:
    """TRL's generation_kwargs (sampling settings, which win over the named options, as in TRL) and
    model_init_kwargs (how from_pretrained loads the policy) become the rlcore options they set."""
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
            out[section]["generation_kwargs"] = kwargs  # not a table: Config.from_dict names the problem
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


GENERATION_KWARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_completion_length",
                     "max_tokens": "max_completion_length", "stop_strings": "stop", "stop": "stop"}
"""generation_kwargs keys (transformers' GenerationConfig and vLLM's SamplingParams names) -> rollout fields."""


def _flat_target(key: str) -> tuple[str, str]:
    """The (section, field) a top-level TRL-style key belongs to."""
    if key in FLAT_ALIASES:
        return FLAT_ALIASES[key]
    if key in trl_options.TRL_ONLY or key.startswith("vllm_"):
        return "train", key  # TRL's, without an rlcore field: Config.from_dict explains it there
    owners = _owners(key)
    if len(owners) == 1:
        return owners[0], key
    if len(owners) > 1:
        raise ConfigError(f"config key {key} is in sections {', '.join(owners)}; write it as "
                          f"{owners[0]}.{key} (or under [{owners[0]}])")
    raise ConfigError(f"unknown config key {key}{_suggest(key)}")


def _unknown_section(name: str) -> ConfigError:
    if text := trl_options.foreign(name):
        return ConfigError(f"unknown config section [{name}]: {text}")
    close = difflib.get_close_matches(name, SECTIONS, n=1)
    hint = f"did you mean [{close[0]}]? " if close else ""
    return ConfigError(f"unknown config section [{name}]; {hint}sections are {', '.join(SECTIONS)}")


def _owners(key: str) -> list[str]:
    """The sections that have a field named `key`."""
    return [name for name, cls in SECTIONS.items() if key in _field_names(cls)]


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _suggest(key: str) -> str:
    """"; did you mean X?" for an unknown `key` ("section.name" or a flat name), or a pointer to the docs."""
    if text := trl_options.foreign(key):
        return f": {text}"
    section, _, name = key.rpartition(".")
    owners = _owners(name)
    if not owners:
        if section in SECTIONS:
            close = difflib.get_close_matches(name, _field_names(SECTIONS[section]), n=1)
            owners = [section] if close else []
        else:
            close = difflib.get_close_matches(name, [n for c in SECTIONS.values() for n in _field_names(c)], n=1)
            owners = _owners(close[0]) if close else []
        name = close[0] if close else name
    if not owners:
        return "; `rlcore options` lists every option"
    return "; did you mean " + " or ".join(f"{s}.{name}" for s in owners) + "?"


# ---- types ----

def _accepts(tp, value_type: type) -> bool:
    """Whether a value of `value_type` can be stored in a field annotated `tp` (choices aside)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value_type) for a in args)
    if origin is Literal:
        return any(type(a) is value_type for a in args)
    if origin is list:
        return value_type is list
    if origin is dict:
        return value_type is dict
    if tp is float:
        return value_type in (int, float)
    return tp is value_type


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s"
    if origin is dict:
        return "a table of names to strings, numbers or bools"
    return {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}[tp]


def _check_type(key: str, value, tp):
    """`value` converted for a field annotated `tp` (int -> float, "none" -> None), or ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    union = origin in (typing.Union, types.UnionType)
    if union and type(None) in args and (value is None or str(value).lower() in ("none", "null")):
        return None
    base = [a for a in args if a is not type(None)] if union else [tp]
    for t in base:
        ok, converted = _convert(value, t)
        if ok:
            return converted
    for t in base:
        if typing.get_origin(t) is Literal and any(type(a) is type(value) for a in typing.get_args(t)):
            choices = typing.get_args(t)
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            if key == "train.device" and str(value).lower().startswith("gpu"):
                close = ["cuda"]  # torch's name for the GPU; difflib would suggest 'cpu'
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if key == "loss.loss_type" and value in typing.get_args(typing.get_type_hints(LossArgs)["policy_loss"]):
                hint = f"; {value!r} is a policy loss: set loss.policy_loss = {value!r} (loss_type aggregates it)"
            if key == "loss.loss_type" and str(value).lower() == "gspo":
                hint = ("; GSPO is a sequence-level ratio, not an aggregation: set loss.importance_sampling_level = "
                        "'sequence' with loss.loss_type = 'grpo' (TRL's GSPO recipe)")
            also = ", or true / false" if bool in base else ""
            raise ConfigError(f"{key} = {value!r} is not a valid choice; valid: "
                              f"{', '.join(repr(c) for c in choices)}{also}{hint}")
    quoted, literal = "", _toml_literal(value) if isinstance(value, str) else None
    if literal is not None and _convert(literal, tp)[0]:
        quoted = f" (in quotes, {value} is a string in TOML: write {key.split('.')[-1]} = {value})"
    elif isinstance(value, str) and _accepts(tp, float) and (number := _python_float(value)) is not None:
        quoted = (f" (TOML writes a number with a digit on each side of the point: "
                  f"{key.split('.')[-1]} = {number!r})")  # .9 and 1. are Python's, not TOML's
    raise ConfigError(f"{key} = {value!r} has type {type(value).__name__}, expected "
                      f"{_describe(tp)}{quoted}; e.g. {_shell_set(f'{key}={_example(tp, key)}')}")


def _python_float(text: str) -> float | None:
    """`text` as Python reads a finite float (".9", "1."), or None."""
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _convert(value, tp) -> tuple[bool, object]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return any(type(a) is type(value) and a == value for a in args), value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_convert(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        scalar = (str, int, float, bool)
        return isinstance(value, dict) and all(type(v) in scalar for v in value.values()), value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    return type(value) is tp, value


def _example(tp, key: str = "") -> str:
    """A value for a field annotated `tp`: the default of option `key` ("section.name") when it has
    one of that type (a learning rate's example is its default, not 0.5), else a placeholder."""
    section, _, name = key.partition(".")
    default = next((f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == name), None) \
        if section in SECTIONS else None
    if default not in (None, dataclasses.MISSING, "") and not isinstance(default, bool) and _convert(default, tp)[0]:
        return _toml_value(default) if not isinstance(default, str) else default
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _example(args[0])
    if origin is Literal:
        return str(args[0])
    if origin is list:
        return "[" + _example(args[0]) + "]" if args[0] is not str else '["a","b"]'
    if origin is dict:
        return "{enable_thinking=false}"
    return {int: "1", float: "0.5", str: "text", bool: "true"}[tp]


# ---- documentation ----

def field_docs(cls: type) -> dict[str, str]:
    """`{field: docstring}` for a dataclass whose fields each have a string literal on the next line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


def options_table() -> str:
    """A Markdown table of every option: key, type, default, description (for the README)."""
    rows = ["| option | type | default | description |", "|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            typ = _describe(hints[f.name]).replace("|", "\\|")
            rows.append(f"| `{section}.{f.name}` | {typ} | `{default!r}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)
