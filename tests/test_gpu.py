"""The CUDA path (`train.device = "cuda"`) against the references the CPU tests use: transformers
on the same GPU for logits and greedy generation, a cache-free forward pass on the CPU for the
rollout's log-probs, the fp64 definition for `token_logprobs` and its gradients, and the CPU
tests' own learning criterion for the loop. Skipped on a machine without CUDA (CI has none); on
one: `python -m pytest -q tests/test_gpu.py` (bench/gpu.sh runs it with the GPU benchmarks).

TF32 is off for fp32 matmuls here (PyTorch's default), so fp32 on the GPU is held to about the
CPU tests' tolerances.
"""

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import rlcore.rollout.engine as engine
import rlcore.rollout.graphs as graphs
from conftest import make_hf_model
from rlcore import cuda
from rlcore.models.hf_checkpoint import load_model
from rlcore.config import load_config
from rlcore.losses.logprobs import token_logprobs
from rlcore.rollout import generate
from rlcore.models.tokenizer import Tokenizer
from rlcore.train import train
from test_logprobs import naive_fp64
from test_rollout import (PAD, assert_same_rollout, random_prompts, rlcore_model, spied_bf16_rollout,
                          training_logprobs)
from test_tokenizer import qwen2_pipeline_checkpoint
from test_train import config, rows, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def fp32_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# ----------------------------------------------------------------------------- the model

@pytest.mark.parametrize("family", ["qwen2", "llama3_rope", "qwen3_tied"])
def test_logits_match_transformers_on_the_gpu(family):
    hf = make_hf_model(family)
    model = rlcore_model(hf).to(CUDA)
    hf.to(CUDA)
    ids = torch.randint(0, 128, (3, 48), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.no_grad():
        diff = (model.logits(model(ids)) - hf(input_ids=ids).logits).abs().max().item()
    print(f"\n{family} on {torch.cuda.get_device_name()}: max |logits - transformers| = {diff:.3e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_matches_transformers_generate_on_the_gpu(family):
    hf = make_hf_model(family)
    model = rlcore_model(hf).to(CUDA)
    hf.to(CUDA)
    prompts = random_prompts([5, 2, 9, 4])
    out = generate(model, prompts, 1, 24, eos_token_ids=[1], pad_token_id=PAD, temperature=0.0)
    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts], device=CUDA)
    attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=CUDA)
    ref = hf.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=24, eos_token_id=[1],
                      pad_token_id=PAD)[:, T:]
    assert out.completion_ids.device.type == "cuda"
    assert torch.equal(out.completion_ids, ref)


def test_gpu_rollout_logprobs_equal_a_cpu_training_forward():
    """Cached, batched, compacted decoding on the GPU gives the log-probs a cache-free CPU forward
    pass gives the same tokens (the trainer's numbers), across many completion lengths."""
    cpu_model = rlcore_model(make_hf_model("qwen3_tied"))
    prompts = random_prompts([6, 3, 11, 6], seed=1)
    out = generate(cpu_model.to(CUDA), prompts, 4, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD,
                   temperature=0.8, generator=torch.Generator(CUDA).manual_seed(0))
    assert len(set(out.lengths.tolist())) > 4
    on_cpu = dataclasses.replace(out, completion_ids=out.completion_ids.cpu(), lengths=out.lengths.cpu())
    ref = training_logprobs(cpu_model.cpu(), on_cpu, 0.8)
    torch.testing.assert_close(out.sampling_logprobs.cpu(), ref, rtol=0, atol=1e-4)


def test_a_bf16_rollout_on_the_gpu_equals_autocast_at_every_call(monkeypatch):
    """dtype=bf16 casts the layers' weights once per rollout (`engine.matmul_weights_in`); the
    completions and log-probs equal those of autocast casting them at every call, bit for bit."""
    model = rlcore_model(make_hf_model("qwen2")).to(CUDA)
    rollout, seen = spied_bf16_rollout(model, monkeypatch)
    cast_once = rollout()
    monkeypatch.setattr(engine, "matmul_weights_in", lambda model, dtype: contextlib.nullcontext())
    autocast_each_call = rollout()
    assert [s[0] for s in seen] == [torch.bfloat16, torch.float32]  # the first rollout did cast, the second did not
    assert_same_rollout(cast_once, autocast_each_call)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def seeded_rollout(model, dtype=torch.float32, **sampling):
    """A rollout on the GPU whose rows end at many lengths (the batch shrinks through buckets)."""
    prompts = random_prompts([6, 3, 11, 6], seed=1)
    return generate(model, prompts, 4, 40, eos_token_ids=list(range(1, 9)), pad_token_id=PAD, dtype=dtype,
                    generator=torch.Generator(CUDA).manual_seed(0), **sampling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1)],
                         ids=["greedy", "seeded"])
