"""The benchmarks' model-FLOP count (bench/rollout.py's `rollout_flops`, which bench/train_step.py's
floor is 4 times) against an independent count: PyTorch's FlopCounterMode over transformers'
`generate` on the same shape, eager attention, one sample per prompt."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model
from rlcore.models.transformer import ModelConfig

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("prompts, prompt_len, new", [(1, 5, 1), (3, 7, 6)])
def test_rollout_flops_match_flop_counter_on_transformers_generate(prompts, prompt_len, new):
    from torch.utils.flop_counter import FlopCounterMode

    rollout = bench_module("rollout")
    hf = make_hf_model("qwen2", attn_implementation="eager")
    cfg = ModelConfig.from_hf(json.loads(hf.config.to_json_string()))
    ids = torch.randint(2, cfg.vocab_size, (prompts, prompt_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    assert out.shape == (prompts, prompt_len + new)
    # Eager attention multiplies the whole prompt x prompt score matrix and masks it afterwards,
    # where the count takes the causal half (T (T + 1) / 2 query-key pairs per prompt).
    L, heads, d = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    masked_half = 4 * L * heads * d * prompts * (prompt_len ** 2 - prompt_len * (prompt_len + 1) // 2)
    assert counter.get_total_flops() - masked_half == rollout.rollout_flops(cfg, prompts, 1, prompt_len, new)


def test_train_step_floor_is_four_forwards_and_names_the_share_3x_needs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # train_step imports rollout from beside itself, as a script does
    train_step = bench_module("train_step")
    rollout = bench_module("rollout")
    (tmp_path / "config.json").write_text(json.dumps(dict(rollout.HF_CONFIG, model_type="qwen2")))
    cfg = ModelConfig.from_hf(dict(rollout.HF_CONFIG, model_type="qwen2"))
    flops = train_step.step_flops(tmp_path)
    assert flops == 4 * rollout.rollout_flops(cfg, 8, 8, 64, 128)
    lines = train_step.floor_lines(flops, 100.0, {"trl": {"sec_per_step": 60.0}, "rlcore": {"sec_per_step": 30.0}})
    need = flops / 20.0 / 1e9  # 3x TRL = 20 s per step
    assert f"= {flops / 100e9:.1f} s/step at the matmul peak of 100 GFLOP/s" in lines[0]
    assert f"3x trl (20.0 s/step) needs {need:.0f} GFLOP/s = {need / 100:.0%} of peak" in lines[1]
    assert f"rlcore {flops / 30e9:.0f} GFLOP/s" in lines[1]


def test_completions_flops_of_several_prompts_is_each_prompts_count_summed():
    rollout = bench_module("rollout")
    cfg = ModelConfig.from_hf(json.loads(make_hf_model("qwen2").config.to_json_string()))
    one = rollout.rollout_flops  # FlopCounterMode-checked above, for one prompt and one sample
    assert rollout.completions_flops(cfg, [5, 7], [[3], [1]]) == one(cfg, 1, 1, 5, 3) + one(cfg, 1, 1, 7, 1)


def test_lengths_to_eos_count_up_to_and_including_the_first_eos_else_the_whole_row():
    rollout = bench_module("rollout")
    new_ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [9, 3, 2, 3], [2, 2, 2, 2]])
    assert rollout.lengths_to_eos(new_ids, [2, 3]) == [2, 4, 2, 1]
    assert rollout.lengths_to_eos(new_ids, []) == [4, 4, 4, 4]  # no EOS: every row runs to the end
