"""Rollout throughput: rlcore's engine vs transformers' `generate`, same weights, same run.

Qwen2-shaped random model (hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1408,
vocab 32000, tied embeddings, fp32); 8 prompts x G=8 = 64 sequences, 64-token prompts,
exactly 128 new tokens each (no EOS), plain sampling at temperature 1.

    flock /tmp/rlcore-bench.lock python bench/rollout.py
    python bench/rollout.py --device cuda [--shape qwen2.5-0.5b] [--prompts 32]   # on a GPU

`--shape qwen2.5-0.5b` takes Qwen2.5-0.5B's shape instead (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocab 151936, tied), still random. On a GPU both sides run with
TF32 off, timed with CUDA synchronised before each clock read.

`--shape tiny` (2 layers, hidden 64, vocab 128) with `--prompts 1 --G 2 --prompt-len 4 --new-tokens 2
--peak-n 64 --copy-gib 0.001` is the smoke run tests/test_bench_smoke.py makes: every line, no figure.

`--dtype` sets both sides' precision: fp32 (default); bf16, bf16 autocast over the fp32 weights
(what `train.bf16` does: rlcore's `generate(dtype=bfloat16)`, `generate` inside
`torch.autocast`); bf16-weights, both models cast to bfloat16 (a bf16 checkpoint).

The roofline line: a decoding step must at least read every weight it multiplies by (the layers'
matrices and the output projection, in the compute dtype) and the filled part of the KV cache,
so the decoding steps of the run take at least (those bytes, summed over the steps) / the
memory bandwidth, measured here as the best of a few 1 GiB device copies (read + write); rlcore's
fraction is that bound over its measured rollout time (which includes the prefill).

The last line is `rollout_speedup_vs_hf=<ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from rlcore.models.transformer import ModelConfig, Transformer
from rlcore.rollout import generate
from rlcore.run.steplog import clock  # wall clock once the GPU's queued work is done

HF_CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=True, use_sliding_window=False)
SHAPES = {"bench": HF_CONFIG,
          "qwen2.5-0.5b": dict(HF_CONFIG, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
          # a smoke run's (tests/test_bench_smoke.py): every line printed, in seconds on a CPU
          "tiny": dict(HF_CONFIG, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)}


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """This machine's matmul throughput in `dtype`: the best of a few n x n x n products."""
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock(device)
        torch.mm(a, b, out=c)
        best = min(best, clock(device) - t0)
    return 2 * n**3 / best / 1e9


def copy_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """This machine's memory bandwidth in bytes/s: the best of a few copies of `gib` GiB (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock(device)
        dst.copy_(src)
        best = min(best, clock(device) - t0)
    return 2 * src.numel() / best


def decode_bytes(cfg: ModelConfig, rows: int, prompt_len: int, new: int, itemsize: int) -> float:
    """Bytes the decoding steps of the run read at the least: every step reads the matmul weights
    (layers and output projection) once and the cache filled so far (keys and values of every row)."""
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    weights = L * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h
    cache_per_slot = 2 * L * rows * kv
    return sum(weights + cache_per_slot * (prompt_len + t + 1) for t in range(new - 1)) * itemsize


def rollout_flops(cfg: ModelConfig, prompts: int, G: int, prompt_len: int, new: int) -> float:
    """Model FLOPs of the minimum work: each prompt once, then G * (new - 1) fed tokens per prompt.

    2 * matmul params per token, plus 4 * layers * heads * head_dim * context for attention
    (scores and weighted sum), plus the vocabulary projection for every sampled token.
    """
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    attn = 4 * L * cfg.num_attention_heads * d  # per token per context position
    vocab = 2 * h * cfg.vocab_size
    prefill = prompts * (prompt_len * 2 * L * per_layer + attn * prompt_len * (prompt_len + 1) / 2)
    decode = prompts * G * sum(2 * L * per_layer + attn * (prompt_len + t + 1) for t in range(new - 1))
    return prefill + decode + prompts * G * new * vocab


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shape", default="bench", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "bf16-weights"])
    ap.add_argument("--peak-n", type=int, default=2048, help="size n of the n x n x n matmuls timed for the peak")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="GiB copied to measure the memory bandwidth")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides (PyTorch's default)

    torch.manual_seed(args.seed)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES[args.shape])).eval()
    cfg = ModelConfig.from_hf(json.loads(hf.config.to_json_string()))
    model = Transformer(cfg).eval()
    model.load_state_dict(hf.state_dict(), strict=False)  # the tied lm_head key is extra
    hf, model = hf.to(device), model.to(device)
    autocast = args.dtype == "bf16"  # bf16 compute over fp32 weights
    if args.dtype == "bf16-weights":
        hf, model = hf.to(torch.bfloat16), model.to(torch.bfloat16)
    compute = torch.float32 if args.dtype == "fp32" else torch.bfloat16

    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(2, cfg.vocab_size, (args.prompts, args.prompt_len), generator=g).to(device)
    N, new = args.prompts * args.G, args.new_tokens

    def run_rlcore(max_new: int):
        return generate(model, prompts.tolist(), args.G, max_new, eos_token_ids=[], pad_token_id=0,
                        temperature=1.0, generator=torch.Generator(device).manual_seed(args.seed), dtype=compute)

    def run_hf(max_new: int):
        with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                               temperature=1.0, top_k=None, top_p=None, max_new_tokens=max_new,
                               min_new_tokens=max_new, num_return_sequences=args.G,
                               eos_token_id=None, pad_token_id=0)

    peak = matmul_peak_gflops(device, compute, args.peak_n)
    run_rlcore(4), run_hf(4)  # warm-up: first-call overheads out of the timings
    t0 = clock(device)
    out = run_rlcore(new)
    t_rl = clock(device) - t0
    assert out.completion_ids.shape == (N, new) and bool((out.lengths == new).all())
    t0 = clock(device)
    hf_out = run_hf(new)
    t_hf = clock(device) - t0
    assert hf_out.shape == (N, args.prompt_len + new)

    peak = max(peak, matmul_peak_gflops(device, compute, args.peak_n))  # before and after: the machine may be shared
    bandwidth = copy_bandwidth(device, args.copy_gib)
    read = decode_bytes(cfg, N, args.prompt_len, new, compute.itemsize)
    roofline = read / bandwidth  # seconds
    flops = rollout_flops(cfg, args.prompts, args.G, args.prompt_len, new)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"machine: {where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.dtype.split('-')[0]} matmul peak {peak:.0f} GFLOP/s ({args.peak_n}^3 mm)")
    print(f"workload: {args.shape} shape, {args.prompts} prompts x G={args.G} = {N} sequences, {args.prompt_len}-token "
          f"prompts, {new} new tokens each, {args.dtype}, temperature 1, model FLOPs {flops / 1e9:.0f} G")
    for name, secs in (("rlcore", t_rl), ("transformers", t_hf)):
        print(f"{name}: {N * new / secs:.0f} new tokens/s ({secs:.2f} s), "
              f"{flops / secs / 1e9:.0f} GFLOP/s = {flops / secs / 1e9 / peak:.0%} of matmul peak")
    print(f"roofline: the decoding steps read at least {read / 1e9:.1f} GB "
          f"(weights + filled cache) at {bandwidth / 1e9:.0f} GB/s (copy): {roofline * 1e3:.0f} ms = "
          f"{N * new / roofline:.0f} new tokens/s; rlcore at {roofline / t_rl:.0%} of it, transformers at {roofline / t_hf:.0%}")
    print(f"rollout_speedup_vs_hf={t_hf / t_rl:.2f}")


if __name__ == "__main__":
    main()
