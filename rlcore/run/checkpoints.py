"""A run directory's checkpoints: `checkpoint-<step>/` written atomically, rotated, found again.

    checkpoint-<step>/   model/ (a Hugging Face checkpoint with the tokenizer files; with LoRA
                         adapter/, in PEFT's format), the trainer state (state.py), and
                         ref_model/ once loss.sync_ref_model changed it; under train.fsdp
                         sharded/ (torch.distributed.checkpoint: every rank's shards of the
                         trainable weights and the optimizer state) and the trainer state, and
                         the last checkpoint of the run model/ too
    latest               the name of the newest checkpoint

Every checkpoint is written under a temporary name and renamed, and `latest` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact and findable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from rlcore.models.hf_checkpoint import CheckpointError, fsync_dir, load_model, save_model
from rlcore.models.lora import lora_parameters, save_adapter
from rlcore.models.transformer import Transformer
from rlcore.parallel import collectives, fsdp
from rlcore.run.state import PICKLED_STATE, StateFileError, has_state, read_state, write_state

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja", "special_tokens_map.json")


def save_checkpoint(run_dir: Path, step: int, model, source: Path, state: dict, keep: int | None = 2,
                    ref=None) -> Path:
    """run_dir/checkpoint-<step>/: HF weights (`model/`; with LoRA the adapters, `adapter/`) +
    tokenizer + trainer state (+ `ref_model/`, HF weights of a reference model that training has
    changed, when `ref` is given), then `latest` points to it; then all but the newest `keep`
    checkpoints are deleted (None: none are)."""
    final, tmp = run_dir / f"checkpoint-{step}", run_dir / f".checkpoint-{step}.tmp"
    if final.exists() and not has_state(final):  # else: a crashed attempt's save of this step
        raise not_a_checkpoint(run_dir, final)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_model(tmp, model, source)
        if ref is not None:
            save_model(ref, tmp / "ref_model")
        write_state(tmp, state)
        fsync_dir(tmp)
    except (OSError, SafetensorError, RuntimeError) as e:  # no space, file too large, I/O error (torch: RuntimeError)
        raise not_written(run_dir, tmp, final, e) from e
    return publish(run_dir, tmp, final, keep)


def save_sharded_checkpoint(run_dir: Path, step: int, model, opt: torch.optim.Optimizer, state: dict, source: Path,
                            keep: int | None, main: bool, world: int, full_model=None) -> None:
    """run_dir/checkpoint-<step>/ of a train.fsdp run: sharded/ (fsdp.save_shards: each rank writes
    its shards of the trainable weights and of the optimizer state), the trainer state, and with
    `full_model` (the policy with its full weights, for the run's last checkpoint) what
    `save_checkpoint` writes of it. Every rank calls it; rank 0 (`main`) renames it into place once
    every rank's shards and its own files are complete, so a crash (of any rank) leaves the
    previous checkpoint intact and findable."""
    final, tmp = run_dir / f"checkpoint-{step}", run_dir / f".checkpoint-{step}.tmp"
    error = None
    if main:
        if final.exists() and not has_state(final):
            error = not_a_checkpoint(run_dir, final)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt's
    collectives.raise_together(error, world)  # also: no rank writes before the old files are gone
    fsdp.save_shards(tmp / fsdp.SHARDS, model, opt)  # DCP: the ranks' failures raise on all
    if main:
        try:
            if full_model is not None:
                write_model(tmp, full_model, source)
            write_state(tmp, state)
            fsync_dir(tmp)
            publish(run_dir, tmp, final, keep)
        except (OSError, SafetensorError, RuntimeError) as e:
            error = not_written(run_dir, tmp, final, e)
    collectives.raise_together(error, world)  # the ranks go on once the checkpoint is complete


def write_model(directory: Path, model, source: Path) -> None:
    """The weights a checkpoint keeps, with `source`'s tokenizer files: model/ (HF), or with LoRA
    adapter/ (the base never changes: the adapters, in PEFT's format)."""
    extra = {n: source / n for n in TOKENIZER_FILES if (source / n).is_file()}
    if lora_parameters(model):
        save_adapter(model, directory / "adapter", base_model_name_or_path=os.path.abspath(source))
        for name, file in extra.items():
            shutil.copyfile(file, directory / "adapter" / name)
    else:
        save_model(model, directory / "model", extra_files=extra)


def not_a_checkpoint(run_dir: Path, final: Path) -> FileExistsError:
    return FileExistsError(f"{final} exists and is not an rlcore checkpoint (no run_state.json); "
                           f"move it out of the run directory {run_dir}")


def not_written(run_dir: Path, tmp: Path, final: Path, e: Exception) -> OSError:
    """The error of a checkpoint that could not be written, its partial files removed."""
    shutil.rmtree(tmp, ignore_errors=True)  # give the space back
    kept = kept_checkpoint(run_dir)
    return OSError(f"could not write checkpoint {final} ({type(e).__name__}: {e}); " +
                   (f"{run_dir / kept} is intact: make room, then continue with --resume {run_dir}" if kept else
                    "no earlier checkpoint exists: make room and start again"))


def publish(run_dir: Path, tmp: Path, final: Path, keep: int | None) -> Path:
    """Rename the complete checkpoint `tmp` to `final`, point `latest` at it, and delete all but
    the newest `keep` checkpoints (None: none are)."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(run_dir / "latest.tmp", "w") as f:
        f.write(final.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(run_dir / "latest.tmp", run_dir / "latest")
    old = [p for p in checkpoints(run_dir) if p != final]
    for p in old[:max(0, len(old) - keep + 1)] if keep is not None else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step a `checkpoint-<step>` directory was saved at (from its name: no file read)."""
    return int(checkpoint.name.removeprefix("checkpoint-"))


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's `checkpoint-<step>` directories, oldest first (saves in progress are `.checkpoint-*`).
    Only rlcore's (with a trainer state): rotation never deletes a Trainer's or a user's directory."""
    return sorted((p for p in run_dir.glob("checkpoint-*")
                   if p.name.removeprefix("checkpoint-").isdigit() and has_state(p)),
                  key=checkpoint_step)


def kept_checkpoint(run_dir: Path) -> str | None:
    """The checkpoint a run directory's `latest` names (what a --resume continues from), or None."""
    return (run_dir / "latest").read_text().strip() if (run_dir / "latest").is_file() else None


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint `latest` names, complete; else an error that says which one to name instead."""
    ptr = run_dir / "latest"
    if not ptr.is_file():
        raise FileNotFoundError(f"{run_dir}: no `latest` file; nothing to resume (was a checkpoint saved?)")
    name = ptr.read_text().strip()
    checkpoint = run_dir / name
    if not name or not has_state(checkpoint):
        others = checkpoints(run_dir)
        fix = (f"; the run directory keeps {others[-1].name}: write its name into {ptr} to resume from it"
               if others else "")
        if not name:
            raise FileNotFoundError(f"{ptr} is empty: it names no checkpoint" + fix)
        if (checkpoint / PICKLED_STATE).is_file():
            read_state(checkpoint)  # refuses it, naming the file
        raise FileNotFoundError(f"{checkpoint}: checkpoint named by {ptr} is " +
                                ("incomplete (no run_state.json)" if checkpoint.is_dir() else "missing") + fix)
    return checkpoint


TRAINER_STATE_KEYS = ("optimizer", "scheduler", "sampler_rng", "shuffler_rng", "torch_rng", "step", "data_pos",
                      "nonfinite_total", "nonfinite_in_row", "before", "entropy_bonus", "grad_scaler",
                      "overflow_skips")
"""What every rlcore trainer state holds (RunState.state_dict's keys, the optimizer's and the schedule's)."""


def load_trainer_state(checkpoint: Path) -> dict:
    """The optimizer, schedule, RNG and data-position state saved with checkpoint `checkpoint`. Nothing
    in it runs code (state.py), so a run directory from elsewhere resumes without being trusted."""
    try:
        state = read_state(checkpoint)
    except StateFileError as e:
        raise ValueError(f"{e}; the checkpoint is damaged, or not rlcore's{way_back(checkpoint)}") from e
    missing = TRAINER_STATE_KEYS if not isinstance(state, dict) else [k for k in TRAINER_STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{checkpoint / 'run_state.json'} is not an rlcore trainer state: it lacks "
                         f"{', '.join(missing)}; rlcore resumes only the runs it wrote. To start from this "
                         f"checkpoint's weights, begin a new run with --set model.path="
                         f"{checkpoint / 'model' if (checkpoint / 'model').is_dir() else checkpoint}")
    return state


def way_back(checkpoint: Path) -> str:
    """For a damaged checkpoint `checkpoint` of a run: the earlier one to resume from, and how."""
    earlier = [p for p in checkpoints(checkpoint.parent) if checkpoint_step(p) < checkpoint_step(checkpoint)]
    if not earlier:
        return "; the run keeps no earlier checkpoint: start it again"
    return f"; the run keeps {earlier[-1].name}: write that name into {checkpoint.parent / 'latest'} to resume from it"


def load_resumed_model(checkpoint: Path, dtype, device) -> Transformer:
    """`load_model` of a run's checkpoint, pointing at the earlier one when this one is damaged."""
    try:
        return load_model(checkpoint / "model", dtype, device)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{way_back(checkpoint)}") from None
