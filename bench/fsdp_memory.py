"""Per-rank memory of one optimizer step on 2 ranks: FSDP (train.fsdp) against the replicated mode.

A Qwen2.5-shaped model with fewer, narrower layers (random fp32 weights), the same batch on both:
each of 2 gloo (CPU) or NCCL (CUDA) ranks runs one optimizer step of the loop's pieces (the
completions' chunked log-probs, backward, the gradient reduction, clipping, AdamW's step). Torch's
memory trackers (torch.distributed._tools: MemTracker, and FSDPMemTracker for the sharded model)
sort every tensor the step allocates or touches by what it holds, after every operator; the peak
over the step of the bytes of parameters, gradients and optimizer state together (FSDP: sharded
and gathered ones, and its all-gather and reduce-scatter buffers) is the number compared.
Activations are left out: they are the same in both modes. Printed per rank; last line
fsdp_rank_mem_ratio=<FSDP / replicated>, rank 0's (1/2 on 2 ranks, unless the gathered block and
root during backward outweigh the optimizer step's shards).

    python bench/fsdp_memory.py [--device cpu|cuda]

--shape tiny (2 layers, hidden 64, vocab 128), --rows, --prompt and --completion make it small;
tests/test_bench_smoke.py's smoke run, every line and no figure:

    python bench/fsdp_memory.py --shape tiny --rows 1 --prompt 4 --completion 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install (ranks inherit it)

SHAPE = dict(model_type="qwen2", vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, qkv_bias=True)
SHAPES = {"bench": SHAPE, "tiny": dict(SHAPE, vocab_size=128, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)}
ROWS, PROMPT, COMPLETION = 4, 32, 64  # completions per rank, tokens
WORLD = 2
HELD = {"PARAM", "GRAD", "OPT", "SHARDED_PARAM", "UNSHARDED_PARAM", "SHARDED_GRAD", "UNSHARDED_GRAD", "ALL_GATHER",
        "REDUCE_SCATTER"}  # the tracker categories counted: everything but activations, buffers and temporaries


def kind_name(kind) -> str:
    return str(kind).rpartition(".")[2]


def peak_of_held(tracker_class):
    """`tracker_class` keeping, besides its own peak, the snapshot where the HELD categories peak
    together (the step's total peaks in forward, with the activations, before AdamW's state exists)."""
    class Tracker(tracker_class):
        def __init__(self, *args):
            super().__init__(*args)
            self.held_peak: dict = {}

        def _update_peak_stats(self, peak_state) -> None:  # after every operator's allocations
            super()._update_peak_stats(peak_state)
            for device, snapshot in self._curr_mem_snap.items():
                held = {kind_name(k): int(n) for k, n in snapshot.items() if kind_name(k) in HELD}
                if sum(held.values()) > sum(self.held_peak.get(device, {}).values()):
                    self.held_peak[device] = held
    return Tracker


def model_config(shape: dict):
    from rlcore.models.transformer import ModelConfig

    return ModelConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"])


def step_memory(rank: int, init_file: str, out_dir: str, mode: str, device_type: str, shape: dict = SHAPE,
                rows: int = ROWS, prompt: int = PROMPT, completion: int = COMPLETION) -> None:
    """One optimizer step on this rank; writes the bytes of each HELD category where their sum peaks."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from rlcore.parallel import collectives, fsdp
    from rlcore.forward import completion_logprobs
    from rlcore.models.transformer import Transformer
    from rlcore.config.options import TrainArgs
    from rlcore.run.setup import adamw

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = Transformer(model_config(shape))
    model.to(device)
    if mode == "fsdp":
        fsdp.shard(model, WORLD, device, bf16=False)
    opt = adamw(model, TrainArgs(learning_rate=1e-5))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, shape["vocab_size"], (rows, prompt + completion), generator=g).to(device)
    attn = torch.ones_like(ids)

    tracker = peak_of_held(FSDPMemTracker)(model, opt) if mode == "fsdp" else peak_of_held(MemTracker)()
    if mode != "fsdp":
        tracker.track_external(model, opt)
    with tracker:
        logp, _ = completion_logprobs(model, ids, attn, prompt, ids[:, prompt:])
        fsdp.sync_gradients(model, last=True)
        (-logp.mean()).backward()
        collectives.average_gradients(model, WORLD)
        fsdp.clip_grad_norm_(model, 1.0)
        opt.step()
    torch.save(tracker.held_peak[device], os.path.join(out_dir, f"{mode}-{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown, where gloo's last work could abort the process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--rows", type=int, default=ROWS, help="completions per rank")
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=COMPLETION, help="completion tokens")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in ("replicated", "fsdp"):
            mp.spawn(step_memory, args=(str(Path(tmp) / f"init-{mode}"), tmp, mode, args.device, shape, args.rows,
                                        args.prompt, args.completion), nprocs=WORLD)
            results[mode] = [torch.load(Path(tmp) / f"{mode}-{rank}.pt") for rank in range(WORLD)]
    with torch.device("meta"):
        from rlcore.models.transformer import Transformer
        n_params = sum(p.numel() for p in Transformer(model_config(shape)).parameters())
    print(f"{n_params / 1e6:.1f}M parameters (fp32), {WORLD} ranks on {args.device}, {args.rows} completions of "
          f"{args.prompt} + {args.completion} tokens per rank, one optimizer step; MiB where parameters, gradients and "
          f"optimizer state peak together, per rank:")
    for mode, ranks in results.items():
        for rank, held in enumerate(ranks):
            parts = ", ".join(f"{kind.lower()} {n / 2**20:.1f}" for kind, n in sorted(held.items()) if n)
            print(f"  {mode:10s} rank {rank}: {sum(held.values()) / 2**20:8.1f} MiB  ({parts})")
    totals = {mode: sum(ranks[0].values()) for mode, ranks in results.items()}
    print(f"fsdp_rank_mem_ratio={totals['fsdp'] / totals['replicated']:.3f}")


if __name__ == "__main__":
    main()
