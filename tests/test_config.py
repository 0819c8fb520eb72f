"""The config: SPEC section 7 defaults, TOML and --set precedence, TRL flat keys, and errors that
name the key, the value and the fix."""

import dataclasses
import math
import re
import sys
import typing
import warnings
from pathlib import Path

import pytest

from rlcore import EMBEDDED_DEFAULT, RlcoreWarning
from rlcore.config.load import RUN_CONFIG_HEADER
from rlcore import ConfigError
from rlcore.config.load import config_from_dict, config_to_dict, dump_config, load_config, on_embedded_default, parse_override
from rlcore.config.options import Config
from rlcore.config.options import SECTIONS, field_docs
from rlcore.config.values import options_table
from rlcore.config.validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


# ---- defaults ----

def test_defaults_are_spec_section_7():
    c = Config()
    assert c.loss.loss_type == "dapo"
    assert c.loss.beta == 0.0
    assert c.loss.epsilon == 0.2
    assert c.loss.epsilon_high == c.loss.epsilon
    assert c.loss.delta is None
    assert c.loss.importance_sampling_level == "token"
    assert c.loss.scale_rewards == "group"
    assert c.loss.mask_truncated_completions is False
    assert c.loss.num_iterations == 1
    assert c.train.steps_per_generation == c.train.gradient_accumulation_steps
    assert c.loss.top_entropy_quantile == 1.0
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k, c.rollout.min_p) == (1.0, 1.0, 0, 0.0)
    assert c.rollout.repetition_penalty == 1.0
    assert c.rollout.num_generations == 8
    assert c.rollout.max_completion_length == 512


# rlcore's defaults that differ from TRL 1.16's GRPOConfig: docs/trl.md's table "Defaults that differ
# from TRL 1.16's" (bf16: TRL's None becomes True), or rlcore sections' own meaning of a shared name
DIFFERENT_FROM_TRL = {"train.max_steps", "train.lr_scheduler_type", "train.bf16", "train.gradient_checkpointing",
                      "train.logging_steps", "train.save_steps", "train.save_total_limit", "train.eval_steps",
                      "train.output_dir", "loss.use_bias_correction_kl",
                      "data.seed",      # the held-out split's seed; TRL's seed is train.seed (its 42)
                      "rollout.seed"}   # None = train.seed, as TRL samples with its seed
# the same default written two ways (no filter, no extra arguments)
SAME_AS_NONE = {"rollout.min_p": 0.0, "data.chat_template_kwargs": {}, "train.lr_scheduler_kwargs": {},
                "train.fsdp": False}


def test_every_default_of_an_option_trl_also_has_is_trls_unless_the_readme_lists_it():
    """Each rlcore option named as a TRL 1.16 GRPOConfig field has that field's default, except the
    listed ones; a TRL release that changes a default fails here (update README's table)."""
    trl = pytest.importorskip("trl", reason="TRL is the reference")

    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    theirs = {f.name: default(f) for f in dataclasses.fields(trl.GRPOConfig)}
    config, shared = Config(), {}
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section.name)):
            if f.name in theirs:
                shared[f"{section.name}.{f.name}"] = (default(f), theirs[f.name])
    assert len(shared) > 50 and DIFFERENT_FROM_TRL | set(SAME_AS_NONE) <= set(shared)
    differ = {key for key, (ours, trls) in shared.items()
              if ours != trls and not (key in SAME_AS_NONE and trls is None and ours == SAME_AS_NONE[key])}
    assert differ == DIFFERENT_FROM_TRL, {key: shared[key] for key in differ ^ DIFFERENT_FROM_TRL}
    assert theirs["warmup_steps"] == 0 and "warmup_ratio" not in theirs  # transformers 5: warmup_steps < 1 is a ratio


def test_defaults_pass_validation():
    validate(Config())


def test_steps_per_generation_defaults_to_gradient_accumulation_steps():
    c = load_config(None, ["train.gradient_accumulation_steps=4"])
    assert c.train.steps_per_generation == 4


def test_generation_batch_size_sets_steps_per_generation_for_the_world_size():
    """TRL's rule: steps_per_generation = generation_batch_size / (per_device_train_batch_size * ranks)."""
    from rlcore.config.geometry import generation_steps

    base = ["train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=2", "rollout.num_generations=4"]
    c = load_config(None, [*base, "generation_batch_size=32"])
    assert c.train.steps_per_generation is None and generation_steps(c.train, 1) == 4
    assert generation_steps(load_config(None, [*base, "generation_batch_size=32"], world_size=2).train, 2) == 2
    assert generation_steps(load_config(None, base).train, 1) == 2  # unset: GA
    with pytest.raises(ConfigError, match=r"train\.generation_batch_size = 20 must be a positive multiple of "
                                          r"per_device_train_batch_size \* world size = 8 \* 1 = 8; set it to 16 "
                                          r"or 24, or leave it unset \(= 16"):
        load_config(None, [*base, "generation_batch_size=20"])
    with pytest.raises(ConfigError, match=r"train\.generation_batch_size = 24 gives steps_per_generation = 24 / "
                                          r"\(8 \* 1\) = 3, which is not a multiple of .*set generation_batch_size "
                                          r"to 16 or 32, or leave it unset"):
        load_config(None, [*base, "generation_batch_size=24"])
    with pytest.raises(ConfigError, match=r"generation_batch_size = 32 and train\.steps_per_generation = 4 are both set"):
        load_config(None, [*base, "generation_batch_size=32", "steps_per_generation=4"])


def test_num_train_epochs_without_max_steps_means_count_the_epochs(tmp_path):
    """TRL's max_steps defaults to -1 (train num_train_epochs passes); rlcore's to 100. A layer that
    gives num_train_epochs and no max_steps means the epochs; max_steps given as well wins (as in TRL)."""
    t = load_config(write(tmp_path, "num_train_epochs = 2\n"), []).train
    assert (t.max_steps, t.num_train_epochs) == (-1, 2.0)
    t = load_config(write(tmp_path, "num_train_epochs = 2\nmax_steps = 10\n"), []).train
    assert t.max_steps == 10
    path = write(tmp_path, "max_steps = 50\n")
    with pytest.warns(RlcoreWarning, match=rf"--set train\.num_train_epochs = 1 replaces {re.escape(path)}'s "
                                          r"train\.max_steps = 50 \(the run counts epochs; in TRL a positive "
                                          r"max_steps would win\): add --set train\.max_steps=50 to keep it"):
        t = load_config(path, ["num_train_epochs=1"]).train  # the later layer
    assert (t.max_steps, t.num_train_epochs) == (-1, 1.0)
    t = load_config(None, ["train.max_steps=7", "num_train_epochs=1"]).train
    assert t.max_steps == 7
    assert load_config(None, ["max_steps=-1"]).train.num_train_epochs == 3.0  # TRL's default


def test_epoch_steps_counts_whole_rounds_as_trl_does():
    from rlcore.config.geometry import epoch_steps

    assert epoch_steps(256, 4, 1, 1.0) == 64
    assert epoch_steps(21, 2, 2, 1.5) == 30    # 10 whole rounds (the 21st prompt is dropped), 2 steps each
    assert epoch_steps(21, 2, 2, 0.01) == 1
    with pytest.raises(ConfigError, match=r"the 3 training prompts are fewer than one round's 4"):
        epoch_steps(3, 4, 1, 1.0)


