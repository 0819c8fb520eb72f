"""Hugging Face checkpoints in and out: config.json + safetensors (single file or sharded).

Loading builds the model on the meta device (no memory), then assigns the tensors read from
disk, converted one at a time to the requested dtype: the process never holds a second full
copy of the weights. Saving writes the same layout transformers writes, so
`AutoModelForCausalLM.from_pretrained(path)` loads an rlcore checkpoint back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlcore.model import ModelConfig, Transformer, rope_inv_freq
from rlcore.tokenizer import checkpoint_dir_problem
from rlcore.tokenizer import read_json as read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and problem."""


def read_json(path: Path) -> dict:
    """One JSON object from a file of the checkpoint (callers check that it exists)."""
    try:
        return read_json_object(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if problem := checkpoint_dir_problem(path):
        raise CheckpointError(problem)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing config.json; a Hugging Face checkpoint directory "
                              "holds config.json, model.safetensors and tokenizer.json")
    try:
        return ModelConfig.from_hf(read_json(cfg_file), source=str(cfg_file))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
                              "are supported; convert .bin checkpoints with transformers first)")
    try:
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: unreadable safetensors file ({e}); is it truncated?") from None


def load_model(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu") -> Transformer:
    """Load a Llama / Qwen2 / Qwen3 checkpoint directory into an rlcore `Transformer`."""
    path = Path(path)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cfg = load_config(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    files = weight_files(path)
    names = set(files)
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")  # some exporters write the tied copy; it is ignored
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: tensor names do not match a {cfg.model_type} model with this config.json: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    state = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name not in expected:
                        continue
                    t = f.get_tensor(name)
                    if t.shape != expected[name]:
                        raise CheckpointError(f"{file}: tensor {name} has shape {tuple(t.shape)}, "
                                              f"config.json implies {tuple(expected[name])}")
                    state[name] = t.to(dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e}); is it truncated?") from None
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # non-persistent buffer: rebuild off meta
    return model


def state_dict_for_save(model: Transformer) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_model(model: Transformer, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
               extra_files: dict[str, str | os.PathLike] | None = None) -> Path:
    """Write `model` as a Hugging Face checkpoint directory, atomically.

    Everything goes into `<path>.tmp` first and is renamed into place at the end, so a crash
    mid-save never leaves a half-written `path`. Above `max_shard_bytes` the weights are sharded
    with a `model.safetensors.index.json`. `extra_files` (name -> source path) are copied in too
    (tokenizer files, generation_config.json).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = state_dict_for_save(model)
    shards, size = [[]], 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(sd, tmp / SINGLE_FILE, metadata=meta)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: sd[n] for n in names}, tmp / fname, metadata=meta)
            weight_map.update({n: fname for n in names})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        with open(tmp / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(model.config.raw)
    dtype_name = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    config["torch_dtype"] = dtype_name
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / name)
    fsync_dir(tmp)
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)
    return path


def fsync_dir(path: Path) -> None:
    """Flush every file in `path` to disk before it is renamed into place."""
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
