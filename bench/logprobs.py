"""Peak memory and time of chunked vs naive per-token log-probs, forward + backward, on CPU.

    flock /tmp/rlcore-bench.lock python bench/logprobs.py [--chunk-size 256] [--repeats 2]

Shape: 4 x 1024 completion tokens, hidden 896, vocab 151936 (Qwen2.5-0.5B's lm_head), fp32.
naive:   log_softmax(h @ W.T, -1).gather(-1, targets)          (materialises [4096, 151936] x several)
chunked: rlcore.losses.logprobs.token_logprobs                   (also computes the entropy)

How memory is measured, and why it is honest on CPU: each method runs in a fresh subprocess.
After building h, W and targets the worker resets the kernel's peak-RSS counter (writing "5" to
/proc/self/clear_refs resets VmHWM), runs forward + backward `repeats` times, and reports
VmHWM - VmRSS(before): the peak resident memory the computation added, including W.grad and
every temporary. glibc serves allocations above 32 MB with mmap and unmaps them on free, so
freed [N, V] buffers leave RSS at once and the counter tracks live tensors, not allocator caches.
Where clear_refs is not writable the worker falls back to getrusage's ru_maxrss (lifetime peak,
which here is the same because setup allocates less than the computation).
Time is the best of `repeats` runs of forward + backward, in seconds (wall clock).

--batch, --tokens, --hidden and --vocab change the shape; tests/test_bench_smoke.py's smoke run,
every line and no figure: --batch 1 --tokens 64 --hidden 32 --vocab 8192 --chunk-size 16 --repeats 1
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

B, T, H, V = 4, 1024, 896, 151936


def rss_kib(field: str) -> int:
    """VmRSS / VmHWM of this process in KiB, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def naive(h, w, targets):
    logp = torch.log_softmax(h @ w.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    logp.sum().backward()


def chunked(h, w, targets, chunk_size):
    from rlcore.losses.logprobs import token_logprobs

    logp, _ = token_logprobs(h, w, targets, chunk_size=chunk_size)
    logp.sum().backward()


def worker(method: str, chunk_size: int, repeats: int, shape: tuple[int, int, int, int]) -> None:
    b, t, hidden, vocab = shape
    torch.manual_seed(0)
    h = (torch.randn(b, t, hidden) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    targets = torch.randint(vocab, (b, t))
    run = naive if method == "naive" else lambda *a: chunked(*a, chunk_size)
    before = rss_kib("VmRSS")
    exact = reset_peak_rss()
    times = []
    for _ in range(repeats):
        h.grad = w.grad = None
        start = time.perf_counter()
        run(h, w, targets)
        times.append(time.perf_counter() - start)
    peak = rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak - before) / 1024, "seconds": min(times), "exact": exact}))


def measure(method: str, chunk_size: int, repeats: int, shape: tuple[int, int, int, int]) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--chunk-size", str(chunk_size),
           "--repeats", str(repeats)]
    cmd += [f"--{flag}={n}" for flag, n in zip(("batch", "tokens", "hidden", "vocab"), shape)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=B, help="sequences")
    parser.add_argument("--tokens", type=int, default=T, help="completion tokens per sequence")
    parser.add_argument("--hidden", type=int, default=H, help="hidden size")
    parser.add_argument("--vocab", type=int, default=V, help="vocabulary size")
    parser.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.batch, args.tokens, args.hidden, args.vocab)
    if args.worker:
        return worker(args.worker, args.chunk_size, args.repeats, shape)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU, "
          f"B={args.batch} T={args.tokens} H={args.hidden} V={args.vocab}, forward+backward, best of {args.repeats}")
    results = {m: measure(m, args.chunk_size, args.repeats, shape) for m in ("naive", "chunked")}
    for method, r in results.items():
        label = f"chunked (chunk_size={args.chunk_size})" if method == "chunked" else method
        print(f"{label:28s} peak +{r['peak_mib']:8.0f} MiB  {r['seconds']:6.2f} s")
    print(f"logprob_time_ratio={results['chunked']['seconds'] / results['naive']['seconds']:.3f}")
    print(f"logprob_peak_mem_ratio={results['chunked']['peak_mib'] / results['naive']['peak_mib']:.3f}")


if __name__ == "__main__":
    main()