def test_generation_kwargs_set_the_rollout_options_they_name_and_win_over_them(tmp_path):
    toml = "temperature = 0.7\ngeneration_kwargs = {temperature = 0.9, top_k = 20, max_new_tokens = 64, stop_strings = ['###']}\n"
    r = load_config(write(tmp_path, toml), []).rollout
    assert (r.temperature, r.top_k, r.max_completion_length, r.stop) == (0.9, 20, 64, ["###"])  # TRL: they override
    r = load_config(None, ["generation_kwargs={repetition_penalty = 1.2, min_p = 0.1}"]).rollout
    assert (r.repetition_penalty, r.min_p) == (1.2, 0.1)


def test_model_init_kwargs_dtype_sets_model_dtype():
    with pytest.warns(UserWarning, match="no fp32 master copy"):
        assert load_config(None, ["model_init_kwargs={torch_dtype = 'bfloat16'}"]).model.dtype == "bfloat16"
    assert load_config(None, ["model_init_kwargs={dtype = 'float32'}"]).model.dtype == "float32"


def test_epsilon_high_defaults_to_epsilon():
    assert load_config(None, ["loss.epsilon=0.3"]).loss.epsilon_high == 0.3


def test_rollout_seed_and_eval_length_default_to_their_train_and_rollout_values():
    c = load_config(None, ["train.seed=7", "rollout.max_completion_length=64"])
    assert c.rollout.seed == 7
    assert c.train.eval_max_completion_length == 64


def test_every_field_has_a_docstring():
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{name}] fields without a docstring: {missing}"


def test_options_table_lists_every_field_with_its_doc():
    table = options_table()
    assert "| `loss.beta` | a float | `0.0` | KL coefficient" in table
    assert table.count("\n") + 1 == 2 + sum(len(dataclasses.fields(c)) for c in SECTIONS.values())


# ---- TOML, --set, flat keys ----

def test_toml_file_overrides_defaults(tmp_path):
    c = load_config(write(tmp_path, "[loss]\nbeta = 0.04\n[rollout]\nnum_generations = 4\n"), [])
    assert c.loss.beta == 0.04
    assert c.rollout.num_generations == 4
    assert c.loss.epsilon == 0.2


def test_set_overrides_toml_file(tmp_path):
    c = load_config(write(tmp_path, "[loss]\nbeta = 0.04\n"), ["loss.beta=0.1"])
    assert c.loss.beta == 0.1


@pytest.mark.parametrize("item, section, key, value", [
    ("loss.beta=0.04", "loss", "beta", 0.04),
    ("train.max_steps=20", "train", "max_steps", 20),
    ("loss.mask_truncated_completions=true", "loss", "mask_truncated_completions", True),
    ('loss.reward_funcs=["accuracy", "format"]', "loss", "reward_funcs", ["accuracy", "format"]),
    ("model.path=/ckpt/qwen-0.5b", "model", "path", "/ckpt/qwen-0.5b"),
    ("data.system_prompt=Answer briefly.", "data", "system_prompt", "Answer briefly."),
    ("data.system_prompt=42", "data", "system_prompt", "42"),
    ("beta=0.04", "loss", "beta", 0.04),
])
def test_set_value_is_parsed_as_toml_literal_else_string(item, section, key, value):
    assert parse_override(item) == (section, key, value)


def test_set_int_is_accepted_for_float_field():
    c = load_config(None, ["loss.beta=1"])
    assert c.loss.beta == 1.0 and isinstance(c.loss.beta, float)


def test_set_none_clears_optional_field():
    c = load_config(None, ["loss.delta=2.0"])
    assert c.loss.delta == 2.0
    assert load_config(None, ["loss.delta=none"]).loss.delta is None


def test_trl_flat_keys_go_to_their_section(tmp_path):
    c = load_config(write(tmp_path, "beta = 0.04\nnum_iterations = 2\nnum_generations = 4\n"
                                    "learning_rate = 3e-6\nseed = 3\n"), [])
    assert c.loss.beta == 0.04
    assert c.loss.num_iterations == 2
    assert c.rollout.num_generations == 4
    assert c.train.learning_rate == 3e-6
    assert c.train.seed == 3


@pytest.mark.parametrize("lines, unset", [
    ("beta = 0.04\n", "lr_scheduler_type = 'constant' (TRL: 'linear'), bf16 = False (TRL: True), "
                      "use_bias_correction_kl = False (TRL: True)"),
    ("beta = 0.0\nbf16 = true\n", "lr_scheduler_type = 'constant' (TRL: 'linear')"),  # no KL term: no KL option
    ("beta = 0.04\nbf16 = true\nlr_scheduler_type = 'linear'\nuse_bias_correction_kl = false\n", None),
    ("[loss]\nbeta = 0.04\n", None),  # rlcore's own sections: not a TRL recipe
])
def test_a_trl_style_file_is_told_which_unset_options_differ_from_trls_defaults(tmp_path, lines, unset):
    path = write(tmp_path, 'model.path = "ckpt/qwen"\n' + lines)  # names a model: not the embedded run's values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(path, [])
    said = [str(w.message) for w in caught if "TRL's flat keys" in str(w.message)]
    assert said == ([] if unset is None else [f"config file {path} is written in TRL's flat keys but leaves options "
                                               f"unset whose value here is not TRL's default: {unset}; set them in "
                                               f"the file to train as TRL would (docs/trl.md, 'Defaults that differ from "
                                               f"TRL 1.16's')"])
    with warnings.catch_warnings(record=True) as caught:  # set on the command line counts as set
        warnings.simplefilter("always")
        load_config(path, ["bf16=true", "lr_scheduler_type=linear", "use_bias_correction_kl=true"])
        load_config(write(tmp_path, lines), [])  # no model: a file that tunes the embedded default run
    assert not [w for w in caught if "TRL's flat keys" in str(w.message)]


TRL_CONFIG = """
# a TRL GRPOConfig written for TRL, as it is
output_dir = "OUT"
learning_rate = 1e-6
lr_scheduler_type = "linear"
warmup_steps = 0.1
weight_decay = 0.1
bf16 = true
gradient_checkpointing = true
gradient_checkpointing_kwargs = {use_reentrant = false}
optim = "adamw_torch_fused"
save_total_limit = 3
report_to = "none"
logging_steps = 1
use_vllm = false
vllm_mode = "colocate"
vllm_gpu_memory_utilization = 0.3
disable_dropout = true
log_completions = false
repetition_penalty = 1.1
num_generations = 4
beta = 0.0
loss_type = "dapo"
"""


def test_a_trl_config_loads_and_says_what_it_ignores(tmp_path):
    with pytest.warns(UserWarning) as caught:
        c = load_config(write(tmp_path, TRL_CONFIG.replace("OUT", str(tmp_path / "out"))), [])
    t = c.train
    assert (t.lr_scheduler_type, t.warmup_ratio, t.warmup_steps) == ("linear", 0.1, 0)  # transformers 5's ratio form
    assert (t.weight_decay, t.bf16, t.gradient_checkpointing, t.save_total_limit) == (0.1, True, True, 3)
    assert (c.rollout.num_generations, c.rollout.repetition_penalty) == (4, 1.1)
    said = " | ".join(str(w.message) for w in caught)
    for key in ("gradient_checkpointing_kwargs", "optim", "use_vllm", "vllm_mode",
                "vllm_gpu_memory_utilization", "disable_dropout"):
        assert f"TRL's {key} = " in said and "is ignored" in said, key
    assert t.report_to == "none"


