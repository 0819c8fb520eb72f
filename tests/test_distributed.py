"""Data parallelism over 2 gloo processes: gradient averaging (every gradient becomes the exact mean of
the ranks'), and the embedded default built once."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import exit_spawned_rank
from rlcore.distributed import average_gradients


def model_with_grads(rank: int) -> torch.nn.Module:
    """Mixed shapes and dtypes, and one parameter without a gradient; grads differ per rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False), torch.nn.Linear(3, 2))
    model[1].double()
    g = torch.Generator().manual_seed(100 + rank)
    for name, p in model.named_parameters():
        if name != "2.bias":
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return model


def _average_on_rank(rank, init_file, out_dir, bucket_bytes):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = model_with_grads(rank)
    average_gradients(model, 2, bucket_bytes=bucket_bytes)
    torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    exit_spawned_rank()  # conftest: the last all-reduce's tensor could abort the process at exit


def check_average(tmp_path, bucket_bytes):
    mp.spawn(_average_on_rank, args=(str(tmp_path / "init"), str(tmp_path), bucket_bytes), nprocs=2)
    want = {n: None if p.grad is None else (p.grad + q.grad) / 2
            for (n, p), q in zip(model_with_grads(0).named_parameters(), model_with_grads(1).parameters())}
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        for n, w in want.items():
            if w is None:
                assert got[n] is None, n
            else:
                # exact: a sum of two terms rounds the same in either order, and / 2 is exact
                assert got[n].dtype == w.dtype and torch.equal(got[n], w), (rank, n)


def test_gradients_averaged_with_one_parameter_per_bucket(tmp_path):
    check_average(tmp_path, bucket_bytes=1)


def test_gradients_averaged_with_everything_in_few_buckets(tmp_path):
    check_average(tmp_path, bucket_bytes=2**20)  # buckets split only where the dtype changes


# ---- the embedded default under torchrun ----

def _embedded_dir_on_rank(rank, init_file, out_dir, cache):
    """Every rank asks for the embedded model at once; the builder records who built it."""
    import time
    from pathlib import Path

    import rlcore.train
    from rlcore.config import load_config

    def build(path, pool):  # stands in for the 800-step SFT
        if path.exists():
            (Path(out_dir) / f"{rank}.txt").write_text("cached")
        else:
            time.sleep(1.0)
            path.mkdir(parents=True)
            (Path(out_dir) / f"{rank}.txt").write_text("built")
        return path

    os.environ["RLCORE_CACHE"] = cache
    rlcore.train.build_embedded_model = build
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rlcore.train.embedded_model_dir(load_config(None, []), rank, 2)
    dist.destroy_process_group()


def test_rank_0_builds_the_embedded_model_while_the_others_wait(tmp_path):
    """Without the wait every rank built it at once, and the first to finish removed the others'
    build files under them: the first torchrun of the default failed."""
    mp.spawn(_embedded_dir_on_rank, args=(str(tmp_path / "init"), str(tmp_path), str(tmp_path / "cache")), nprocs=2)
    assert [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)] == ["built", "cached"]


LEAVE = """
import atexit, sys
from rlcore import distributed
assert distributed.leave(5) == 5  # no process group in this process: the status comes back
distributed._ended_group = True  # as after close() under torchrun
atexit.register(lambda: print("atexit handler ran"))
print("output before", end="")
distributed.leave(3)
print("not reached")
"""


def test_a_rank_leaves_with_its_status_after_the_atexit_handlers_and_flushed_output():
    out = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (3, "output beforeatexit handler ran\n", "")
