"""The shipped real-model config, configs/qwen2.5-0.5b-gsm8k.toml, runs end to end.

The config is meant for Qwen2.5-0.5B-Instruct on a GPU. Here a tiny random Qwen2 stands in for
the model, with a byte-level BPE tokenizer carrying Qwen2.5's real chat template and special
tokens, and a GSM8K-shaped JSONL supplies the data. The run goes through the config as shipped
(its columns, system prompt, chat template, rewards, bf16 and batch sizes), with the overrides a
user passes plus what a CPU needs: the device, one step and short completions.
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model
from rlcore.checkpoint import load_model
from rlcore.config import load_config
from rlcore.data import format_prompt
from rlcore.tokenizer import Tokenizer
from rlcore.train import train
from test_tokenizer import qwen2_pipeline_checkpoint

CONFIG = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-gsm8k.toml"


@pytest.fixture
def stand_in(tmp_path):
    """A tiny Qwen2.5 stand-in checkpoint and GSM8K-shaped train and test files."""
    path = tmp_path / "qwen-tiny"
    qwen2_pipeline_checkpoint(path)
    tok = Tokenizer.from_dir(path)
    model = make_hf_model("qwen2", vocab_size=512)
    model.config.eos_token_id, model.config.bos_token_id = tok.eos_token_id, None
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = tok.eos_token_id, None
    model.save_pretrained(path)
    for name, count in (("train.jsonl", 24), ("test.jsonl", 4)):
        with open(tmp_path / name, "w") as f:
            for i in range(count):
                a, b = i % 7 + 1, i % 5 + 2
                f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                    "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    return path


def test_the_gsm8k_config_trains_a_step_and_writes_a_checkpoint(stand_in, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(str(CONFIG), [
        f"model.path={stand_in}", f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'test.jsonl'}",
        "train.device=cpu", "train.max_steps=1", "rollout.max_completion_length=8",
        "train.eval_max_completion_length=8", f"train.output_dir={run}"])
    assert (cfg.train.bf16, cfg.data.use_chat_template, cfg.loss.reward_funcs) == (True, True, ["accuracy", "format"])

    # The prompt the run feeds the model: Qwen2.5's ChatML with the config's system prompt.
    tok = Tokenizer.from_dir(stand_in)
    ids = format_prompt({"prompt": "How many?"}, tok, cfg.data.system_prompt, cfg.data.use_chat_template)
    assert tok.decode(ids) == (f"<|im_start|>system\n{cfg.data.system_prompt}<|im_end|>\n"
                               "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n")

    result = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    r = rows[0]
    assert r["loss"] is not None and r["grad_norm"] is not None and not r["skipped"]
    assert {"reward/accuracy/mean", "reward/format/mean"} <= set(r)
    assert 0 <= result["before"] <= 1 and 0 <= result["after"] <= 1
    before, after = load_model(stand_in), load_model(run / "checkpoint-1" / "model")
    assert not torch.equal(before.model.norm.weight, after.model.norm.weight)  # the step moved the weights