def test_graphed_and_eager_steps_give_the_same_completions(sampling, dtype, monkeypatch):
    """The static step replayed from CUDA graphs (one per batch size) against the same step run
    eagerly (RLCORE_CUDA_GRAPHS=0): the same completions, and log-probs to fp32 rounding."""
    model = rlcore_model(make_hf_model("qwen2")).to(CUDA)
    calls, call = [], graphs.CapturedStep.__call__  # True for a replay, False for the eager first call
    monkeypatch.setattr(graphs.CapturedStep, "__call__", lambda self: calls.append(self.graph is not None) or call(self))
    graphed = seeded_rollout(model, dtype, **sampling)
    assert calls.count(True) > 20 and calls.count(False) >= 2  # captured at more than one batch size, replayed
    assert len(set(graphed.lengths.tolist())) > 2
    monkeypatch.setenv("RLCORE_CUDA_GRAPHS", "0")
    calls.clear()
    eager = seeded_rollout(model, dtype, **sampling)
    assert calls == []
    for field in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(graphed, field), getattr(eager, field)), field
    diff = (graphed.sampling_logprobs - eager.sampling_logprobs).abs().max().item()
    print(f"\ngraphed vs eager, {dtype}: max |log-prob difference| = {diff:.3e}")
    assert diff <= 1e-6


def test_a_multi_turn_rollout_through_graphs_equals_the_eager_step_and_the_training_forward(monkeypatch):
    """Tool results appended between turns (end_of_turn), replayed from CUDA graphs: the eager
    step's rollout (tokens, masks, tool mask), and on the model's own tokens the log-probs of a
    cache-free CPU forward over prompt + completion, appended ids included."""
    from test_rollout_turns import SUFFIX, first_turn_only

    model = rlcore_model(make_hf_model("qwen2")).to(CUDA)
    graphed = seeded_rollout(model, temperature=0.8, end_of_turn=first_turn_only())
    assert (graphed.tool_mask == 0).sum() >= 4 * len(SUFFIX)  # several rows went on after a turn
    monkeypatch.setenv("RLCORE_CUDA_GRAPHS", "0")
    eager = seeded_rollout(model, temperature=0.8, end_of_turn=first_turn_only())
    for field in ("completion_ids", "completion_mask", "truncated", "tool_mask"):
        assert torch.equal(getattr(graphed, field), getattr(eager, field)), field
    on_cpu = dataclasses.replace(graphed, completion_ids=graphed.completion_ids.cpu(), lengths=graphed.lengths.cpu())
    ref = training_logprobs(model.cpu(), on_cpu, 0.8)
    own = (graphed.tool_mask * graphed.completion_mask).bool().cpu()
    torch.testing.assert_close(graphed.sampling_logprobs.cpu()[own], ref[own], rtol=0, atol=1e-4)


def test_the_attention_kernel_and_its_twin_give_the_same_rollout(monkeypatch):
    """rlcore/cuda/decode_attention.cu inside the engine against its twin (RLCORE_CUDA_KERNELS=0)."""
    model = rlcore_model(make_hf_model("qwen3_tied")).to(CUDA)
    monkeypatch.setattr(cuda, "_loaded", {})
    kernel = seeded_rollout(model, temperature=0.8)
    assert cuda._loaded["decode_attention"] is not None  # the kernel ran
    monkeypatch.setenv("RLCORE_CUDA_KERNELS", "0")
    twin = seeded_rollout(model, temperature=0.8)
    assert torch.equal(kernel.completion_ids, twin.completion_ids)
    torch.testing.assert_close(kernel.sampling_logprobs, twin.sampling_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False])