@pytest.mark.parametrize("line, fix", [
    ("use_vllm = true", r"use_vllm = True is not an rlcore option: rlcore generates with its own engine"),
    ("fp16_full_eval = true", r"fp16_full_eval = True is not an rlcore option: rlcore evaluates under the training"),
    ("model_init_kwargs = {device_map = 'auto'}", r"model_init_kwargs key 'device_map' \(= 'auto'\) has no rlcore "
                                                 r"equivalent; rlcore takes dtype \(or torch_dtype\), as model\.dtype"),
    ("model_init_kwargs = {torch_dtype = 'float16'}", r"model\.dtype = 'float16' is not a valid choice"),
    ("generation_kwargs = {num_beams = 3}", r"generation_kwargs key 'num_beams' \(= 3\) has no rlcore equivalent; "
                                            r"rlcore's rollout takes temperature, top_p"),
    ("[train]\nuse_cpu = true", r"set train\.device = 'cpu'"),
    ("loss_type = 'cispo'\npolicy_loss = 'sapo'", r"loss\.loss_type = 'cispo' \(TRL's name for loss\.policy_loss = "
                                                  r"'cispo' with loss\.loss_type = 'dapo'\) and loss\.policy_loss = "
                                                  r"'sapo' disagree"),
    ("max_steps = 0", r"max_steps = 0 must be >= 1, or -1 to train for train\.num_train_epochs"),
    ("max_steps = -1\nnum_train_epochs = 0", r"train\.num_train_epochs = 0\.0 must be > 0"),
    ("warmup_steps = 0.1\nwarmup_ratio = 0.2", r"warmup_steps = 0\.1 \(a ratio.*warmup_ratio = 0\.2 are both set"),
    # the rest of transformers' TrainingArguments
    ("average_tokens_across_devices = false", r"dapo always counts the tokens of all ranks; leave it out or set it to True"),
    ("neftune_noise_alpha = 5.0", r"no NEFTune noise"),
    ("load_best_model_at_end = true", r"eval\.jsonl"),
    ("use_transformers_paged = true", r"own engine"),
])
def test_a_trl_option_rlcore_cannot_honour_is_an_error_naming_what_to_set(line, fix, tmp_path):
    with pytest.raises(ConfigError, match=fix):
        load_config(write(tmp_path, line + "\n"), [])


@pytest.mark.parametrize("name, policy, aggregation", [("cispo", "cispo", "dapo"), ("sapo", "sapo", "grpo"),
                                                       ("vespo", "vespo", "dapo")])
def test_trls_policy_loss_types_set_the_policy_loss_and_trls_aggregation_of_it(name, policy, aggregation, tmp_path):
    """TRL's loss_type names cispo/sapo/vespo a loss and aggregates each one way (its _compute_loss);
    one config layer that gives it sets both rlcore options, over an earlier layer's."""
    for where in (f"loss_type = '{name}'\n", f"[loss]\nloss_type = '{name}'\n"):
        lo = load_config(write(tmp_path, where + "epsilon_high = 5.0\n" * (name == "cispo")), []).loss
        assert (lo.policy_loss, lo.loss_type) == (policy, aggregation), where
    lo = load_config(write(tmp_path, "[loss]\npolicy_loss = 'ppo'\nloss_type = 'bnpo'\n"),
                     [f"loss_type={name}", "epsilon_high=5.0"]).loss
    assert (lo.policy_loss, lo.loss_type) == (policy, aggregation)
    lo = load_config(write(tmp_path, f"loss_type = '{name}'\nepsilon_high = 5.0\n"), ["loss.loss_type=bnpo"]).loss
    assert (lo.policy_loss, lo.loss_type) == (policy, "bnpo")  # a later layer's aggregation wins
    assert load_config(write(tmp_path, f"loss_type = '{name}'\npolicy_loss = '{policy}'\nepsilon_high = 5.0\n"),
                       []).loss.policy_loss == policy  # agreeing is fine


def test_every_option_of_trl_grpo_config_is_an_rlcore_option_or_explained():
    """TRL 1.16's GRPOConfig (with transformers' TrainingArguments) as the reference: no name of it
    is an "unknown config key" in rlcore."""
    trl = pytest.importorskip("trl", reason="TRL is the reference")
    from rlcore.config import trl_names
    from rlcore.config.options import sections_with
    from rlcore.config.trl_names import FLAT_ALIASES

    names = [f.name for f in dataclasses.fields(trl.GRPOConfig)]
    assert len(names) > 150
    unknown = [n for n in names if not (sections_with(n) or n in FLAT_ALIASES or trl_names.explain(n, None) is not None)]
    assert unknown == []


@pytest.mark.parametrize("line, said", [
    ("trust_remote_code = true", "rlcore runs its own Llama / Qwen2 / Qwen3 code"),
    ("dataloader_num_workers = 4\ndataloader_pin_memory = true", "reads its prompts in the training process"),
    ("hub_strategy = 'checkpoint'", "cannot reach a model hub"),
    ("torch_compile = true", "rlcore runs eager"),  # speed settings
    ("tf32 = true", "rlcore leaves fp32 matmuls at full precision"),
    ("use_liger_kernel = true", "the memory Liger's fused loss saves"),
    ("model_init_kwargs = {attn_implementation = 'flash_attention_2'}", "attends with torch's SDPA"),
    ("vllm_importance_sampling_correction = true", r"only with use_vllm = true.*loss\.tis_mode"),  # TRL's default
])
def test_trl_training_arguments_that_change_nothing_are_dropped_with_a_warning(line, said, tmp_path):
    with pytest.warns(UserWarning, match=said):
        load_config(write(tmp_path, line + "\n"), [])


def test_transformers_5_mirrored_checkpointing_keys_load_and_a_conflict_is_named(tmp_path):
    """transformers 5 writes gradient_checkpointing and activation_checkpointing with one value."""
    both = "gradient_checkpointing = true\nactivation_checkpointing = true\n"
    assert load_config(write(tmp_path, both), []).train.gradient_checkpointing
    assert load_config(write(tmp_path, "[train]\n" + both), []).train.gradient_checkpointing
    with pytest.raises(ConfigError, match=r"train\.gradient_checkpointing is set twice, to True and False"):
        load_config(write(tmp_path, "[train]\ngradient_checkpointing = true\nactivation_checkpointing = false\n"), [])


def test_trl_options_work_from_the_command_line_too():
    with pytest.warns(UserWarning, match="TRL's disable_tqdm = True is ignored"):
        c = load_config(None, ["report_to=wandb", "disable_tqdm=true", "activation_checkpointing=true"])
    assert c.train.gradient_checkpointing and c.train.report_to == "wandb"
    with pytest.raises(ConfigError, match="use_vllm = True is not an rlcore option"):
        load_config(None, ["train.use_vllm=true"])


def test_the_trl_table_names_only_trl_options_rlcore_lacks():
    """Every name in it is a field of TRL's GRPOConfig (a typo there would never match), and none
    is an rlcore field (it would never be consulted)."""
    trl = pytest.importorskip("trl")
    from rlcore.config.trl_names import LOSS_TYPES, TRL_ONLY

    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    assert set(TRL_ONLY) <= theirs, set(TRL_ONLY) - theirs
    assert not set(TRL_ONLY) & ours
    loss_types = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}["loss_type"].metadata["help"]
    assert all(f"'{name}'" in loss_types for name in LOSS_TYPES)


def test_scale_rewards_bool_is_normalised():
    assert load_config(None, ["loss.scale_rewards=true"]).loss.scale_rewards == "group"
    assert load_config(None, ["loss.scale_rewards=false"]).loss.scale_rewards == "none"


def test_dict_round_trip():
    c = load_config(None, ["loss.beta=0.04", "loss.delta=1.5", "rollout.stop=['\\n']"])
    assert config_from_dict(config_to_dict(c)) == c


