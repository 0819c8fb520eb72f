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

`--model DIR` runs the same comparison on a real checkpoint directory instead (SmolLM2-135M-Instruct
from `rlcore fetch-smollm2`): both sides load DIR in fp32 (rlcore's `load_model`, transformers'
`AutoModelForCausalLM`), the prompts are CHAT_PROMPTS in the tokenizer's chat template (--prompts
of them, left-padded for `generate`), and completions end at EOS: each side is timed on its own
sampled completions, its tokens/s counting the tokens up to and including each row's EOS. Its
model FLOPs are those of its own completions; there is no roofline line (rows stop at different
steps, and rlcore drops finished rows from the batch where `generate` keeps decoding them).

    flock /tmp/rlcore-bench.lock python bench/rollout.py --model ~/.cache/rlcore/SmolLM2-135M-Instruct

The last line is `rollout_speedup_vs_hf=<ratio>` (of new tokens/s with --model, of seconds without).
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
from rlcore.models.hf_checkpoint import load_model
from rlcore.models.tokenizer import Tokenizer
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

# --model's prompts: user messages of a chat, a mix of short answers and longer ones
CHAT_PROMPTS = [
    "What is 56 + 93?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
    "Write a short story about a robot who learns to paint.",
    "What is the capital of Australia?",
    "List four fruits that are red.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a compiler do?",
    "Describe a sunset in one sentence.",
    "Is 91 a prime number? Explain.",
    "Give two tips for sleeping better.",
]


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
    return completions_flops(cfg, [prompt_len] * prompts, [[new] * G] * prompts)


def completions_flops(cfg: ModelConfig, prompt_lens: list[int], lengths: list[list[int]]) -> float:
    """`rollout_flops` for prompts of `prompt_lens` tokens whose completions (lengths[i], one per
    sample of prompt i) have the given numbers of tokens: each prompt once, each completion's
    tokens but its last fed, every completion token sampled."""
    h, d, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    attn = 4 * L * cfg.num_attention_heads * d  # per token per context position
    vocab = 2 * h * cfg.vocab_size
    flops = 0.0
    for prompt_len, news in zip(prompt_lens, lengths):
        flops += prompt_len * 2 * L * per_layer + attn * prompt_len * (prompt_len + 1) / 2
        for new in news:
            flops += sum(2 * L * per_layer + attn * (prompt_len + t + 1) for t in range(new - 1)) + new * vocab
    return flops


def random_models(shape: str) -> tuple[torch.nn.Module, Transformer]:
    """transformers' Qwen2 of `shape` with random weights, and rlcore's Transformer with the same ones."""
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES[shape])).eval()
    model = Transformer(ModelConfig.from_hf(json.loads(hf.config.to_json_string()))).eval()
    model.load_state_dict(hf.state_dict(), strict=False)  # the tied lm_head key is extra
    return hf, model


