"""The loop on a real-format Hugging Face checkpoint: Qwen2 weights + a Qwen2.5-style tokenizer
with its chat template, GSM8K-style JSONL prompts. Everything rlcore writes must load back in
transformers (weights and tokenizer) and agree with rlcore."""

import json

import pytest
import torch

from conftest import make_hf_model
from rlcore.checkpoint import load_model
from rlcore.config import load_config
from rlcore.tokenizer import Tokenizer
from rlcore.train import train
from test_tokenizer import qwen2_pipeline_checkpoint

transformers = pytest.importorskip("transformers")


def brevity(prompts, completions, **columns):
    """Varies within every group of a random model, so advantages are nonzero and weights move."""
    return [1.0 / (1 + len(c)) for c in completions]


@pytest.fixture
def qwen_dir(tmp_path):
    path = qwen2_pipeline_checkpoint(tmp_path / "qwen")
    tok = Tokenizer.from_dir(path)
    model = make_hf_model("qwen2", vocab_size=512, max_position_embeddings=512)
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    return path


@pytest.fixture
def gsm8k_file(tmp_path):
    f = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} and {b} make {a + b}.\n#### {a + b}"}
            for a in range(6) for b in range(4)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_loop_trains_an_hf_checkpoint_and_writes_one_transformers_loads(qwen_dir, gsm8k_file, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={qwen_dir}", "data.task=jsonl", f"data.path={gsm8k_file}", "data.prompt_column=question",
        "data.num_eval=4", "data.system_prompt=Answer with a number.", "rollout.num_generations=4",
        "rollout.max_completion_length=6", f"loss.reward_funcs=['accuracy', '{__name__}:brevity']",
        "loss.reward_weights=[1.0, 0.5]", "train.per_device_train_batch_size=8", "train.max_steps=2",
        "train.learning_rate=1e-2", "train.device=cpu", f"train.output_dir={run}"])
    result = train(cfg)
    saved = run / "checkpoint-2" / "model"

    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert 0.0 <= result["after"] <= 1.0
    # The weights moved, and transformers reads rlcore's checkpoint with rlcore's logits.
    before, after = load_model(qwen_dir), load_model(saved)
    assert not torch.equal(before.model.layers[0].mlp.up_proj.weight, after.model.layers[0].mlp.up_proj.weight)
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - after.logits(after(ids))).abs().max().item() <= 1e-5
    # The tokenizer travels with the weights: the saved directory is a complete HF checkpoint.
    hf_tok = transformers.AutoTokenizer.from_pretrained(saved)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 plus 3?"}]
    assert Tokenizer.from_dir(saved).apply_chat_template(messages, tokenize=True) == \
        hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