def test_token_logprobs_and_gradients_on_the_gpu_match_fp64(recompute):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 33, 64, generator=g, dtype=torch.float64)
    weight = torch.randn(1000, 64, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(1000, (4, 33), generator=g)
    up_logp, up_ent = torch.randn(4, 33, generator=g), torch.randn(4, 33, generator=g)
    h, w = (x.to(CUDA, torch.float32).requires_grad_() for x in (hidden, weight))
    logp, ent = token_logprobs(h, w, targets.to(CUDA), temperature=0.7, chunk_size=37, recompute=recompute)
    dh, dw = torch.autograd.grad((logp * up_logp.to(CUDA)).sum() + (ent * up_ent.to(CUDA)).sum(), (h, w))
    h64, w64 = hidden.requires_grad_(), weight.requires_grad_()
    ref_logp, ref_ent = naive_fp64(h64, w64, targets, temperature=0.7)
    ref_dh, ref_dw = torch.autograd.grad((ref_logp * up_logp).sum() + (ref_ent * up_ent).sum(), (h64, w64))
    for got, ref in ((logp, ref_logp), (ent, ref_ent), (dh, ref_dh), (dw, ref_dw)):
        torch.testing.assert_close(got.cpu().double(), ref.detach(), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the loop

@pytest.mark.usefixtures("embedded_dir")
def test_the_loop_learns_on_the_gpu_and_writes_a_checkpoint_transformers_loads(tmp_path):
    """The CPU test's criterion (test_reward_rises_on_a_learnable_reward), on the GPU."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    run = tmp_path / "run"
    train(config(run, "train.device=cuda", "train.max_steps=24", "train.learning_rate=3e-3",
                 "train.save_steps=24"))
    got = rows(run)
    reward = [r["reward/mean"] for r in got]
    assert sum(reward[-6:]) / 6 > sum(reward[:6]) / 6 + 0.2, reward
    assert all(math.isfinite(r["loss"]) and not r["skipped"] and r["memory/peak_gb"] > 0 for r in got)
    assert all(r["time/rollout"] > 0 and r["time/update"] > 0 for r in got if r["time/rollout"])
    path = run / "checkpoint-24" / "model"
    assert all(t.isfinite().all() for t in weights(path).values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        model = load_model(path)
        torch.testing.assert_close(model.logits(model(ids)), hf(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("embedded_dir")
def test_bf16_autocast_on_the_gpu_trains(tmp_path):
    run = tmp_path / "run"
    train(config(run, "train.device=cuda", "train.bf16=true", "train.max_steps=24", "train.learning_rate=3e-3"))
    got = rows(run)
    reward = [r["reward/mean"] for r in got]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in got)
    assert sum(reward[-6:]) / 6 > sum(reward[:6]) / 6 + 0.2, reward


@pytest.mark.usefixtures("embedded_dir")
def test_resume_on_the_gpu_continues_the_run(tmp_path):
    """Stop after 2 steps, resume to 4: against an uninterrupted 4-step run. CUDA kernels may sum
    in another order from run to run (no exactness is promised on the GPU), so the weights are
    compared to a tolerance and the largest difference is printed."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    sets = ("train.device=cuda", "train.save_steps=2", "train.lr_scheduler_type=constant")
    train(config(whole, *sets, "train.max_steps=4"))
    train(config(part, *sets, "train.max_steps=2"))
    train(config(part, *sets, "train.max_steps=4"), resume=str(part))
    a, b = weights(whole / "checkpoint-4" / "model"), weights(part / "checkpoint-4" / "model")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"\nresume on the GPU: max |weight difference| = {diff:.3e}")
    assert diff <= 1e-4
    assert [r["step"] for r in rows(part)] == [1, 2, 3, 4]


def test_the_shipped_gsm8k_config_trains_on_the_gpu(tmp_path):
    """configs/qwen2.5-0.5b-gsm8k.toml as shipped (bf16 autocast, 512-token completions, b=16,
    GA=4, chat template), two steps on a random model of Qwen2.5-0.5B's layer shapes (hidden 896,
    24 layers, 14 heads / 2 KV heads, intermediate 4864; a 512-token vocabulary, the tokenizer's)."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    path = qwen2_pipeline_checkpoint(tmp_path / "qwen")
    tok = Tokenizer.from_dir(path)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=512, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    hf.save_pretrained(path)
    data, held_out = tmp_path / "gsm8k.jsonl", tmp_path / "gsm8k_test.jsonl"
    for f, first in ((data, range(8)), (held_out, range(8, 10))):
        f.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}) + "\n"
                             for a in first for b in range(8)))
    run = tmp_path / "run"
    config_file = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-gsm8k.toml"
    cfg = load_config(str(config_file), [f"model.path={path}", f"data.path={data}", f"data.eval_path={held_out}",
                                         "data.num_eval=16", "train.max_steps=2", f"train.output_dir={run}"])
    assert (cfg.train.device, cfg.train.bf16, cfg.rollout.max_completion_length) == ("cuda", True, 512)
    train(cfg)
    got = rows(run)
    print(f"\nshipped GSM8K config on {torch.cuda.get_device_name()}: " + "; ".join(
        f"step {r['step']}: {r['time/rollout']:.1f} s rollout, {r['time/update']:.1f} s update, "
        f"{r['memory/peak_gb']:.1f} GiB peak, mean length {r['completion/len_mean']:.0f}" for r in got))
    assert [r["step"] for r in got] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in got)
    before, after = weights(path), weights(run / "checkpoint-2" / "model")
    assert all(after[k].isfinite().all() for k in after) and not torch.equal(before["model.norm.weight"],
                                                                          after["model.norm.weight"])