def chat_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """Token ids of the first `n` CHAT_PROMPTS, each a user message in the tokenizer's chat template."""
    if not 1 <= n <= len(CHAT_PROMPTS):
        raise SystemExit(f"--prompts {n}: with --model, 1 to {len(CHAT_PROMPTS)} (the chat prompts there are)")
    return [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True) for text in CHAT_PROMPTS[:n]]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate`'s input: prompts left-padded to one width [P, T], and their attention mask [P, T]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def lengths_to_eos(new_ids: torch.Tensor, eos_ids: list[int]) -> list[int]:
    """Each row's completion length in `generate`'s new tokens [N, T']: up to and including its
    first EOS (the rows after it are padding), else all T'."""
    stops = torch.isin(new_ids, torch.tensor(eos_ids, dtype=new_ids.dtype, device=new_ids.device))
    first = torch.where(stops.any(dim=1), stops.int().argmax(dim=1) + 1, new_ids.shape[1])
    return first.tolist()


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
    ap.add_argument("--model", default="", help="a checkpoint directory: its chat prompts and EOS instead of --shape")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides (PyTorch's default)

    torch.manual_seed(args.seed)
    if args.model:
        tok = Tokenizer.from_dir(args.model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        model = load_model(args.model).eval()
        prompts, eos, pad = chat_prompts(tok, args.prompts), tok.eos_token_ids, tok.pad_token_id
    else:
        hf, model = random_models(args.shape)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(2, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
        eos, pad = [], 0  # no EOS: every row runs to --new-tokens
    cfg = model.config
    hf, model = hf.to(device), model.to(device)
    autocast = args.dtype == "bf16"  # bf16 compute over fp32 weights
    if args.dtype == "bf16-weights":
        hf, model = hf.to(torch.bfloat16), model.to(torch.bfloat16)
    compute = torch.float32 if args.dtype == "fp32" else torch.bfloat16

    prompt_ids, attention = (t.to(device) for t in left_padded(prompts, pad))
    prompt_lens = [len(p) for p in prompts]
    N, new = len(prompts) * args.G, args.new_tokens

    def run_rlcore(max_new: int):
        return generate(model, prompts, args.G, max_new, eos_token_ids=eos, pad_token_id=pad,
                        temperature=1.0, generator=torch.Generator(device).manual_seed(args.seed), dtype=compute)

    def run_hf(max_new: int):
        with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            return hf.generate(prompt_ids, attention_mask=attention, do_sample=True,
                               temperature=1.0, top_k=None, top_p=None, max_new_tokens=max_new,
                               min_new_tokens=0 if eos else max_new, num_return_sequences=args.G,
                               eos_token_id=eos or None, pad_token_id=pad)

    peak = matmul_peak_gflops(device, compute, args.peak_n)
    run_rlcore(4), run_hf(4)  # warm-up: first-call overheads out of the timings
    t0 = clock(device)
    out = run_rlcore(new)
    t_rl = clock(device) - t0
    t0 = clock(device)
    hf_out = run_hf(new)
    t_hf = clock(device) - t0
    lengths = {"rlcore": out.lengths.tolist(), "transformers": lengths_to_eos(hf_out[:, prompt_ids.shape[1]:], eos)}
    if not eos:
        assert lengths["rlcore"] == lengths["transformers"] == [new] * N, "without EOS every row has --new-tokens"

    peak = max(peak, matmul_peak_gflops(device, compute, args.peak_n))  # before and after: the machine may be shared
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"machine: {where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.dtype.split('-')[0]} matmul peak {peak:.0f} GFLOP/s ({args.peak_n}^3 mm)")
    if args.model:
        print(f"workload: {args.model}, {len(prompts)} chat prompts x G={args.G} = {N} sequences, "
              f"{min(prompt_lens)}-{max(prompt_lens)}-token prompts, up to {new} new tokens each (EOS ends a row), "
              f"{args.dtype}, temperature 1")
    else:
        print(f"workload: {args.shape} shape, {args.prompts} prompts x G={args.G} = {N} sequences, "
              f"{args.prompt_len}-token prompts, {new} new tokens each, {args.dtype}, temperature 1, "
              f"model FLOPs {rollout_flops(cfg, args.prompts, args.G, args.prompt_len, new) / 1e9:.0f} G")
    rate = {}
    for name, secs in (("rlcore", t_rl), ("transformers", t_hf)):
        lens = lengths[name]
        rate[name] = sum(lens) / secs
        flops = completions_flops(cfg, prompt_lens, [lens[i:i + args.G] for i in range(0, N, args.G)])
        own = (f", {sum(lens)} new tokens: mean completion length {sum(lens) / N:.1f}, "
               f"{sum(n == new for n in lens)} of {N} at the {new}-token limit" if eos else "")
        print(f"{name}: {rate[name]:.0f} new tokens/s ({secs:.2f} s){own}, "
              f"{flops / secs / 1e9:.0f} GFLOP/s = {flops / secs / 1e9 / peak:.0%} of matmul peak")
    if not eos:
        bandwidth = copy_bandwidth(device, args.copy_gib)
        read = decode_bytes(cfg, N, args.prompt_len, new, compute.itemsize)
        roofline = read / bandwidth  # seconds
        print(f"roofline: the decoding steps read at least {read / 1e9:.1f} GB "
              f"(weights + filled cache) at {bandwidth / 1e9:.0f} GB/s (copy): {roofline * 1e3:.0f} ms = "
              f"{N * new / roofline:.0f} new tokens/s; rlcore at {roofline / t_rl:.0%} of it, "
              f"transformers at {roofline / t_hf:.0%}")
    print(f"rollout_speedup_vs_hf={rate['rlcore'] / rate['transformers']:.2f}")


if __name__ == "__main__":
    main()
