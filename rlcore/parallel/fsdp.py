"""Fully sharded data parallelism (train.fsdp): PyTorch's FSDP2 over torchrun's ranks.

Replicated data parallelism (rlcore.parallel.collectives) keeps the whole model, its gradients and AdamW's
two moments on every rank: 16 bytes per fp32 parameter, whatever the rank count. Here each rank
keeps 1/P of each: `shard` wraps every transformer block, then the root (embedding, final norm,
output projection), with `fully_shard` on a 1-D device mesh. A block's full weights exist only
while it computes (one all-gather in forward, one in backward); its gradients are
reduce-scattered so that each rank keeps the mean of its 1/P, and AdamW steps the shards.

What the loop needs besides a model that computes as before, each in one function here:

- `sync_gradients`: the gradients of an optimizer step's several backwards (micro-batches, the
  shared prompt pass) accumulate unreduced, and the step's last backward reduce-scatters the sum
  once, as the replicated mode all-reduces once per step.
- The root keeps its parameters gathered from its forward until its backward, so the chunked
  log-probs, which read `lm_head_weight` after the forward returns, read the full matrix (read at
  another time it is a DTensor shard, and their matmul raises: it is never silently a shard).
- `EngineCopy`: the rollout engine decodes token by token, with rows that stop at other steps on
  every rank; it runs on a plain copy of the model whose full weights are gathered once per
  rollout (and freed after it), never through FSDP's per-layer gathers.
- `save_shards` / `load_shards`: the trainable weights and the optimizer state written with
  torch.distributed.checkpoint, each rank its shards; loading reshards to the loader's rank count
  (one process included).

FSDP2 rebuilds a dataclass among a module's arguments to hook the tensors in it; a `PrefixKV`
must stay the caller's object (the blocks append their keys and values to it), so `shard` hides
it from FSDP's hooks and gives it back to the module.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlcore.models.transformer import PrefixKV, Transformer

# torch.distributed's fsdp, tensor and checkpoint packages are imported by the functions that use
# them: importing them takes over a second, which every process of a replicated run would pay.


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard` wrapped `model` (without importing FSDP: a model it wrapped has imported it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


class _Hidden:
    """A PrefixKV out of FSDP's sight: it rebuilds dataclasses, not this."""
    __slots__ = ("prefix",)

    def __init__(self, prefix: PrefixKV):
        self.prefix = prefix


def _hide_prefix(module, args, kwargs):
    def hide(x):
        return _Hidden(x) if isinstance(x, PrefixKV) else x
    return tuple(map(hide, args)), {k: hide(v) for k, v in kwargs.items()}


def _show_prefix(module, args, kwargs):
    def show(x):
        return x.prefix if isinstance(x, _Hidden) else x
    return tuple(map(show, args)), {k: show(v) for k, v in kwargs.items()}


def _fully_shard(module: nn.Module, mesh, policy, offload, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    # around FSDP's own pre-forward hook: hidden before it, shown again after it
    module.register_forward_pre_hook(_hide_prefix, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(_show_prefix, with_kwargs=True)


def shard(model: Transformer, world: int, device: torch.device, bf16: bool, offload: bool = False,
          group=None) -> Transformer:
    """Wrap each block of `model`, then the root, with FSDP2 over `world` ranks (those of `group`,
    when others only sample: rlcore.parallel.sampler_ranks; None: every rank), in place; with
    `bf16`, blocks compute with bf16 copies of the fp32 shards and reduce gradients in fp32; with
    `offload`, the shards, their gradients and AdamW's state live in CPU memory (AdamW steps there)
    and each block's are copied to `device` for its forward and backward. The root keeps its
    parameters gathered after its forward (see the module docstring), and every backward
    accumulates without reducing until `sync_gradients` says it is a step's last."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mesh = init_device_mesh(device.type, (world,)) if group is None else DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 else None)
    placement = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for block in model.model.layers:
        _fully_shard(block, mesh, policy, placement, reshard_after_forward=True)
    _fully_shard(model, mesh, policy, placement, reshard_after_forward=False)
    model.set_requires_gradient_sync(False)
    return model


def sync_gradients(model: nn.Module, last: bool) -> None:
    """Say whether the next backward is the optimizer step's last: FSDP reduce-scatters the
    gradients accumulated over the step's backwards in that one, and in no other (a no-op for a
    model that is not sharded: the replicated mode all-reduces in the optimizer step)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over `model`'s parameters; the norm of sharded gradients (their
    squares summed over the ranks) comes back as a plain tensor, the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if is_sharded(model) else norm


