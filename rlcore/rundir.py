"""A run directory and continuing it: the layout `train.output_dir` gets, its checkpoints, and
what `--resume` reads back.

    config.toml          the run's configuration (RUN_CONFIG_HEADER, then `# ranks = P`)
    metrics.jsonl        one row per optimizer step; eval.jsonl, completions.jsonl
    latest               the name of the newest checkpoint
    checkpoint-<step>/   model/ (a Hugging Face checkpoint with the tokenizer files), the trainer
                         state (rlcore.state), and ref_model/ once loss.sync_ref_model changed it;
                         under train.fsdp sharded/ (torch.distributed.checkpoint: every rank's
                         shards of the trainable weights and the optimizer state) and the trainer
                         state, and the last checkpoint of the run model/ too

Every checkpoint is written under a temporary name and renamed, and `latest` is replaced
atomically, so a crash at any point leaves the previous checkpoint intact and findable. A resume
continues from `latest`: the same model, the same rank count, the optimizer, schedule and RunState
as saved, and the run's files cut back to the checkpoint's step. A sharded checkpoint resumes on
any rank count (docs/distributed.md says what stays exact).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from rlcore import RlcoreWarning, distributed, sharding
from rlcore.checkpoint import CheckpointError, fsync_dir, load_model, resolve_dtype, save_model
from rlcore.config import EMBEDDED_MODEL_PATHS, RUN_CONFIG_HEADER, Config
from rlcore.lora import load_adapter, lora_parameters, merge_lora, read_adapter_config, save_adapter
from rlcore.model import Transformer
from rlcore.options import DataArgs
from rlcore.runlog import drop_rows_after
from rlcore.state import StateFileError, has_state, read_state, state_file, write_state

if TYPE_CHECKING:
    from rlcore.setup import Run
    from rlcore.state import RunState

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja", "special_tokens_map.json")


def recorded_ranks(run_config: Path) -> int | None:
    """The rank count a run's config.toml records on the line after the header (`# ranks = 2`);
    None for a run written before rlcore recorded it."""
    lines = run_config.read_text(errors="replace").splitlines()[1:2]
    return int(lines[0].split("=")[1]) if lines and re.fullmatch(r"# ranks = \d+", lines[0]) else None


def resume_command(run: Path, ranks: int) -> str:
    """The command that continues `run`, trained on `ranks` processes (on one machine)."""
    if ranks == 1:
        return f"rlcore train --resume {run}"
    return f"torchrun --nproc_per_node={ranks} -m rlcore.cli train --resume {run}"


def check_new_run_dir(run: Path) -> None:
    """A new run writes config.toml and checkpoint-<step>/ into train.output_dir, and deletes its
    own older checkpoints: the directory must hold no checkpoint-* entry and no config.toml that
    rlcore did not write (a run that crashed before its first checkpoint leaves its own). Other
    files (a log, a .gitkeep) stay as they are."""
    existing = run
    while not existing.exists():  # the nearest existing ancestor: the run directory is created under it
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == run else f"is inside {existing}, which is a file"
        raise NotADirectoryError(f"train.output_dir = {run} {what}; choose a directory (it is created)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"train.output_dir = {run}: {existing} is not writable; choose a directory you can "
                              f"write to")
    if existing != run:
        return
    if (run / "latest").exists():
        raise FileExistsError(f"{run} already holds checkpoints; continue it with --resume {run}, "
                              "or choose a new train.output_dir (nothing is overwritten)")
    others = sorted(p.name for p in run.glob("checkpoint-*"))
    config = run / "config.toml"
    if config.is_file() and not config.read_text(errors="replace").startswith(RUN_CONFIG_HEADER):
        others.append("config.toml")
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(f"train.output_dir = {run} already holds files that are not an rlcore run's ({listed}); "
                              f"a run writes config.toml and checkpoint-<step>/ there and deletes its older "
                              f"checkpoints: choose a new or empty train.output_dir (nothing was written)")


def save_checkpoint(run: Path, step: int, model, source: Path, state: dict, keep: int | None = 2,
                    ref=None) -> Path:
    """run/checkpoint-<step>/: HF weights (`model/`; with LoRA the adapters, `adapter/`) + tokenizer +
    trainer state (+ `ref_model/`, HF weights
    of a reference model that training has changed, when `ref` is given), then `latest` points to it.

    The directory is written under a temporary name and renamed, and `latest` is replaced
    atomically, so a crash at any point leaves the previous checkpoint intact and findable.
    Then all but the newest `keep` checkpoints are deleted (None: none are).
    """
    final = run / f"checkpoint-{step}"
    tmp = run / f".checkpoint-{step}.tmp"
    if final.exists() and not has_state(final):  # else: a crashed attempt's save of this step
        raise FileExistsError(f"{final} exists and is not an rlcore checkpoint (no run_state.json); "
                              f"move it out of the run directory {run}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_model(tmp, model, source)
        if ref is not None:
            save_model(ref, tmp / "ref_model")
        write_state(tmp, state)
        fsync_dir(tmp)
    except (OSError, SafetensorError, RuntimeError) as e:  # no space, file too large, I/O error (torch: RuntimeError)
        raise not_written(run, tmp, final, e) from e
    return publish(run, tmp, final, keep)


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


def not_written(run: Path, tmp: Path, final: Path, e: Exception) -> OSError:
    """The error of a checkpoint that could not be written, its partial files removed."""
    shutil.rmtree(tmp, ignore_errors=True)  # give the space back
    kept = kept_checkpoint(run)
    return OSError(f"could not write checkpoint {final} ({type(e).__name__}: {e}); " +
                   (f"{run / kept} is intact: make room, then continue with --resume {run}" if kept else
                    "no earlier checkpoint exists: make room and start again"))


def publish(run: Path, tmp: Path, final: Path, keep: int | None) -> Path:
    """Rename the complete checkpoint `tmp` to `final`, point `latest` at it, and delete all but
    the newest `keep` checkpoints (None: none are)."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    with open(run / "latest.tmp", "w") as f:
        f.write(final.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(run / "latest.tmp", run / "latest")
    old = [p for p in checkpoints(run) if p != final]
    for p in old[:max(0, len(old) - keep + 1)] if keep is not None else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def save_sharded_checkpoint(run: Run, step: int, state: dict, full_model=None) -> None:
    """run.dir/checkpoint-<step>/ of a train.fsdp run: sharded/ (sharding.save_shards: each rank
    writes its shards of the trainable weights and of the optimizer state), the trainer state,
    and with `full_model` (the policy with its full weights, for the run's last checkpoint) what
    `save_checkpoint` writes of it. Every rank calls it. As `save_checkpoint`, it is written under a
    temporary name that rank 0 renames once every rank's shards and its own files are complete,
    so a crash (of any rank) leaves the previous checkpoint intact and findable."""
    final, tmp = run.dir / f"checkpoint-{step}", run.dir / f".checkpoint-{step}.tmp"
    error = None
    if run.main:
        if final.exists() and not has_state(final):
            error = FileExistsError(f"{final} exists and is not an rlcore checkpoint (no run_state.json); "
                                    f"move it out of the run directory {run.dir}")
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt's
    distributed.raise_together(error, run.world)  # also: no rank writes before the old files are gone
    sharding.save_shards(tmp / sharding.SHARDS, run.model, run.opt)  # DCP: the ranks' failures raise on all
    if run.main:
        try:
            if full_model is not None:
                write_model(tmp, full_model, run.model_dir)
            write_state(tmp, state)
            fsync_dir(tmp)
            publish(run.dir, tmp, final, run.cfg.train.save_total_limit)
        except (OSError, SafetensorError, RuntimeError) as e:
            error = not_written(run.dir, tmp, final, e)
    distributed.raise_together(error, run.world)  # the ranks go on once the checkpoint is complete


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step a `checkpoint-<step>` directory was saved at (from its name: no file read)."""
    return int(checkpoint.name.removeprefix("checkpoint-"))


def checkpoints(run: Path) -> list[Path]:
    """The run's `checkpoint-<step>` directories, oldest first (saves in progress are `.checkpoint-*`).
    Only rlcore's (with a trainer state): rotation never deletes a Trainer's or a user's directory."""
    return sorted((p for p in run.glob("checkpoint-*")
                   if p.name.removeprefix("checkpoint-").isdigit() and has_state(p)),
                  key=checkpoint_step)


def kept_checkpoint(run: Path) -> str | None:
    """The checkpoint a run directory's `latest` names (what a --resume continues from), or None."""
    return (run / "latest").read_text().strip() if (run / "latest").is_file() else None


def latest_checkpoint(run: Path) -> Path:
    ptr = run / "latest"
    if not ptr.is_file():
        raise FileNotFoundError(f"{run}: no `latest` file; nothing to resume (was a checkpoint saved?)")
    name = ptr.read_text().strip()
    checkpoint = run / name
    if not name or not has_state(checkpoint):
        others = checkpoints(run)
        fix = (f"; the run directory keeps {others[-1].name}: write its name into {ptr} to resume from it"
               if others else "")
        if not name:
            raise FileNotFoundError(f"{ptr} is empty: it names no checkpoint" + fix)
        raise FileNotFoundError(f"{checkpoint}: checkpoint named by {ptr} is " +
                                ("incomplete (no run_state.json)" if checkpoint.is_dir() else "missing") + fix)
    return checkpoint


TRAINER_STATE_KEYS = ("optimizer", "scheduler", "sampler_rng", "shuffler_rng", "torch_rng", "step", "data_pos",
                      "nonfinite_total", "before")
"""What every rlcore trainer state holds (train() writes more; later versions' additions are read with .get)."""


def load_trainer_state(checkpoint: Path) -> dict:
    """The optimizer, schedule, RNG and data-position state saved with checkpoint `checkpoint`. Nothing in it
    runs code (rlcore.state), so a run directory from elsewhere resumes without being trusted."""
    file = state_file(checkpoint)
    try:
        state = read_state(checkpoint)
    except StateFileError as e:
        raise ValueError(f"{e}; the checkpoint is damaged, or not rlcore's{way_back(checkpoint)}") from e
    missing = TRAINER_STATE_KEYS if not isinstance(state, dict) else [k for k in TRAINER_STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"{file} is not an rlcore trainer state: it lacks {', '.join(missing)}; rlcore resumes only "
                         f"the runs it wrote. To start from this checkpoint's weights, begin a new run with "
                         f"--set model.path={checkpoint / 'model' if (checkpoint / 'model').is_dir() else checkpoint}")
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


def recorded_sections(config_toml: Path) -> dict | None:
    """A run directory's config.toml as written, without applying or checking it; None when absent."""
    if not config_toml.is_file():
        return None
    with open(config_toml, "rb") as f:
        return tomllib.load(f)


def recorded_model(config_toml: Path) -> str | None:
    """The model a run directory's config.toml records: its model.path, or for the embedded model
    "embedded (data.seed = S, data.num_eval = E)", the keys its build depends on; None when the
    file is absent."""
    if (recorded := recorded_sections(config_toml)) is None:
        return None
    path, data = recorded.get("model", {}).get("path", ""), recorded.get("data", {})
    if path not in EMBEDDED_MODEL_PATHS:
        return path
    return embedded_model_name(data.get("seed", DataArgs.seed), data.get("num_eval", DataArgs.num_eval))


DATA_SELECTION = ("task", "path", "eval_path", "num_train", "num_eval", "seed")  # which rows, in which order


def changed_data(config_toml: Path, data: DataArgs) -> list[str]:
    """`data.key = now (was before)` for each DATA_SELECTION option that differs from a run
    directory's config.toml (a path the same file under another spelling does not differ)."""
    recorded, defaults, changes = (recorded_sections(config_toml) or {}).get("data", {}), DataArgs(), []
    for key in DATA_SELECTION:
        was, now = recorded.get(key, getattr(defaults, key)), getattr(data, key)
        same_file = key.endswith("path") and was and now and Path(was).exists() and Path(now).exists() \
            and os.path.samefile(was, now)
        if was != now and not same_file:
            changes.append(f"data.{key} = {now!r} (was {was!r})")
    return changes


def embedded_model_name(seed: int, num_eval: int) -> str:
    """The embedded model is built from the problems that data.seed and data.num_eval hold out."""
    return f"embedded (data.seed = {seed}, data.num_eval = {num_eval})"


def check_resumed_model(run: Path, cfg: Config) -> None:
    """A resumed run keeps the model it started from (its config.toml's), and needs it: the
    tokenizer, and with beta the reference model, come from there. Another spelling of the same
    directory is the same model, and so is a new place once the recorded one is gone (moved).
    The embedded model is the one data.seed and data.num_eval built."""
    embedded = cfg.model.path in EMBEDDED_MODEL_PATHS
    started = recorded_model(run / "config.toml")
    now = embedded_model_name(cfg.data.seed, cfg.data.num_eval) if embedded else cfg.model.path
    if not embedded and not Path(now).exists():
        needed = "the tokenizer and the reference model are" if cfg.loss.beta else "the tokenizer is"
        raise FileNotFoundError(f"--resume {run}: the run's model.path {now} is gone (a relative path is taken "
                                f"from the current directory); {needed} read from it: restore it, or give its "
                                f"new place with --set model.path=...")
    if started is None or started == now:
        return
    if embedded or started.startswith("embedded (") or Path(started).exists() and not os.path.samefile(started, now):
        what = ("drop the new data.seed / data.num_eval, which choose the embedded model and its held-out set"
                if embedded and started.startswith("embedded (") else "drop the new model.path")
        raise ValueError(f"--resume {run}: model.path = {now}, but the run started from {started} (its "
                         f"config.toml); a resumed run keeps its model and tokenizer: {what}, or start a new run "
                         f"from a checkpoint's model/ directory")


def resume_from_checkpoint(run: Run, state: RunState) -> None:
    """Restore the optimizer, schedule and `state` as the checkpoint left them, and drop the run's
    metrics, evaluation and completion rows written after it (a crash may have left some)."""
    saved, opt, sched = run.saved_state, run.opt, run.sched
    if saved["optimizer"] is None:  # a sharded checkpoint: the weights too, resharded to this run's ranks
        sharding.load_shards(run.checkpoint / sharding.SHARDS, run.model, opt)
    elif len(saved["optimizer"]["param_groups"]) != len(opt.param_groups):  # one group before weight decay
        raise ValueError(f"{run.checkpoint} was saved by an earlier rlcore (its optimizer state has one parameter "
                         "group, decayed or not); resume it with the rlcore version that wrote it")
    else:
        opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    # The saved rate came from the saved run's schedule; a resume with a larger max_steps
    # follows this run's from here on (the same rate when max_steps is unchanged).
    for group, base in zip(opt.param_groups, sched.base_lrs):
        group["lr"] = base * run.schedule(sched.last_epoch)
    state.load_state_dict(saved, run.rank)
    if run.main:
        metrics_file = run.dir / "metrics.jsonl"
        if metrics_file.is_file():
            kept_rows = metrics_file.read_text().splitlines()[:state.step]  # one row per step; later (torn) rows go
        else:
            warnings.warn(f"{metrics_file} is missing: its rows up to step {state.step} are lost; the rows from step "
                          f"{state.step + 1} on go to a new one", RlcoreWarning, stacklevel=3)
            kept_rows = []
        metrics_file.write_text("".join(ln + "\n" for ln in kept_rows))
        drop_rows_after(run.dir / "eval.jsonl", state.step)
        drop_rows_after(run.dir / "completions.jsonl", state.step)
        print(f"resumed from {run.checkpoint} at step {state.step}", flush=True)


def export(source: Path, out: Path) -> Path:
    """Write the model of a run's newest checkpoint (or of `source` itself, when it is a checkpoint)
    to `out` as a Hugging Face checkpoint that transformers loads, with its tokenizer files: a LoRA
    run's base with the adapters merged in (W + scale * B @ A), in the base's dtype."""
    checkpoint = source if has_state(source) else latest_checkpoint(source)
    if (checkpoint / "model").is_dir():
        model, files = load_model(checkpoint / "model", "auto"), checkpoint / "model"
    elif (checkpoint / sharding.SHARDS).is_dir():
        model, files = sharded_model(checkpoint)
    else:
        adapter = checkpoint / "adapter"
        base = Path(read_adapter_config(adapter).get("base_model_name_or_path") or "")
        model, files = load_model(base, "auto"), adapter
        load_adapter(model, adapter)
        merge_lora(model)
    extra = {name: files / name for name in TOKENIZER_FILES if (files / name).is_file()}
    return save_model(model, out, extra_files=extra)


def sharded_model(checkpoint: Path) -> tuple[Transformer, Path]:
    """A train.fsdp checkpoint's policy in this one process, and the directory of its tokenizer
    files: the run's model.path (its config.toml's), with LoRA's adapters merged in when the run
    trained some, and the trained weights loaded from the checkpoint's shards (DCP gathers them)."""
    from rlcore.config import load_config
    from rlcore.setup import add_adapters, embedded_model_dir

    config_toml = checkpoint.parent / "config.toml"
    cfg = load_config(str(config_toml), world_size=recorded_ranks(config_toml) or 1)  # its batch geometry's
    base = Path(cfg.model.path) if cfg.model.path not in EMBEDDED_MODEL_PATHS else embedded_model_dir(cfg)
    model = load_model(base, resolve_dtype(cfg.model.dtype, base))  # the dtype the run trained in
    if cfg.lora.enabled:
        add_adapters(model, cfg.lora, None)
    sharding.load_weights(checkpoint / sharding.SHARDS, model)
    merge_lora(model)
    return model, base