def test_dump_config_reads_back_equal(tmp_path):
    c = load_config(None, ["loss.beta=0.04", 'data.system_prompt=say "hi"\\n', "loss.reward_weights=[1, 0.5]",
                           'loss.reward_funcs=["accuracy", "format"]',
                           'data.chat_template_kwargs={enable_thinking=false, "a key"="x", n=2}',
                           "train.save_total_limit=none"])  # None where the default is not
    assert c.data.chat_template_kwargs == {"enable_thinking": False, "a key": "x", "n": 2}
    assert load_config(write(tmp_path, dump_config(c)), []) == c


def test_chat_template_kwargs_as_a_toml_table_inline_or_nested(tmp_path):
    inline = load_config(write(tmp_path, "[data]\nchat_template_kwargs = {enable_thinking = false}\n"), [])
    nested = load_config(write(tmp_path, "[data.chat_template_kwargs]\nenable_thinking = false\n"), [])
    flat = load_config(write(tmp_path, "chat_template_kwargs = {enable_thinking = false}\n"), [])  # TRL's place
    assert inline.data.chat_template_kwargs == nested.data.chat_template_kwargs == flat.data.chat_template_kwargs \
        == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"chat_template_kwargs = \{'a': \[1\]\} has type dict, expected a table"):
        load_config(None, ["data.chat_template_kwargs={a=[1]}"])


@pytest.mark.parametrize("name", ["default.toml", "qwen2.5-0.5b-gsm8k.toml", "dapo.toml", "smollm2-arithmetic.toml"])
def test_shipped_configs_load_and_validate(name):
    c = load_config(str(CONFIGS / name), ["data.path=train.jsonl"] if "gsm8k" in name else [])
    validate(c)


def test_default_toml_is_the_tiny_cpu_arithmetic_run():
    c = load_config(str(CONFIGS / "default.toml"), [])
    assert (c.model.path, c.data.task, c.train.device) == ("", "arithmetic", "cpu")


# ---- errors name the key, the value and the fix ----

def test_unknown_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"loss\.bta.*did you mean loss\.beta"):
        load_config(write(tmp_path, "[loss]\nbta = 0.1\n"), [])


def test_key_in_wrong_section_suggests_right_section():
    with pytest.raises(ConfigError, match=r"loss\.temperature.*did you mean rollout\.temperature"):
        load_config(None, ["loss.temperature=0.7"])


def test_unknown_flat_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"num_generation\b.*did you mean rollout\.num_generations"):
        load_config(write(tmp_path, "num_generation = 4\n"), [])


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match=r"\[optim\]; sections are model, data, rollout, loss, train"):
        load_config(None, ["optim.lr=1"])


def test_misspelt_section_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section \[los\]; did you mean \[loss\]"):
        load_config(write(tmp_path, "[los]\nbeta = 0.1\n"), [])


def test_ambiguous_flat_key_asks_for_a_section(tmp_path):
    with pytest.raises(ConfigError, match=r"path is in sections model, data"):
        load_config(write(tmp_path, 'path = "x"\n'), [])


def test_flat_and_sectioned_key_set_twice_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"beta is set twice"):
        load_config(write(tmp_path, "beta = 0.1\n[loss]\nbeta = 0.2\n"), [])


@pytest.mark.parametrize("item, expected", [
    ("loss.beta=high", r"loss\.beta = 'high' has type str, expected a float"),
    ("train.max_steps=1.5", r"train\.max_steps = 1\.5 has type float, expected an int"),
    ("loss.mask_truncated_completions=1", r"loss\.mask_truncated_completions = 1 has type int, expected a bool"),
    ("loss.reward_funcs=3", r"loss\.reward_funcs = 3 has type int, expected a list of strings"),
    ("loss.reward_weights=['a']", r"loss\.reward_weights = \['a'\] has type list, expected a list of floats"),
])
def test_wrong_type_names_key_value_and_expected_type(item, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [item])


def test_a_wrong_type_suggests_the_options_default_and_a_quoted_number_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"expected a float; e\.g\. --set train\.learning_rate=1e-06$"):
        load_config(None, ["train.learning_rate=1e-5x"])  # the default, not a placeholder 0.5
    with pytest.raises(ConfigError, match=r"train\.learning_rate = '1e-6' has type str, expected a float \(in quotes, "
                                          r"1e-6 is a string in TOML: write learning_rate = 1e-6\)"):
        load_config(write(tmp_path, 'learning_rate = "1e-6"\n'), [])


def test_bool_is_not_accepted_as_int():
    with pytest.raises(ConfigError, match=r"train\.max_steps = True has type bool, expected an int"):
        config_from_dict({"train": {"max_steps": True}})


def test_bad_choice_lists_valid_choices():
    with pytest.raises(ConfigError, match=r"loss\.loss_type = 'dapoo' is not a valid choice; "
                                          r"valid: 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo'; did you mean 'dapo'"):
        load_config(None, ["loss.loss_type=dapoo"])


def test_bad_choice_of_a_field_that_also_takes_a_bool_says_so():
    with pytest.raises(ConfigError, match=r"loss\.scale_rewards = 'yes' is not a valid choice; "
                                          r"valid: 'group', 'batch', 'none', or true / false"):
        load_config(None, ["loss.scale_rewards=yes"])


def test_a_zero_gradient_accumulation_is_reported_once_not_again_as_steps_per_generation():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.gradient_accumulation_steps=0"])
    assert "train.gradient_accumulation_steps = 0 must be >= 1" in str(e.value)
    assert "steps_per_generation" not in str(e.value)
    with pytest.raises(ConfigError, match=r"train\.steps_per_generation = 0 must be >= 1"):
        load_config(None, ["train.steps_per_generation=0"])


def test_generation_batch_not_divisible_by_num_generations_shows_numbers_and_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.per_device_train_batch_size=6", "rollout.num_generations=4"])
    msg = str(e.value)
    assert "6 * 1 * 1 = 6 completions is not divisible by rollout.num_generations = 4" in msg
    assert "per_device_train_batch_size to a multiple of 4 (e.g. 4 or 8)" in msg


def test_generation_batch_counts_world_size():
    c = load_config(None, ["train.per_device_train_batch_size=4", "rollout.num_generations=8"], world_size=2)
    with pytest.raises(ConfigError, match=r"4 \* 1 \* 1 = 4 completions"):
        validate(c, world_size=1)


def test_steps_per_generation_must_be_multiple_of_gradient_accumulation():
    with pytest.raises(ConfigError, match=r"train\.steps_per_generation = 6 is not a multiple of "
                                          r"train\.gradient_accumulation_steps = 4.*"
                                          r"set steps_per_generation to 4 or 8"):
        load_config(None, ["train.gradient_accumulation_steps=4", "train.steps_per_generation=6",
                           "train.per_device_train_batch_size=8"])
    with pytest.raises(ConfigError, match=r"set steps_per_generation to 8, or leave it unset"):  # S < GA: one fix
        load_config(None, ["train.gradient_accumulation_steps=8", "train.steps_per_generation=2",
                           "train.per_device_train_batch_size=8"])


def test_num_generations_below_two_is_an_error():
    with pytest.raises(ConfigError, match=r"rollout\.num_generations = 1 must be >= 2"):
        load_config(None, ["rollout.num_generations=1"])


