"""Data parallelism over P ranks, the plain way: every rank holds the whole model, generates and
trains on its own slice of each round, and gradients are averaged with all-reduces over flat
buckets of about 25 MiB before each optimizer step (what DDP does, without overlapping the
all-reduce with backward).

Launch with `torchrun --nproc_per_node=P -m rlcore.cli train ...`; without torchrun every
function here is a no-op for a single rank. gloo on CPU, NCCL on GPU. With train.fsdp the model
is sharded instead (rlcore.parallel.fsdp): FSDP's own collectives reduce its gradients, and the two
functions here that would all-reduce whole weights or gradients leave such a model alone.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist

from rlcore.parallel.fsdp import is_sharded


def init(device: torch.device, cpu_collectives: bool = False) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device); starts the process group under torchrun. On CUDA
    with `cpu_collectives` (train.fsdp_offload: shards, gradients and their norm in CPU memory) the
    group also gets gloo for CPU tensors, since NCCL has no CPU backend."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, device
    if device.type == "cuda":
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:
            error = ValueError(f"torchrun started local rank {local}, but this machine has {count} CUDA "
                               f"device(s): one rank per GPU, so --nproc_per_node={count} at most (or "
                               f"--set train.device=cpu)")
            error.rank_local = True  # rank 0 may have a GPU: this rank says it
            raise error
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        cuda_backend = "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
        dist.init_process_group(cuda_backend if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


_ended_group = False  # close() ended a process group in this process: leave() skips the teardown
_trainers = None  # the process group of the training ranks (None: every rank; rlcore.parallel.sampler_ranks)


def train_among(group) -> None:
    """Run this module's collectives in `group`: the ranks that train, when others only sample."""
    global _trainers
    _trainers = group


def close() -> None:
    """End the process group `init` started (a no-op without one)."""
    global _ended_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _ended_group = True


def leave(code: int) -> int:
    """The CLI's exit status `code`; in a process that ran a process group (a torchrun rank), exit
    with it here, after the atexit handlers (a user's logger) and a flush of stdout and stderr,
    without the interpreter's teardown.

    In that teardown a gloo worker thread can still be dropping the last collective's work, whose
    tensor has a Python object: the GIL it takes there ends the process with 'terminate called
    without an active exception' (SIGABRT), a failed job after a run that finished. A core dump
    showed it. Ending the process group first, with a barrier before that, makes it rarer but not
    impossible (about 1 run in 60 of a 2-rank test); skipping the teardown removed it (0 in 140).
    Files a reward function left open and unflushed are not flushed then: close them."""
    if not _ended_group:
        return code
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def gather_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate equal-shaped `[n, ...]` tensors of all ranks in rank order: `[world * n, ...]`."""
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_trainers)
    return torch.cat(parts)


def gather_uneven(x: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate the 1-D tensors of all ranks in rank order, whatever their lengths:
    `[sum of the lengths]` (the entropy mask's quantile over every rank's valid tokens)."""
    if world == 1:
        return x
    # a sync point: the padding needs the longest length on the host
    sizes = gather_rows(torch.tensor([x.numel()], device=x.device), world).tolist()
    padded = x.new_zeros(max(sizes))
    padded[: x.numel()] = x
    rows = gather_rows(padded, world).view(world, -1)
    return torch.cat([row[:n] for row, n in zip(rows, sizes)])


def sum_over_ranks(values: list[float], world: int, device: torch.device | None) -> list[float]:
    """Each number summed over ranks, all in one all-reduce (token counts, metric sums)."""
    return _all_reduce(values, world, device, dist.ReduceOp.SUM)


def max_over_ranks(values: list[float], world: int, device: torch.device | None) -> list[float]:
    """Each number's maximum over ranks, all in one all-reduce."""
    return _all_reduce(values, world, device, dist.ReduceOp.MAX)


def _all_reduce(values: list[float], world: int, device: torch.device | None, op) -> list[float]:
    if world == 1 or not values:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=_trainers)
    return t.tolist()


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def average_gradients(model: torch.nn.Module, world: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each gradient by its mean over ranks.

    Gradients are copied into flat buckets of about `bucket_bytes` (one dtype per bucket), each
    all-reduced once and copied back: every collective has a fixed latency, so a 0.5B model
    takes ~80 all-reduces instead of one per parameter (~290). Every rank holds the same
    parameters with gradients, so all ranks form the same buckets in the same order. A sharded
    model's gradients were reduce-scattered in its step's last backward: nothing is left to do.
    """
    if world == 1 or is_sharded(model):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0  # bytes in `bucket`
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if i + 1 == len(grads) or size >= bucket_bytes or grads[i + 1].dtype != g.dtype:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=_trainers)
            flat /= world
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0


def check_replicas_agree(model: torch.nn.Module, world: int) -> None:
    """Raise if the ranks' weights have drifted apart (a checksum per rank, compared); a sharded
    model's ranks hold different shards by design."""
    if world == 1 or is_sharded(model):
        return
    total = sum(p.detach().double().sum() for p in model.parameters()).reshape(1)
    sums = gather_rows(total, world)
    if not torch.all(sums == sums[0]):
        raise RuntimeError(f"data-parallel replicas disagree (weight checksums {sums.tolist()}); "
                           "every rank must apply the same averaged gradients")


def barrier(world: int) -> None:
    """Wait until every rank gets here."""
    if world > 1:
        dist.barrier(group=_trainers)


def barrier_all() -> None:
    """Wait until every launched rank gets here, those that only sample too (a no-op without a group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def gather_objects(obj, world: int) -> list:
    """`[obj of rank 0, obj of rank 1, ...]` on every rank."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=_trainers)
    return out


def raise_together(error: Exception | None, world: int) -> None:
    """Raise on every rank when any rank has an error (None: this rank has none): the first such
    rank's error, of its type, with its message and "(on rank r)". An error on one rank alone
    would leave the others waiting at their next collective, to fail there with a transport
    traceback that buries it. Rank 0 has it too, so the command line prints it once, from rank 0;
    a RewardFunctionError keeps its `trace`."""
    if world == 1:
        if error is not None:
            raise error
        return
    report = None if error is None else (type(error), str(error), getattr(error, "trace", ""))
    for rank, got in enumerate(gather_objects(report, world)):
        if got is None:
            continue
        kind, message, trace = got
        try:
            shared = kind(f"{message} (on rank {rank})")
        except TypeError:  # an exception class that takes other arguments
            shared = RuntimeError(f"{kind.__name__}: {message} (on rank {rank})")
        shared.trace = trace
        raise shared from error


def concat_over_ranks(lists: dict[str, list], world: int) -> dict[str, list]:
    """`{key: rank 0's list + rank 1's list + ...}` on every rank; a key may be missing on some."""
    if world == 1:
        return lists
    out: dict[str, list] = {}
    for part in gather_objects(dict(lists), world):
        for key, values in part.items():
            out.setdefault(key, []).extend(values)
    return out
