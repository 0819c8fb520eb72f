"""Reward models: a loss.reward_funcs entry that is a sequence classifier's checkpoint directory.

rlcore's classifier is held to transformers' ...ForSequenceClassification (fp32, padded batches, the
three families), its rewards to TRL's GRPOTrainer's own reward path for the same model, prompts and
completions (plain and conversational, a tokenizer unlike the policy's), a run to transformers'
scores of the completions it logged, two ranks to one, and bad input to errors that name it.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, TINY, token_reward
from rlcore.config import load_config
from rlcore.models.classifier import load_classifier
from rlcore.models.hf_checkpoint import CheckpointError
from rlcore.models.tokenizer import Tokenizer
from rlcore.rewards.reward_model import RewardModel
from rlcore.rewards.scoring import score_completions
from test_tokenizer import TEMPLATES, llama_checkpoint, qwen2_pipeline_checkpoint
from test_train_hf import write_gsm8k

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

transformers = pytest.importorskip("transformers", reason="transformers is the reference")


def make_classifier(family: str = "qwen2", num_labels: int = 1, seed: int = 0, **overrides):
    """A tiny random transformers ...ForSequenceClassification of `family` (conftest's FAMILIES)."""
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra, "num_labels": num_labels, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        model.score.weight.normal_(0, 2.0)  # scores of similar texts (one template) still far apart
    return model


def reward_model_dir(path: Path, family: str = "qwen2", tokenizer: str = "qwen", num_labels: int = 1) -> Path:
    """A reward model's checkpoint directory: a tiny classifier over a Qwen2.5-style tokenizer (pad
    <|endoftext|>) or a Llama 3-style one (no pad: EOS <|eot_id|> pads, and ends every turn)."""
    if tokenizer == "qwen":
        qwen2_pipeline_checkpoint(path)
    else:
        llama_checkpoint(path, (TEMPLATES / "llama3.jinja").read_text())
    tok = Tokenizer.from_dir(path)
    make_classifier(family, num_labels, vocab_size=512, pad_token_id=tok.pad_token_id).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_classifier_scores_a_padded_batch_as_transformers_does(family, tmp_path):
    """Right and left padding, a pad id inside a row, and a row whose last real token is the pad id
    (transformers reads the token before it: the rightmost one that is not the pad id)."""
    pad = 3
    hf = make_classifier(family, pad_token_id=pad)
    hf.save_pretrained(tmp_path)
    model = load_classifier(tmp_path)
    ids = torch.randint(4, 128, (4, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    ids[0, 6:], attention_mask[0, 6:] = pad, 0  # right-padded
    ids[1, 4] = pad  # the pad id as a real token inside
    ids[2, 8] = pad  # ... and as the last one
    ids[3, :2], attention_mask[3, :2] = pad, 0  # left-padded
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # transformers counts positions from 0 per row
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
        got = model(ids, attention_mask, pad)
    assert got.shape == want.shape == (4, 1)
    assert (got - want).abs().max().item() <= 1e-5


PROMPTS = ["What is 2 plus 3?", "Name a colour.", "Say hi"]
COMPLETIONS = [["5", "It is five, I think.", "six"], ["blue", "Red!"], ["hi", "hello there, friend", "<|im_end|>"]]


def rows(conversational: bool) -> tuple[list, list, list[dict]]:
    """(prompts, completions, dataset rows) of groups of unequal lengths, as reward functions get them."""
    prompts, completions, inputs = [], [], []
    for prompt, texts in zip(PROMPTS, COMPLETIONS):
        for text in texts:
            prompts.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
                           if conversational else prompt + "\n")
            completions.append([{"role": "assistant", "content": text}] if conversational else text)
            inputs.append({"prompt": prompts[-1], "answer": "5"})
    return prompts, completions, inputs


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("conversational", [False, True], ids=["plain", "conversational"])
@pytest.mark.parametrize("tokenizer", ["qwen", "llama"])
def test_rewards_equal_trl_grpo_trainers_for_the_same_model_prompts_and_completions(
        conversational, tokenizer, qwen_dir, tmp_path):
    """TRL's GRPOTrainer._calculate_rewards with the reward model's path and a Python function among
    its reward_funcs, and rlcore's score_completions with RewardModel (4 rows a batch, so batches are
    padded) and the same function: the same rewards, and the same name. The policy is qwen_dir, whose
    tokenizer differs from the Llama-style reward model's."""
    trl = pytest.importorskip("trl", reason="TRL is the reference")
    from datasets import Dataset

    rm_dir = reward_model_dir(tmp_path / "my-reward-model", "llama" if tokenizer == "llama" else "qwen2", tokenizer)
    prompts, completions, inputs = rows(conversational)
    completion_ids = [[10 + i] for i in range(len(prompts))]
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                          use_vllm=False, per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
    trainer = trl.GRPOTrainer(model=str(qwen_dir), reward_funcs=[str(rm_dir), token_reward], args=args,
                              processing_class=transformers.AutoTokenizer.from_pretrained(qwen_dir),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    want = trainer._calculate_rewards(inputs, prompts, completions, completion_ids)

    reward_model = RewardModel.load(rm_dir, batch_size=4, conversational=conversational)
    got = score_completions([reward_model, token_reward], prompts, completions, {"answer": ["5"] * len(prompts)},
                            extra={"completion_ids": completion_ids})
    assert reward_model.__name__ == trainer.reward_func_names[0] == "my-reward-model"
    assert got[:, 1].tolist() == want[:, 1].tolist()
    assert (got[:, 0] - want[:, 0]).abs().max().item() <= 1e-5
    assert want[:, 0].std() > 0.01  # the reward model tells the completions apart


def test_the_text_is_the_chat_template_of_prompt_and_completion_or_their_concatenation(tmp_path):
    rm = RewardModel.load(reward_model_dir(tmp_path / "rm", tokenizer="llama"), conversational=True)
    messages = [{"role": "user", "content": "hi"}]
    assert rm.texts([messages], [[{"role": "assistant", "content": "yo"}]]) == [
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"]
    assert rm.texts(["2+2=", "a"], ["4", " b"]) == ["2+2=4", "a b"]


def first_digit_judge(prompts, completions, **kwargs):
    """A Python reward beside the reward model: 1.0 when the completion starts with a digit."""
    return [float(c[:1].isdigit()) for c in completions]


def test_a_run_scores_with_a_reward_model_beside_a_python_reward(qwen_dir, tmp_path, monkeypatch):
    """A run on qwen_dir with a Llama-tokenized reward model (its own vocabulary) weighted 1.0 and a
    Python reward weighted 0.5: every completion's reward-model score in completions.jsonl equals
    transformers' score of its prompt + completion, tokenized as TRL tokenizes it; the metrics and the
    evaluation carry its mean under the directory's name; config.toml records the directory absolute."""
    from rlcore.train import train

    rm_dir = reward_model_dir(tmp_path / "judge", "llama", "llama")
    data = write_gsm8k(tmp_path / "gsm8k.jsonl", range(4))
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # a relative reward model path, as a user writes one
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
        "data.num_eval=4", "rollout.num_generations=4", "rollout.max_completion_length=6",
        f"loss.reward_funcs=['judge', '{__name__}:first_digit_judge']", "loss.reward_weights=[1.0, 0.5]",
        "loss.reward_model_batch_size=3", "train.per_device_train_batch_size=8", "train.max_steps=2",
        "train.learning_rate=1e-2", "train.device=cpu", "train.log_completions=true",
        "train.num_completions_to_print=0", f"train.output_dir={run}"])
    train(cfg)

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(rm_dir)
    hf_tok.pad_token = hf_tok.eos_token  # as TRL sets it
    logged = [json.loads(ln) for ln in (run / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 16
    texts = [r["prompt"] + r["completion"] for r in logged]
    batch = hf_tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    hf.config.pad_token_id = hf_tok.pad_token_id
    with torch.no_grad():
        want = hf(**batch).logits[:, 0].tolist()
    assert [r["rewards"]["judge"] for r in logged] == pytest.approx(want, abs=1e-5)
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    first_round = [r for r in logged if r["step"] == 1]
    assert metrics[0]["reward/judge/mean"] == pytest.approx(sum(r["rewards"]["judge"] for r in first_round) / 8)
    assert metrics[0]["reward/mean"] == pytest.approx(sum(r["rewards"]["judge"] + 0.5 * r["rewards"][
        f"{__name__}:first_digit_judge"] for r in first_round) / 8)
    assert "eval/reward/judge/mean" in json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    recorded = tomllib.loads((run / "config.toml").read_text())["loss"]["reward_funcs"]
    assert recorded == [str(rm_dir.resolve()), f"{__name__}:first_digit_judge"]  # what --resume from elsewhere finds


def test_the_reward_model_is_a_frozen_copy_of_its_own_beside_a_lora_policy(qwen_dir, tmp_path):
    """Never trained, never given adapters, not in the optimizer: on the run's device in model.dtype."""
    from rlcore.run.setup import setup

    rm_dir = reward_model_dir(tmp_path / "rm")
    data = write_gsm8k(tmp_path / "gsm8k.jsonl", range(4))
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
        "data.num_eval=0", "rollout.num_generations=4", "rollout.max_completion_length=6",
        f"loss.reward_funcs=['{rm_dir}']", "lora.enabled=true",
        "model.dtype=bfloat16", "train.per_device_train_batch_size=8", "train.device=cpu",
        f"train.output_dir={tmp_path / 'run'}"])
    run = setup(cfg)
    (reward_model,) = run.reward_funcs
    params = list(reward_model.model.parameters())
    trained = {id(p) for group in run.opt.param_groups for p in group["params"]}
    assert run.reward_names == ["rm"]
    assert not any(p.requires_grad or id(p) in trained for p in params)
    assert not any("lora" in name for name, _ in reward_model.model.named_parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and not reward_model.model.training


# conftest's fixed completions in place of sampling, by their rows' place in the round (test_distributed.py's)
FIXED_ROLLOUT = """
import os, sys
import rlcore.train
from conftest import fixed_completions, fixed_rollout
from rlcore.cli import main

rounds = []

def generate(model, prompts, num_generations, max_new_tokens, eos_token_ids, pad_token_id, **kwargs):
    first = int(os.environ.get("RANK", "0")) * len(prompts)
    every = fixed_completions(len(rounds), first + len(prompts), eos_token_ids[0], max_new_tokens)
    rounds.append(prompts)
    return fixed_rollout(prompts, every[first:], eos_token_ids[0], pad_token_id)

rlcore.rollout.completions.generate = generate
sys.exit(main(sys.argv[1:]))
"""


def test_two_ranks_each_score_their_own_rows_as_one_rank_scores_them_all(qwen_dir, tmp_path):
    """2 torchrun ranks of 4 completions and one process of 8, on the same fixed completions: the
    reward model's mean over each round is the same (each rank scored its half, gathered)."""
    from test_distributed import one_and_two_ranks
    from test_train import rows as metrics_rows

    script = tmp_path / "fixed_rollout.py"
    script.write_text(FIXED_ROLLOUT)
    rm_dir = reward_model_dir(tmp_path / "rm")
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    options = [f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={data}", "data.prompt_column=question",
               "data.num_eval=0", "rollout.num_generations=4", "rollout.max_completion_length=6",
               f"loss.reward_funcs=['{rm_dir}']", "train.max_steps=2", "train.device=cpu"]

    one, two, _ = one_and_two_ranks(tmp_path, script, options, 8)
    a, b = metrics_rows(one), metrics_rows(two)
    assert len(a) == len(b) == 2
    assert [r["reward/rm/mean"] for r in b] == pytest.approx([r["reward/rm/mean"] for r in a], rel=1e-6)
    assert [r["reward/rm/mean"] for r in a][0] != pytest.approx([r["reward/rm/mean"] for r in a][1])


# ---- bad input

def test_a_causal_lm_is_not_a_reward_model(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    with pytest.raises(CheckpointError, match=r"is a Qwen2ForCausalLM \(no score.weight in its weights\), and a "
                                              r"reward model is a sequence classifier"):
        load_classifier(path)


def test_a_classifier_of_two_labels_is_not_a_reward_model(tmp_path):
    make_classifier(num_labels=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: score.weight has 2 rows, a classifier of 2 labels"):
        load_classifier(tmp_path)


def test_a_reward_model_without_a_tokenizer_is_an_error_naming_the_file(tmp_path):
    make_classifier().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"reward model {tmp_path}: {tmp_path / 'tokenizer.json'} not found"):
        RewardModel.load(tmp_path)


def test_conversational_data_needs_the_reward_models_chat_template(tmp_path):
    rm_dir = reward_model_dir(tmp_path / "rm")
    (rm_dir / "chat_template.jinja").unlink()
    RewardModel.load(rm_dir, conversational=False)  # plain prompts: prompt + completion, no template
    with pytest.raises(ValueError, match=f"{rm_dir / 'tokenizer_config.json'}: the reward model has no chat template"):
        RewardModel.load(rm_dir, conversational=True)


def test_two_reward_models_of_one_name_are_an_error(qwen_dir, tmp_path):
    from rlcore.run.setup import setup

    first = reward_model_dir(tmp_path / "a" / "rm")
    shutil.copytree(first, tmp_path / "b" / "rm")
    cfg = load_config(None, [f"model.path={qwen_dir}", "train.device=cpu", f"train.output_dir={tmp_path / 'run'}",
                             f"loss.reward_funcs=['{first}', '{tmp_path / 'b' / 'rm'}', 'accuracy']"])
    with pytest.raises(ValueError, match="names 'rm' twice .* rename the reward model's directory"):
        setup(cfg)
    assert not (tmp_path / "run").exists()


def test_a_reward_model_directory_that_is_gone_is_named_as_missing(tmp_path):
    from rlcore import ConfigError

    with pytest.raises(ConfigError, match=f"unknown reward '{tmp_path / 'moved'}' \\(no such directory\\)"):
        load_config(None, [f"loss.reward_funcs=['{tmp_path / 'moved'}']"])