@pytest.mark.parametrize("item, expected", [
    ("loss.epsilon=0", r"loss\.epsilon = 0\.0 must be in \(0, 1\)"),
    ("loss.epsilon=2", r"loss\.epsilon = 2\.0 must be in \(0, 1\): ratios below 1 - epsilon are clipped"),
    ("train.device=gpu", r"train\.device = 'gpu' is not a valid choice; valid: 'auto', 'cpu', 'cuda'; did you mean 'cuda'"),
    ("rollout.top_p=1.5", r"rollout\.top_p = 1\.5 must be in \(0, 1\]"),
    ("rollout.repetition_penalty=0", r"rollout\.repetition_penalty = 0\.0 must be > 0; 1\.0 = off"),
    ("rollout.temperature=0", r"rollout\.temperature = 0\.0 must be > 0"),
    ("loss.top_entropy_quantile=0", r"loss\.top_entropy_quantile = 0\.0 must be in \(0, 1\]"),
    ("loss.delta=0.5", r"loss\.delta = 0\.5 must be > 1"),
    ("loss.beta=-1", r"loss\.beta = -1\.0 must be >= 0"),
    ("loss.off_policy_mask_threshold=0", r"loss\.off_policy_mask_threshold = 0\.0 must be > 0"),
    ("loss.vespo_lambda_neg=0", r"loss\.vespo_lambda_neg = 0\.0 must be > 0"),
])
def test_out_of_range_value_is_named(item, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [item])


@pytest.mark.parametrize("items, expected", [
    # a NaN weight silently dropped its function from the reward (and the step line read 'reward 0.000')
    (["loss.reward_funcs=['accuracy', 'format']", "loss.reward_weights=[nan, 1.0]"],
     r"loss\.reward_weights = \[nan, 1\.0\] must be finite numbers$"),
    (["loss.reward_funcs=['accuracy', 'format']", "loss.reward_weights=[inf, 1.0]"], r"reward_weights = \[inf, 1\.0\]"),
    (["loss.beta=inf"], r"loss\.beta = inf must be a finite number$"),  # skipped every step as non-finite
    (["train.num_train_epochs=inf", "train.max_steps=-1"], r"num_train_epochs = inf must be a finite number$"),
    (["rollout.temperature=inf", "train.learning_rate=nan"], r"temperature = inf must be a finite number\n  - "
                                                           r"train\.learning_rate = nan must be a finite number$"),
    (["train.max_grad_norm=nan"], r"max_grad_norm = nan must be a finite number$"),  # inf is "no clipping"
])
def test_nan_and_inf_options_are_errors_on_their_own(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)


def test_inf_is_no_limit_where_it_means_one():
    cfg = load_config(None, ["loss.delta=inf", "train.max_grad_norm=inf", "loss.tis_max=inf",
                             "loss.off_policy_mask_threshold=inf"])
    assert (cfg.loss.delta, cfg.train.max_grad_norm, cfg.loss.tis_max) == (math.inf,) * 3
    assert load_config(None, ["loss.epsilon_high=inf"]).loss.epsilon_high == math.inf  # no upper clip


@pytest.mark.parametrize("items, expected", [
    (["loss.entropy_coef=nan"], r"loss\.entropy_coef = nan must be a finite number"),
    (["loss.use_adaptive_entropy=true", "loss.entropy_coef=2.0"],
     r"loss\.entropy_coef = 2\.0 must lie in \[entropy_coef_min, entropy_coef_max\] = \[0\.0, 1\.0\]"),
    (["loss.use_adaptive_entropy=true", "loss.entropy_coef_delta=0"], r"loss\.entropy_coef_delta = 0\.0 must be > 0"),
])
def test_entropy_bonus_settings_are_checked(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)
    assert load_config(None, ["entropy_coef=-0.01"]).loss.entropy_coef == -0.01  # TRL's flat name; a penalty


@pytest.mark.parametrize("items, expected", [
    (["sync_ref_model=true"], r"loss\.sync_ref_model = true with loss\.beta = 0\.0: there is no reference model"),
    (["loss.beta=0.04", "loss.sync_ref_model=true", "loss.ref_model_mixup_alpha=1.5"],
     r"loss\.ref_model_mixup_alpha = 1\.5 must be in \[0, 1\]"),
    (["loss.beta=0.04", "loss.sync_ref_model=true", "loss.ref_model_sync_steps=0"],
     r"loss\.ref_model_sync_steps = 0 must be >= 1"),
])
def test_sync_ref_model_settings_are_checked(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)
    lo = load_config(None, ["beta=0.04", "sync_ref_model=true", "ref_model_sync_steps=64"]).loss  # TRL's names
    assert (lo.sync_ref_model, lo.ref_model_sync_steps, lo.ref_model_mixup_alpha) == (True, 64, 0.6)


def test_luspo_and_vespo_warn_about_their_importance_sampling_level():
    with pytest.warns(UserWarning, match="LUSPO is GSPO's sequence ratio"):
        assert load_config(None, ["loss_type=luspo"]).loss.loss_type == "luspo"  # TRL's name, as it is
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["loss_type=luspo", "importance_sampling_level=sequence"])  # no GSPO warning either
    with pytest.warns(UserWarning, match="VESPO forms its own sequence weight.*only changes the ratio of use_bias"):
        load_config(None, ["loss.policy_loss=vespo", "importance_sampling_level=sequence", "loss_type=grpo"])


def test_reward_weights_length_must_match_reward_funcs():
    with pytest.raises(ConfigError, match=r"loss\.reward_weights = \[1\.0, 2\.0\] has 2 weight\(s\) but "
                                          r"loss\.reward_funcs = \['accuracy'\] has 1 function"):
        load_config(None, ["loss.reward_weights=[1, 2]"])


def test_a_reward_model_hub_id_is_named_as_one_to_fetch_first():
    with pytest.raises(ConfigError, match=r"unknown reward 'org/reward-model-deberta' \(a Hugging Face model id\? "
                                          r"rlcore never downloads: fetch the reward model, e.g. hf download "
                                          r"org/reward-model-deberta --local-dir ckpt/reward-model-deberta"):
        load_config(None, ["loss.reward_funcs=['org/reward-model-deberta']"])


def test_unknown_reward_name_lists_built_in_rewards():
    with pytest.raises(ConfigError, match=r"unknown reward 'acuracy'; built-in rewards are accuracy, "
                                          r"format, countdown.*did you mean 'accuracy'"):
        load_config(None, ["loss.reward_funcs=['acuracy']"])


def test_jsonl_task_needs_a_path():
    with pytest.raises(ConfigError, match=r"data\.task = 'jsonl' needs data\.path"):
        load_config(None, ["data.task=jsonl"])


def test_countdown_task_needs_countdown_reward():
    with pytest.raises(ConfigError, match=r"--set loss\.reward_funcs='\[\"countdown\"\]'"):
        load_config(None, ["data.task=countdown"])


