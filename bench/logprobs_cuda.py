"""rlcore's CUDA log-prob kernels against their PyTorch twins (and the naive form), on one GPU.

    python bench/logprobs_cuda.py            # needs CUDA, nvcc and ninja (the kernels build on first use)

1. The kernels alone, on one [256, 151936] fp32 chunk of logits (Qwen's vocabulary): softmax_stats
   against its twin chunk_stats, and logit_grad_ against chunk_grad_, with the bytes each must
   move (the kernel reads the chunk once; the gradient reads and writes it once).
2. The whole of token_logprobs, forward + backward of logp.sum(), for 4 x 1024 tokens, hidden 896,
   vocab 151936, fp32 with TF32 off (the recompute path: the chunk logits are computed again in
   backward), through the kernels and through the twins (RLCORE_CUDA_KERNELS=0), with the naive
   `log_softmax(h @ W.T).gather(...)` for peak memory.
Times are medians of 10 runs after 3 warm-ups, CUDA synchronised around each; memory is
torch.cuda.max_memory_allocated above what the inputs hold. The last line is
`logprob_kernel_speedup_vs_twin=<ratio>` for part 2.

--batch, --tokens, --hidden, --vocab, --chunk-size, --repeats and --warmup change the sizes;
tests/test_bench_smoke.py's smoke run (on a GPU), every line and no figure:

    python bench/logprobs_cuda.py --batch 1 --tokens 32 --hidden 32 --vocab 1024 --chunk-size 16 --repeats 1 --warmup 1
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from rlcore import cuda
from rlcore.losses.logprobs import chunk_grad_, chunk_stats, token_logprobs

B, T, H, V, CHUNK = 4, 1024, 896, 151936, 256


REPEATS, WARMUP = 10, 3


def timed(fn, setup=lambda: None, repeats=None, warmup=None):
    """Median seconds of fn() (setup() runs untimed before each call); repeats and warmup: the
    command line's unless given."""
    repeats, warmup = REPEATS if repeats is None else repeats, WARMUP if warmup is None else warmup
    times = []
    for i in range(warmup + repeats):
        setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_chunk_kernels(ext, g: torch.Generator) -> None:
    """Part 1: each kernel against its twin on the same [CHUNK, V] logits, refilled before each run."""
    src = torch.randn(CHUNK, V, device="cuda", generator=g) * 4
    targets = torch.randint(V, (CHUNK,), device="cuda", generator=g)
    z, scratch = torch.empty_like(src), torch.empty_like(src)
    refill = lambda: z.copy_(src)  # noqa: E731 (both sides overwrite the chunk)
    chunk_bytes = src.numel() * src.element_size()
    t_twin = timed(lambda: chunk_stats(z, targets, scratch, False), refill)
    t_kern = timed(lambda: ext.softmax_stats(z, targets, False), refill)
    print(f"softmax_stats on [{CHUNK}, {V}] fp32: kernel {t_kern * 1e3:.3f} ms "
          f"({chunk_bytes / t_kern / 1e9:.0f} GB/s of one read), twin {t_twin * 1e3:.3f} ms, "
          f"ratio {t_twin / t_kern:.2f}")
    lse, _, ent = chunk_stats(src.clone(), targets, scratch, False)
    up = torch.randn(CHUNK, device="cuda", generator=g)
    t_twin = timed(lambda: chunk_grad_(z, targets, lse, ent, up, None, None), refill)
    t_kern = timed(lambda: ext.logit_grad_(z, targets, lse, ent, up, None), refill)
    print(f"logit_grad_ on [{CHUNK}, {V}] fp32: kernel {t_kern * 1e3:.3f} ms "
          f"({2 * chunk_bytes / t_kern / 1e9:.0f} GB/s of one read + one write), twin {t_twin * 1e3:.3f} ms, "
          f"ratio {t_twin / t_kern:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=B, help="sequences")
    parser.add_argument("--tokens", type=int, default=T, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=H, help="hidden size")
    parser.add_argument("--vocab", type=int, default=V, help="vocabulary size")
    parser.add_argument("--chunk-size", type=int, default=CHUNK, help="token_logprobs' chunk, and part 1's rows")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs of each (the median is reported)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs before them")
    return parser.parse_args(argv)


def main() -> None:
    global B, T, H, V, CHUNK, REPEATS, WARMUP
    args = parse_args()
    B, T, H, V, CHUNK = args.batch, args.tokens, args.hidden, args.vocab, args.chunk_size
    REPEATS, WARMUP = args.repeats, args.warmup
    torch.backends.cuda.matmul.allow_tf32 = False
    ext = cuda.kernels("token_logprobs", torch.device("cuda"))
    assert ext is not None, "the CUDA kernels did not build"
    print(f"machine: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    g = torch.Generator(device="cuda").manual_seed(0)
    bench_chunk_kernels(ext, g)

    h = (torch.randn(B, T, H, device="cuda", generator=g) * 0.5).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).requires_grad_()
    tok = torch.randint(V, (B, T), device="cuda", generator=g)

    def rlcore_step():
        logp, _ = token_logprobs(h, w, tok, chunk_size=CHUNK)
        logp.sum().backward()

    def naive_step():
        logp = torch.log_softmax(h @ w.T, -1).gather(-1, tok[..., None]).squeeze(-1)
        logp.sum().backward()

    def clear():
        h.grad = w.grad = None

    results = {}
    for name, setting in (("kernels", "1"), ("twin", "0")):
        os.environ["RLCORE_CUDA_KERNELS"] = setting
        results[name] = timed(rlcore_step, clear), peak_mib(rlcore_step)
        clear()
    results["naive"] = timed(naive_step, clear, repeats=min(3, REPEATS), warmup=1), peak_mib(naive_step)
    for name, (secs, mib) in results.items():
        print(f"token_logprobs fwd+bwd, {B}x{T} tokens, H={H}, V={V}, fp32: {name}: {secs * 1e3:.1f} ms, "
              f"peak +{mib:.0f} MiB")
    print(f"logprob_kernel_speedup_vs_twin={results['twin'][0] / results['kernels'][0]:.2f}")


if __name__ == "__main__":
    main()