def reshard(model: nn.Module) -> None:
    """Free the root's gathered parameters after a forward that no backward follows (the KL
    reference's passes); a no-op for a model that is not sharded."""
    if is_sharded(model):
        model.reshard()


class EngineCopy:
    """A plain copy of a sharded model for the rollout engine: the module tree with its
    parameters on the meta device (no memory), filled with the full weights for one rollout.

        engine = EngineCopy(model)   # before `shard`
        with engine.gathered(model) as plain: rollout.generate(plain, ...)
    """

    def __init__(self, model: Transformer):
        # deepcopy with each parameter already "copied" to an empty meta tensor: the buffers
        # (RoPE frequencies, LoRA's reference adapters) are copied, the weights are not
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                for p in model.parameters()}
        self.model = copy.deepcopy(model, memo)

    def _assign(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in weights.items():
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)

    @contextlib.contextmanager
    def gathered(self, model: nn.Module):
        """The copy with `model`'s full weights, gathered once (one all-gather per parameter on
        every rank); they are freed when the block ends."""
        from torch.distributed.tensor import DTensor

        reshard(model)  # after a forward without backward the root holds gathered (perhaps bf16) copies
        device = self.model.inv_freq.device  # the compute device, where offloaded shards are not
        with torch.no_grad():
            full = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(device)
                    for name, p in model.named_parameters()}
        self._assign(full)
        del full
        try:
            yield self.model.train(model.training)
        finally:
            self._assign({name: torch.empty_like(p, device="meta") for name, p in self.model.named_parameters()})


# ---- checkpoints: torch.distributed.checkpoint (DCP) ----

SHARDS = "sharded"
"""A sharded checkpoint's DCP directory (every rank's files and DCP's .metadata)."""


@contextlib.contextmanager
def _one_process_quietly():
    """Without a process group DCP warns that it assumes one process: what rlcore means then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The trainable weights and the optimizer state, keyed by parameter name (sharded tensors
    under FSDP, plain ones otherwise). LoRA's frozen base is not written: it is model.path's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer = get_state_dict(model, opt)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in weights.items() if k in trainable}, "optimizer": optimizer}


def _process_group(model: nn.Module):
    """The process group `model` is sharded over (None: a model that is not sharded)."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    return None if mesh is None else mesh.get_group()


def save_shards(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Write the trainable weights and the optimizer state into `directory` with DCP; every rank
    calls it and writes its own shards (collective when a process group runs)."""
    import torch.distributed.checkpoint as dcp

    with _one_process_quietly():
        dcp.save(_state(model, opt), checkpoint_id=directory, no_dist=not dist.is_initialized(),
                 process_group=_process_group(model))


def load_shards(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load what `save_shards` wrote into `model` and `opt`, resharded to this run's ranks (a
    checkpoint of 2 ranks loads on 1, sharded or not)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _state(model, opt)
    with _one_process_quietly():
        dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized(),
                 process_group=_process_group(model))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=False))


def load_weights(directory: Path, model: nn.Module) -> None:
    """Load the weights `save_shards` wrote into a plain `model` in one process (rlcore export)."""
    import torch.distributed.checkpoint as dcp

    weights = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    with _one_process_quietly():
        dcp.load({"model": weights}, checkpoint_id=directory, no_dist=True)
