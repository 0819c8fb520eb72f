"""A run's trainer state on disk, in a form that loads without running code.

A checkpoint's trainer state (optimizer, schedule, RNG states, step, data position, counters) is
nested dicts and lists of tensors, numbers and strings. It is written as two files: the tensors in
`run_state.safetensors`, and everything else in `run_state.json`, where each tensor stands as
{"tensor": "<its key in the safetensors file>"}. Neither format can carry code, unlike the pickle
`torch.save` writes, so a run directory from someone else resumes without trusting it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

STATE_JSON, STATE_TENSORS = "run_state.json", "run_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # earlier rlcore's pickle: read with torch.load(weights_only=True)


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
    """Whether `directory` holds an rlcore trainer state (this version's, or an earlier one's)."""
    return (directory / STATE_JSON).is_file() or (directory / LEGACY_STATE).is_file()


def state_file(directory: Path) -> Path:
    """The file that names `directory`'s trainer state in messages."""
    return directory / (STATE_JSON if (directory / STATE_JSON).is_file() else LEGACY_STATE)


def read_state(directory: Path) -> dict:
    """The trainer state `write_state` wrote into `directory`; an earlier rlcore's trainer_state.pt is
    read with torch.load(weights_only=True), which refuses any object but tensors and plain containers."""
    if not (directory / STATE_JSON).is_file():
        file = directory / LEGACY_STATE
        try:
            return torch.load(file, weights_only=True)
        except Exception as e:  # a damaged file fails inside zipfile; a pickle of other objects is refused
            raise StateFileError(f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})") from e
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