def test_a_jsonl_task_without_answers_cannot_score_with_accuracy_and_warns_about_held_out_accuracy():
    jsonl = ["data.task=jsonl", "data.path=train.jsonl", "data.answer_column="]
    with pytest.raises(ConfigError, match=r"loss\.reward_funcs = \['accuracy'\] has 'accuracy', which compares .* "
                                          r"data\.answer_column = '' reads none.*--set data\.answer_column=answer"):
        load_config(None, [*jsonl, "data.num_eval=0"])
    with pytest.warns(UserWarning, match=r"data\.answer_column = '': held-out accuracy .* has none to report; "
                                         r"set data\.num_eval = 0"):
        load_config(None, [*jsonl, "loss.reward_funcs=['format']"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, [*jsonl, "loss.reward_funcs=['format']", "data.num_eval=0"])


def test_a_reference_checkpoint_without_beta_is_named_as_unused():
    with pytest.warns(UserWarning, match=r"model\.ref_path = '/ckpt/ref' is read only when loss\.beta != 0, and it "
                                         r"is 0\.0: no reference model and no KL term; set loss\.beta"):
        load_config(None, ["model.ref_path=/ckpt/ref"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["model.ref_path=/ckpt/ref", "loss.beta=0.04"])


def test_an_empty_output_dir_is_an_error():
    with pytest.raises(ConfigError, match=r"train\.output_dir = '' names no directory \(an unset shell variable\?\)"):
        load_config(None, ["train.output_dir="])


def test_constant_schedule_with_warmup_is_an_error():
    with pytest.raises(ConfigError, match=r"lr_scheduler_type = 'constant' has no warmup.*constant_with_warmup"):
        load_config(None, ["train.warmup_steps=10"])


@pytest.mark.parametrize("kind, kwargs", [("constant_with_warmup", {}), ("linear", {}), ("cosine", {}),
                                          ("cosine", {"num_cycles": 1.25}),
                                          ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                          ("cosine_with_min_lr", {"min_lr": 2e-7, "num_cycles": 0.75})])
@pytest.mark.parametrize("warmup", ["train.warmup_steps=0", "train.warmup_steps=3", "train.warmup_ratio=0.15"])
def test_schedules_are_transformers_after_the_warmup_and_start_above_zero(kind, kwargs, warmup):
    """After the warmup the rate factor is transformers' get_scheduler(kind) (what a TRL config
    with that lr_scheduler_type runs); during it, step s of W runs at (s+1)/(W+1), where
    transformers' s/W spends step 0 at rate 0."""
    import torch
    from transformers import get_scheduler

    from rlcore.run.setup import lr_lambda

    total = 20
    table = "{" + ", ".join(f"{k} = {v}" for k, v in kwargs.items()) + "}"
    cfg = load_config(None, [f"train.lr_scheduler_type={kind}", warmup, f"train.max_steps={total}",
                             f"train.lr_scheduler_kwargs={table}"])
    W = cfg.train.warmup_steps or math.ceil(cfg.train.warmup_ratio * total)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.learning_rate)
    hf = get_scheduler(kind, opt, num_warmup_steps=W, num_training_steps=total,
                       scheduler_specific_kwargs=kwargs).lr_lambdas[0]
    ours = lr_lambda(cfg, total)
    for s in range(total):
        want = (s + 1) / (W + 1) if s < W else hf(s)
        assert ours(s) == pytest.approx(want, rel=1e-12, abs=1e-15), s
    assert ours(0) > 0 and ours(W) == 1.0 and (kind == "constant_with_warmup" or min(map(ours, range(total))) < 0.5)


@pytest.mark.parametrize("items, expected", [
    (["train.lr_scheduler_type=cosine_with_min_lr"], r"needs exactly one of min_lr \(a rate\) or min_lr_rate"),
    (["train.lr_scheduler_type=linear", "lr_scheduler_kwargs={num_cycles = 2}"],
     r"has \['num_cycles'\], which lr_scheduler_type = 'linear' does not take; it takes none"),
    # values: were checked only when the schedule ran ("can't multiply sequence by non-int of type 'float'")
    (["train.lr_scheduler_type=cosine", 'train.lr_scheduler_kwargs={num_cycles="x"}'],
     r"lr_scheduler_kwargs\.num_cycles = 'x' \(str\) must be a finite number, e\.g\. lr_scheduler_kwargs = "
     r"\{num_cycles = 0\.5\}"),
    (["train.lr_scheduler_type=cosine_with_min_lr", "train.lr_scheduler_kwargs={min_lr_rate=nan}"],
     r"min_lr_rate = nan \(float\) must be a finite number"),
    (["train.lr_scheduler_type=cosine_with_min_lr", "train.lr_scheduler_kwargs={min_lr_rate=true}"],
     r"min_lr_rate = True \(bool\) must be a finite number"),
    # ranges: min_lr_rate = 5 raised the rate to 4.9x over the run; num_cycles = -2 oscillated
    (["train.lr_scheduler_type=cosine_with_min_lr", "train.lr_scheduler_kwargs={min_lr_rate=5}"],
     r"min_lr_rate = 5 must be in \[0, 1\] \(a fraction of train\.learning_rate\)"),
    (["train.lr_scheduler_type=cosine_with_min_lr", "train.learning_rate=1e-6", "train.lr_scheduler_kwargs={min_lr=1e-5}"],
     r"min_lr = 1e-05 must be in \[0, train\.learning_rate = 1e-06\]"),
    (["train.lr_scheduler_type=cosine", "train.lr_scheduler_kwargs={num_cycles=-2}"],
     r"num_cycles = -2 must be > 0"),
])
def test_schedule_arguments_are_checked(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["loss.epsilon=0", "rollout.top_k=-1"])
    assert "loss.epsilon" in str(e.value) and "rollout.top_k" in str(e.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml does not exist"):
        load_config(str(tmp_path / "nope.toml"), [])


def test_invalid_toml_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.toml is not valid TOML"):
        load_config(write(tmp_path, "[loss\nbeta = 1\n"), [])


def test_config_path_that_is_a_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a directory; pass a TOML file"):
        load_config(str(tmp_path), [])


def test_config_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"[loss]\nbeta = 0.1 # \xff\n")
    with pytest.raises(ConfigError, match=r"run\.toml is not UTF-8 text \(invalid start byte, byte b'\\xff' at offset 20\)"):
        load_config(str(path), [])


def test_malformed_override_shows_the_form():
    with pytest.raises(ConfigError, match=r"'lossbeta' is not section\.key=value"):
        load_config(None, ["lossbeta"])


def test_cispo_with_default_epsilon_high_warns():
    with pytest.warns(UserWarning, match="epsilon_high=5.0"):
        load_config(None, ["loss.policy_loss=cispo"])


def test_cispo_with_epsilon_high_set_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["loss.policy_loss=cispo", "loss.epsilon_high=5.0"])


