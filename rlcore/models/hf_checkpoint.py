"""Hugging Face checkpoints in and out: config.json + safetensors (single file or sharded).

Loading builds the model on the meta device (no memory), then assigns the tensors read from
disk, converted one at a time to the requested dtype: the process never holds a second full
copy of the weights. Saving writes the same layout transformers writes, so
`AutoModelForCausalLM.from_pretrained(path)` loads an rlcore checkpoint back.
A run directory's checkpoints, which hold a model in this format, are rlcore.run.rundir's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlcore import RlcoreWarning
from rlcore.models.tokenizer import checkpoint_dir_problem
from rlcore.models.tokenizer import read_json as read_json_object
from rlcore.models.transformer import ModelConfig, Transformer, rope_inv_freq

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORED_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}  # safetensors' names


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and problem."""


def read_json(path: Path) -> dict:
    """One JSON object from a file of the checkpoint (callers check that it exists)."""
    try:
        return read_json_object(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_model_dir(path: Path) -> None:
    """Name the directories users give for a model that are something else: an rlcore checkpoint
    or run directory (the model is inside), a LoRA adapter, a path that does not exist."""
    if problem := checkpoint_dir_problem(path):
        raise CheckpointError(problem)
    for name in ("config.json", "tokenizer.json"):
        if is_lfs_pointer(path / name):
            raise CheckpointError(f"{path / name} is a Git LFS pointer, not the file: fetch the files (git lfs pull "
                                  f"in the clone, or hf download)")
    if (path / "config.json").is_file():
        return
    if (path / "model" / "config.json").is_file() and (path / "run_state.json").is_file():
        raise CheckpointError(f"{path} is an rlcore checkpoint; its model is {path / 'model'}: give that directory "
                              f"(or continue its run with --resume {path.parent})")
    if (path / "latest").is_file():
        raise CheckpointError(f"{path} is an rlcore run directory; its newest model is "
                              f"{path / (path / 'latest').read_text().strip() / 'model'}: give that directory")
    if (path / "adapter_config.json").is_file():
        raise CheckpointError(f"{path} is a LoRA adapter (adapter_config.json), not a model; train from it with "
                              f"--set lora.enabled=true --set lora.adapter_path={path} and model.path = its base "
                              f"model (adapter_config.json's base_model_name_or_path)")
    raise CheckpointError(f"{path / 'config.json'}: missing config.json; a Hugging Face checkpoint directory "
                          "holds config.json, model.safetensors and tokenizer.json")


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of the checkpoint directory `path` (its config.json)."""
    path = Path(path)
    check_model_dir(path)
    cfg_file = path / "config.json"
    try:
        return ModelConfig.from_hf(read_json(cfg_file), source=str(cfg_file))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


@contextlib.contextmanager
def open_weights(file: Path, device: torch.device | str = "cpu"):
    """`safe_open(file)`, with a file safetensors cannot read reported as a CheckpointError."""
    try:
        with safe_open(file, framework="pt", device=str(device)) as f:
            yield f
    except (SafetensorError, OSError) as e:
        if is_lfs_pointer(file):
            raise CheckpointError(f"{file} is a Git LFS pointer, not the weights: fetch them (git lfs pull in "
                                  f"the clone, or hf download)") from None
        raise CheckpointError(f"{file}: unreadable safetensors file ({e}); is it truncated?") from None


def is_lfs_pointer(file: Path) -> bool:
    """A clone without `git lfs pull` holds a small text file where the weights should be."""
    try:
        with open(file, "rb") as f:
            return f.read(23) == b"version https://git-lfs"
    except OSError:
        return False


def weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it.

    With an index, the shards are the files its weight_map lists, and each tensor is found by
    reading their headers, as transformers does: an entry that names the wrong shard, or a tensor
    the index leaves out, still loads (where two shards hold a tensor, the index's one wins)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        shards = sorted({path / f for f in weight_map.values()})
        files = {}
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} is missing")
            with open_weights(shard) as f:
                for name in f.keys():
                    if name not in files or path / weight_map.get(name, "") == shard:
                        files[name] = shard
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
                              "are supported; convert .bin checkpoints with transformers first)")
    with open_weights(single) as f:
        return {name: single for name in f.keys()}


def listed(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def stored_names(files: dict[str, Path]) -> dict[str, str]:
    """Map each parameter name of the model to its name in the files, as transformers does:
    a base-model checkpoint (`embed_tokens.weight`, `layers.0...`, no `model.` prefix) gets the
    prefix, and the RoPE `rotary_emb.inv_freq` buffers older exporters saved are dropped."""
    names = [n for n in files if not n.endswith("rotary_emb.inv_freq")]
    base_model = not any(n.startswith("model.") for n in names)
    return {(f"model.{n}" if base_model and n != "lm_head.weight" else n): n for n in names}


def tied_copy_differs(files: dict[str, Path], stored: dict[str, str]) -> bool:
    """Whether a tied checkpoint also stores an `lm_head.weight` that is not the embedding."""
    if "lm_head.weight" not in stored or "model.embed_tokens.weight" not in stored:
        return False
    tensors = []
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        with open_weights(files[stored[name]]) as f:
            tensors.append(f.get_tensor(stored[name]))
    return tensors[0].shape != tensors[1].shape or not torch.equal(*tensors)


def resolve_dtype(dtype: str, path: str | os.PathLike) -> str:
    """model.dtype as a dtype name: 'auto' is the checkpoint's own, as transformers' dtype="auto"
    reads it: config.json's `dtype` (or `torch_dtype`), else the dtype of the first floating-point
    tensor of the first weight file."""
    if dtype != "auto":
        return dtype
    raw = load_model_config(path).raw
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        with open_weights(min(weight_files(Path(path)).values())) as f:
            stored = [f.get_slice(key).get_dtype() for key in f.keys()]
        name = next((STORED_FLOATS[d] for d in stored if d in STORED_FLOATS), "float32")
    if name not in ("float32", "bfloat16"):
        raise CheckpointError(f"{Path(path) / 'config.json'}: model.dtype = 'auto' takes its dtype {name!r}, which "
                              f"rlcore does not train in; set model.dtype = 'float32' (or 'bfloat16')")
    return name


def load_model(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", model_class: type[Transformer] = Transformer) -> Transformer:
    """Load a Llama / Qwen2 / Qwen3 checkpoint directory into an rlcore `Transformer` (or
    `model_class`, a subclass with another head: classifier.py's).

    Tensor names follow transformers' rules: a tied config ignores a stored copy of the
    embedding as `lm_head.weight`, but a different stored `lm_head.weight` unties the model (with
    a warning, as transformers does); tensors the model has no place for are skipped with a
    warning; a missing tensor is an error.
    """
    path = Path(path)
    dtype = DTYPES[resolve_dtype(dtype, path)] if isinstance(dtype, str) else dtype  # a name, or 'auto'
    cfg = load_model_config(path)
    files = weight_files(path)
    stored = stored_names(files)
    if cfg.tie_word_embeddings and tied_copy_differs(files, stored):
        warnings.warn(f"{path}: config.json ties lm_head to embed_tokens, but the checkpoint stores a "
                      "different lm_head.weight; loading it untied, as transformers does (a saved copy "
                      "says tie_word_embeddings=false)", RlcoreWarning)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False, raw={**cfg.raw, "tie_word_embeddings": False})
    with torch.device("meta"):
        model = model_class(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        stored.pop("lm_head.weight", None)  # the tied copy some exporters write, equal to the embedding
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing:
        raise CheckpointError(
            f"{path}: tensor names do not match a {cfg.model_type} model with this config.json: "
            f"missing {listed(missing)}" + (f", unexpected {listed(unexpected)}" if unexpected else "") +
            ("; the output layer is stored only as the embedding: if the model ties them, config.json needs "
             "\"tie_word_embeddings\": true" if missing == ["lm_head.weight"] else
             "; check that config.json belongs to these weights and that no shard is left out"))
    if unexpected:
        warnings.warn(f"{path}: skipping {len(unexpected)} tensors a {cfg.model_type} model with this "
                      f"config.json has no place for (transformers skips them too): {listed(unexpected)}",
                      RlcoreWarning)
    wanted = {stored[name]: name for name in expected}  # name in the file -> name in the model
    state = {}
    for file in sorted(set(files.values())):
        with open_weights(file, device) as f:
            for key in f.keys():
                name = wanted.get(key)
                if name is None or files.get(key) != file:
                    continue
                t = f.get_tensor(key)
                if t.shape != expected[name]:
                    raise CheckpointError(f"{file}: tensor {name} has shape {tuple(t.shape)}, "
                                          f"config.json implies {tuple(expected[name])}; check that "
                                          f"config.json's sizes (hidden_size, intermediate_size, vocab_size, "
                                          f"head counts, head_dim) belong to these weights")
                state[name] = t.to(dtype)
                if t.is_floating_point() and not bool(torch.isfinite(state[name]).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    raise CheckpointError(
                        f"{file}: tensor {name} holds {bad} NaN/inf value(s); the checkpoint is damaged (or saved "
                        f"from a diverged run): use another one" if bad else
                        f"{file}: tensor {name} has values beyond {dtype}'s range: load it in a wider model.dtype")
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
    # transformers >= 5 reads `dtype`, older versions `torch_dtype`; a stale one of the two
    # (copied from the source config) would reload fp32 weights as bf16
    config["dtype"] = config["torch_dtype"] = dtype_name
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
