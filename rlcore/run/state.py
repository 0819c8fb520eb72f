"""The run's own state, and how it is kept on disk in a form that loads without running code.

`RunState` is what changes as the run goes besides the weights and the optimizer: the step, the
data position, the non-finite counters, the first evaluation, the sampler and shuffler RNGs and
the entropy-bonus controller. A checkpoint keeps it with the optimizer and schedule.

A checkpoint's trainer state (optimizer, schedule, RNG states, step, data position, counters) is
nested dicts and lists of tensors, numbers and strings. It is written as two files: the tensors in
`run_state.safetensors`, and everything else in `run_state.json`, where each tensor stands as
{"tensor": "<its key in the safetensors file>"}. Neither format can carry code, unlike the pickle
`torch.save` writes, so a run directory from someone else resumes without trusting it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.amp import GradScaler

from rlcore.config.options import Config
from rlcore.losses.entropy import EntropyBonus

STATE_JSON, STATE_TENSORS = "run_state.json", "run_state.safetensors"
PICKLED_STATE = "trainer_state.pt"  # an unreleased rlcore's pickle, refused: unpickling can run code


class StateFileError(ValueError):
    """A trainer state that cannot be read; the message names the file."""


def _encode(obj, tensors: dict[str, torch.Tensor]):
    """obj as JSON values, its tensors moved into `tensors`. Tuples and dicts with keys other than
    strings (the optimizer state's parameter indices) are tagged, so they come back as they were."""
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not {"tensor", "tuple", "items"} & set(obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"the trainer state holds a {type(obj).__name__}, which {STATE_JSON} cannot store")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {"tensor"}:
        return tensors[obj["tensor"]]
    if set(obj) == {"tuple"}:
        return tuple(_decode(v, tensors) for v in obj["tuple"])
    if set(obj) == {"items"}:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["items"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def write_state(directory: Path, state: dict) -> None:
    """Write `state` into `directory` as run_state.json + run_state.safetensors."""
    tensors = {}
    encoded = _encode(state, tensors)
    save_file(tensors, directory / STATE_TENSORS)
    with open(directory / STATE_JSON, "w") as f:
        json.dump(encoded, f)
        f.flush()
        os.fsync(f.fileno())


def has_state(directory: Path) -> bool:
    """Whether `directory` holds an rlcore trainer state."""
    return (directory / STATE_JSON).is_file()


def read_state(directory: Path) -> dict:
    """The trainer state `write_state` wrote into `directory`."""
    if not (directory / STATE_JSON).is_file() and (directory / PICKLED_STATE).is_file():
        raise StateFileError(f"{directory / PICKLED_STATE} is a pickled trainer state, which rlcore does not read "
                             f"(unpickling can run code); it resumes checkpoints with {STATE_JSON}")
    try:
        with open(directory / STATE_JSON) as f:
            encoded = json.load(f)
    except (OSError, ValueError) as e:
        raise StateFileError(f"{directory / STATE_JSON} cannot be read ({type(e).__name__}: {e})") from e
    try:
        tensors = load_file(directory / STATE_TENSORS)
    except (OSError, SafetensorError) as e:
        raise StateFileError(f"{directory / STATE_TENSORS} cannot be read ({type(e).__name__}: {e})") from e
    try:
        return _decode(encoded, tensors)
    except KeyError as e:
        raise StateFileError(f"{directory / STATE_JSON} names tensor {e} that {STATE_TENSORS} lacks") from None


@dataclass
class RunState:
    """The run's counters and RNGs; `state_dict` gives a checkpoint's keys (with the optimizer's and
    the schedule's), `load_state_dict` restores them on --resume."""
    sampler: torch.Generator  # rollout sampling, one stream per rank
    shuffler: torch.Generator  # the micro-batch order, the same on every rank
    bonus: EntropyBonus  # loss.entropy_coef, and its controller's state when adaptive
    step: int = 0  # optimizer steps taken (skipped ones included)
    data_pos: int = 0  # prompts drawn so far from the endlessly reshuffled training set
    nonfinite_in_row: int = 0  # skipped optimizer steps in a row; train.max_nonfinite_steps stops the run
    nonfinite_total: int = 0
    before: float | None = None  # held-out accuracy before the first step
    scaler: GradScaler = field(default_factory=lambda: GradScaler("cpu", enabled=False))
    """train.fp16's dynamic loss scale (disabled otherwise)"""
    overflow_skips: int = 0  # fp16 steps skipped while the loss scale calibrates (not non-finite steps)

    @classmethod
    def new(cls, cfg: Config, rank: int, device: torch.device) -> RunState:
        """The state of a run before its first step, on rank `rank`."""
        loss_cfg = cfg.loss
        return cls(sampler=torch.Generator(device=device).manual_seed(cfg.rollout.seed + rank),  # rollout sampling
                   shuffler=torch.Generator(device=device).manual_seed(cfg.train.seed),  # micro-batch order
                   bonus=EntropyBonus(loss_cfg.entropy_coef, loss_cfg.use_adaptive_entropy, loss_cfg.entropy_target,
                                      loss_cfg.entropy_coef_delta, loss_cfg.entropy_coef_min,
                                      loss_cfg.entropy_coef_max),
                   scaler=GradScaler(device.type, enabled=cfg.train.fp16))  # fp16's dynamic loss scale

    def resume_point(self) -> dict:
        """Where the next round starts (data position and RNGs): what a checkpoint continues from."""
        return {"data_pos": self.data_pos, "sampler": self.sampler.get_state(), "shuffler": self.shuffler.get_state(),
                "torch": torch.get_rng_state()}

    def state_dict(self, resume_point: dict, samplers: list[torch.Tensor]) -> dict:
        """The checkpoint's trainer state, to continue from `resume_point` with every rank's
        sampler state `samplers`."""
        return {"sampler_rng": samplers, "shuffler_rng": resume_point["shuffler"], "torch_rng": resume_point["torch"],
                "step": self.step, "data_pos": resume_point["data_pos"], "nonfinite_total": self.nonfinite_total,
                "nonfinite_in_row": self.nonfinite_in_row, "before": self.before,
                "entropy_bonus": self.bonus.state_dict() if self.bonus.adaptive else None,
                "grad_scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "overflow_skips": self.overflow_skips,
                # asynchronous rollouts: the weights fixed for the rounds sampled ahead (rollout.sources)
                "sampler_weights": resume_point.get("sampler_weights")}

    def load_state_dict(self, saved: dict, rank: int) -> None:
        """Restore the saved state on rank `rank`. A sharded checkpoint resumes on any rank count:
        a rank the saved run did not have keeps its own sampler seed (rollout.seed + rank)."""
        if rank < len(saved["sampler_rng"]):
            self.sampler.set_state(saved["sampler_rng"][rank])
        self.shuffler.set_state(saved["shuffler_rng"])
        torch.set_rng_state(saved["torch_rng"])
        self.step, self.data_pos, self.before = saved["step"], saved["data_pos"], saved["before"]
        self.nonfinite_total, self.nonfinite_in_row = saved["nonfinite_total"], saved["nonfinite_in_row"]
        if self.bonus.adaptive and saved["entropy_bonus"]:  # the controller's state (static: the config's)
            self.bonus.load_state_dict(saved["entropy_bonus"])
        if self.scaler.is_enabled() and saved["grad_scaler"]:
            self.scaler.load_state_dict(saved["grad_scaler"])
        self.overflow_skips = saved["overflow_skips"]