def test_a_delta_that_cannot_dual_clip_warns():
    with pytest.warns(UserWarning, match=r"loss\.delta = 1\.2 <= 1 \+ loss\.epsilon_high = 1\.28: positive-advantage "
                                         r"ratios are capped at delta, as epsilon_high = 0\.2 would, and negative-"
                                         r"advantage ones are held at the clip bound 1\.28, not at delta"):
        load_config(None, ["loss.delta=1.2", "loss.epsilon_high=0.28"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["loss.delta=1.3", "loss.epsilon_high=0.28"])
        load_config(None, ["loss.delta=1.2", "loss.policy_loss=cispo", "loss.epsilon_high=5.0"])  # ppo's option


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_with_token_summing_loss_type_warns(level):
    with pytest.warns(UserWarning, match=rf"'{level}' \(GSPO\).*GSPO objective is loss_type = 'grpo'"):
        load_config(None, [f"loss.importance_sampling_level={level}"])


def test_a_home_relative_path_is_expanded(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    c = load_config(None, ["model.path=~/ckpt/qwen", "data.task=jsonl", "data.path=~/gsm8k.jsonl",
                           "train.output_dir=~/runs/a"])
    assert (c.model.path, c.data.path, c.train.output_dir) == \
        ("/home/someone/ckpt/qwen", "/home/someone/gsm8k.jsonl", "/home/someone/runs/a")


@pytest.mark.parametrize("override, said", [
    # the shell ate the quotes of ["accuracy","format"]: accepted as the words it meant
    ("loss.reward_funcs=[accuracy,format]", None),
    ("train={max_steps=1,seed=3}", r"train is a section; set one key at a time: --set train\.max_steps=1 "
                                   r"--set train\.seed=3"),
    ("data.chat_template_kwargs.enable_thinking=false", r"data\.chat_template_kwargs is a table; give it whole: "
                                                        r"--set 'data\.chat_template_kwargs=\{\"enable_thinking\" = "
                                                        r"false\}'"),
    ("actor_rollout_ref.rollout.n=8", r"verl's config tree; rlcore takes TRL's names: rollout\.n -> "
                                      r"rollout\.num_generations"),
    ("data.train_batch_size=8", r"unknown config key data\.train_batch_size: verl's prompts per step"),
    ("load_in_4bit=true", r"unknown config key load_in_4bit: rlcore trains full-precision weights"),
    ("lora_rank=16", r"unknown config key lora_rank: Unsloth's; rlcore's is lora\.r"),
    # from a user audit: verl's names, a Python float, GSPO as a loss_type
    ("clip_ratio=0.2", r"unknown config key clip_ratio: verl's symmetric clip; rlcore's is loss\.epsilon"),
    ("kl_coef=0.01", r"kl_coef: verl's in-reward KL .*rlcore's KL term is loss\.beta"),
    ("rollout.n=8", r"rollout\.n: verl's samples per prompt \(rollout\.n\); rlcore's is rollout\.num_generations"),
    ("lr=1e-6", r"unknown config key lr: rlcore's \(TRL's\) is train\.learning_rate"),
    ("rollout.top_p=.9", r"top_p = '\.9' has type str, expected a float \(TOML writes a number with a digit on "
                         r"each side of the point: top_p = 0\.9\)"),
    ("train.learning_rate=1.", r"\(TOML writes a number with a digit on each side of the point: learning_rate = 1\.0\)"),
    ("loss_type=gspo", r"loss\.loss_type = 'gspo' is not a valid choice; .*set loss\.importance_sampling_level = "
                       r"'sequence' with loss\.loss_type = 'grpo'"),
    ("frobnicate=1", r"unknown config key frobnicate; `rlcore options` lists every option"),
    ("loss.reward_funcs=3", r"expected a list of strings; e.g\. --set 'loss\.reward_funcs=\[\"a\",\"b\"\]'"),
])
def test_what_users_of_other_tools_type_is_taken_or_answered(override, said):
    if said is None:
        assert load_config(None, [override]).loss.reward_funcs == ["accuracy", "format"]
    else:
        with pytest.raises(ConfigError, match=said):
            load_config(None, [override])


@pytest.mark.parametrize("override", ["data.chat_template_kwargs.reasoning_effort=high",
                                      'loss={reward_funcs=["accuracy","format"], beta=0.04}'])
def test_the_set_commands_an_error_suggests_work_as_printed(override):
    """Each suggested --set, split as a shell splits it, loads."""
    import shlex

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    words = shlex.split(str(err.value).partition(": ")[2].partition(": ")[2])
    suggested = [w for prev, w in zip(words, words[1:]) if prev == "--set"]
    assert suggested and load_config(None, suggested)


def test_a_yaml_config_and_a_verl_section_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"looks like YAML; rlcore reads TOML: write `key = value`"):
        load_config(write(tmp_path, "# GRPO\nlearning_rate: 1.0e-6\nbeta: 0.0\n"), [])
    with pytest.raises(ConfigError, match=r"unknown config section \[actor_rollout_ref\]: verl's config tree"):
        load_config(write(tmp_path, "[actor_rollout_ref.rollout]\nn = 8\n"), [])


def test_a_reward_function_listed_twice_is_an_error():
    with pytest.raises(ConfigError, match=r"loss\.reward_funcs lists 'accuracy' more than once; .* list it once and "
                                          r"weight it with loss\.reward_weights"):
        load_config(None, ['loss.reward_funcs=["accuracy","accuracy"]', "loss.reward_weights=[1.0,0.5]"])


def test_an_empty_config_file_warns_that_it_sets_nothing(tmp_path):
    with pytest.warns(UserWarning, match=r"sets nothing: the run is the embedded default \(rlcore/config/default.toml\)"):
        assert load_config(write(tmp_path, "# to do\n"), []) == load_config(str(EMBEDDED_DEFAULT), [])
    with pytest.warns(UserWarning, match=r"sets nothing: the run is rlcore's defaults \(rlcore options\) with the "):
        c = load_config(write(tmp_path, "\n"), ["model.path=/ckpt/qwen"])
    assert not on_embedded_default(write(tmp_path, "\n"), ["model.path=/ckpt/qwen"]) and c.train.learning_rate == 1e-6  # TRL's default, for a real model


def test_a_config_without_a_model_builds_on_the_embedded_default(tmp_path):
    # No model.path: the embedded tiny model, so the keys the file leaves unset are the default
    # run's (TRL's defaults would build another embedded model and train it with lr 1e-6 for 512 tokens).
    embedded = load_config(str(EMBEDDED_DEFAULT), [])
    assert not on_embedded_default(str(EMBEDDED_DEFAULT), [])
    c = load_config(write(tmp_path, "[loss]\npolicy_loss = 'sapo'\n"), [])
    assert on_embedded_default(write(tmp_path, "[loss]\npolicy_loss = 'sapo'\n"), []) and c.loss.policy_loss == "sapo"
    assert dataclasses.replace(c, loss=embedded.loss) == embedded  # everything else is the default run's
    assert load_config(write(tmp_path, "num_iterations = 2\n[model]\npath = ''\n"), []).train.max_steps == 300
    assert on_embedded_default(write(tmp_path, "[model]\npath = 'embedded'\n"), [])  # as ""
    t = load_config(write(tmp_path, "num_train_epochs = 2\n"), []).train  # the file counts epochs
    assert (t.max_steps, t.num_train_epochs, t.learning_rate) == (-1, 2.0, 1e-4)
    # A model named in the file or with --set: TRL's defaults under the file, as for any real model.
    for file, sets in (("model_name_or_path = '/ckpt/qwen'\n", []), ("beta = 0.0\n", ["model.path=/ckpt/qwen"])):
        c = load_config(write(tmp_path, file), sets)
        assert not on_embedded_default(write(tmp_path, file), sets) and (c.train.learning_rate, c.rollout.max_completion_length) == (1e-6, 512)
    # A run's own config.toml is complete: read as it is.
    run_toml = tmp_path / "config.toml"
    run_toml.write_text(RUN_CONFIG_HEADER + dump_config(Config()))
    assert load_config(str(run_toml), []) == Config()


def test_dumped_toml_is_valid_toml():
    tomllib.loads(dump_config(Config()))


def test_float16_weights_are_not_a_choice():
    # AdamW on fp16 weights without loss scaling turns them into NaN/inf at the first step
    with pytest.raises(ConfigError, match=r"model\.dtype = 'float16' is not a valid choice; valid: 'float32', 'bfloat16'"):
        load_config(None, ["model.dtype=float16"])


def test_bf16_weights_warn_that_small_updates_are_lost():
    with pytest.warns(UserWarning, match=r"model\.dtype = 'bfloat16': AdamW updates the bf16 weights.*"
                                         r"learning_rate 1e-06.*train\.bf16 = true"):
        validate(load_config(None, ["model.dtype=bfloat16", "train.learning_rate=1e-6"]))


def test_the_configs_policy_loss_names_are_the_loss_zoos():
    from rlcore.config.options import LossArgs
    from rlcore.losses.policy import LOSSES

    assert typing.get_args(typing.get_type_hints(LossArgs)["policy_loss"]) == LOSSES


def test_the_task_choices_are_the_tasks_there_are():
    from rlcore.config.options import DataArgs
    from rlcore.data.tasks import TASK_REWARD, TASKS

    assert typing.get_args(typing.get_type_hints(DataArgs)["task"]) == (*TASKS, "jsonl")
    assert set(TASK_REWARD) == {*TASKS, "jsonl"}


def test_a_policy_loss_given_as_loss_type_names_policy_loss():
    with pytest.raises(ConfigError, match=r"loss.loss_type = 'ppo' is not a valid choice; valid: .*; 'ppo' is a "
                                          r"policy loss: set loss.policy_loss = 'ppo' \(loss_type aggregates it\)"):
        load_config(None, ["loss.loss_type=ppo"])


def test_epsilon_zero_is_one_error_not_also_epsilon_highs_derived_from_it():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["loss.epsilon=0"])
    assert "loss.epsilon = 0" in str(e.value) and "epsilon_high" not in str(e.value)
    with pytest.raises(ConfigError, match=r"loss.epsilon_high = 0.0 must be > 0"):
        load_config(None, ["loss.epsilon_high=0"])


def test_with_absolute_paths_makes_the_set_path_options_absolute_and_leaves_the_rest(tmp_path, monkeypatch):
    from rlcore.config.load import with_absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.path=ckpt/qwen", "data.task=jsonl", "data.path=data/train.jsonl"])
    recorded = with_absolute_paths(cfg)
    assert recorded.model.path == str(tmp_path / "ckpt" / "qwen")
    assert recorded.data.path == str(tmp_path / "data" / "train.jsonl")
    assert recorded.model.ref_path is None and recorded.data.eval_path is None
    assert cfg.model.path == "ckpt/qwen" and dataclasses.replace(recorded.model, path="ckpt/qwen") == cfg.model
    assert with_absolute_paths(load_config(None, [])).model.path == ""  # the embedded model stays


# ---- DAPO: dynamic sampling, overlong shaping; sampled evaluation

@pytest.mark.parametrize("items, expected", [
    (["rollout.filter_groups=true", "rollout.max_num_gen_batches=-1"],
     r"rollout\.max_num_gen_batches = -1 must be >= 0: the most generation batches a round samples \(0 = no cap"),
    (["rollout.filter_groups=true", "rollout.filter_groups_metric=acuracy"],
     r"rollout\.filter_groups_metric = 'acuracy' is not one of loss\.reward_funcs = \['accuracy'\] \(did you mean "
     r"'accuracy'\?\); name one of them, or leave it out to judge the weighted total reward"),
    (["rollout.filter_groups=true", "rollout.num_generations=1"],
     r"rollout\.num_generations = 1 must be >= 2: .*, and rollout\.filter_groups keeps a group only when its "
     r"rewards differ"),
    (["rollout.max_num_gen_batches=10"], r"rollout\.max_num_gen_batches = 10 is a setting of dynamic sampling, "
                                         r"which is off; set rollout\.filter_groups = true"),
    (["rollout.filter_groups_metric=accuracy"], r"rollout\.filter_groups_metric = 'accuracy' is a setting of "
                                                r"dynamic sampling, which is off"),
])
def test_dynamic_sampling_settings_are_checked_before_a_model_loads(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)
    ro = load_config(None, ["filter_groups=true", "max_num_gen_batches=10"]).rollout  # verl's names, flat
    assert (ro.filter_groups, ro.max_num_gen_batches, ro.filter_groups_metric) == (True, 10, None)


@pytest.mark.parametrize("items, expected", [
    (["loss.reward_funcs=['accuracy', 'soft_overlong_punishment']"],
     r"the soft_overlong_punishment reward needs loss\.soft_punish_cache \(L_cache\).*e\.g\. "
     r"loss\.soft_punish_cache = 102"),
    (["loss.reward_funcs=['accuracy', 'soft_overlong_punishment']", "loss.soft_punish_cache=600"],
     r"loss\.soft_punish_cache = 600 must be in \[0, loss\.soft_punish_max_completion_len = 512\]"),
    (["loss.reward_funcs=['soft_overlong_punishment']", "loss.soft_punish_cache=-1"],
     r"loss\.soft_punish_cache = -1 must be in \[0, "),
    (["loss.soft_punish_cache=64"], r"loss\.soft_punish_cache = 64 is read by the soft_overlong_punishment reward, "
                                    r"which loss\.reward_funcs = \['accuracy'\] does not name; add it"),
    (["loss.reward_funcs=['soft_overlong_punishment']", "loss.soft_punish_cache=0",
      "loss.soft_punish_max_completion_len=0"], r"loss\.soft_punish_max_completion_len = 0 must be >= 1"),
])
def test_soft_overlong_punishment_settings_are_checked(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)


def test_soft_overlong_punishments_l_max_defaults_to_the_max_completion_length():
    lo = load_config(None, ["rollout.max_completion_length=64", "loss.soft_punish_cache=16",
                            "loss.reward_funcs=['accuracy', 'soft_overlong_punishment']"]).loss
    assert (lo.soft_punish_max_completion_len, lo.soft_punish_cache) == (64, 16)


@pytest.mark.parametrize("items, expected", [
    (["train.eval_num_generations=4", "train.eval_pass_at_k=[1, 8]"],
     r"train\.eval_pass_at_k has k = 8, outside \[1, train\.eval_num_generations = 4\]: pass@k picks k of the n "
     r"completions of a prompt; raise eval_num_generations to 8 or drop it"),
    (["train.eval_pass_at_k=[2]"], r"k = 2, outside \[1, train\.eval_num_generations = 1\]"),
    (["train.eval_num_generations=4", "train.eval_pass_at_k=[0]"], r"train\.eval_pass_at_k has k = 0; each k must be >= 1"),
    (["train.eval_num_generations=4", "train.eval_pass_at_k=[]"], r"train\.eval_pass_at_k = \[\] names no k"),
    (["train.eval_num_generations=4", "train.eval_pass_at_k=[2, 2]"], r"lists a k twice"),
    (["train.eval_num_generations=0"], r"train\.eval_num_generations = 0 must be >= 1"),
    (["train.eval_num_generations=4", "train.eval_temperature=0"], r"train\.eval_temperature = 0\.0 must be > 0"),
    (["train.eval_temperature=0.6"], r"train\.eval_temperature = 0\.6 is the temperature of the sampled held-out "
                                     r"completions, and train\.eval_num_generations = 1 samples none"),
])
def test_sampled_evaluation_settings_are_checked(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, items)


def test_sampled_evaluation_defaults_and_trls_num_generations_eval():
    train = load_config(None, ["num_generations_eval=8"]).train  # TRL's name
    assert (train.eval_num_generations, train.eval_pass_at_k, train.eval_temperature) == (8, [1, 8], None)
    assert load_config(None, []).train.eval_pass_at_k == [1]


@pytest.mark.parametrize("override, said", [
    ("algorithm.filter_groups.enable=true", r"algorithm\.filter_groups \(DAPO's dynamic sampling\) is "
                                            r"rollout\.filter_groups \(enable\), rollout\.filter_groups_metric"),
    ("overlong_buffer.len=4096", r"'soft_overlong_punishment' reward in loss\.reward_funcs, len -> "
                                 r"loss\.soft_punish_cache, penalty_factor -> its weight in loss\.reward_weights"),
    ("overlong_buffer_len=4096", r"OpenRLHF's; rlcore's is the 'soft_overlong_punishment' reward"),
    ("reward_model.overlong_buffer.len=4096", r"its overlong_buffer \(DAPO's overlong shaping\) is the "
                                              r"'soft_overlong_punishment' reward, len -> loss\.soft_punish_cache"),
    ("dynamic_filtering=true", r"OpenRLHF's; rlcore's dynamic sampling is rollout\.filter_groups, verl's rule"),
])
def test_verl_and_openrlhf_dapo_names_are_answered(override, said):
    with pytest.raises(ConfigError, match=said):
        load_config(None, [override])
