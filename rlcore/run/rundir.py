"""A run directory and the run's life in it: `RunDir`.

    config.toml          the run's configuration (RUN_CONFIG_HEADER, then `# ranks = P`)
    metrics.jsonl        one row per optimizer step (steplog.py builds them), and to the trackers
    eval.jsonl           the held-out evaluations, step 0 = before training, and to the trackers
    completions.jsonl    every completion of each round (train.log_completions)
    latest, checkpoint-<step>/   the newest checkpoints (checkpoints.py)

A new run checks that the directory holds nothing of another run, then writes its config.toml
once every input has loaded. A `--resume` continues from `latest`: the same model, the same rank
count (a sharded checkpoint: any), the optimizer, schedule and RunState as saved, and the run's
files cut back to the checkpoint's step. Rank 0 writes, and reports to the trackers of
train.report_to (tracking.py) what it writes; every rank calls `save`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from rlcore import RlcoreWarning
from rlcore.config.load import RUN_CONFIG_HEADER, dump_config, with_absolute_paths
from rlcore.config.options import EMBEDDED_MODEL_PATHS, Config, DataArgs
from rlcore.parallel import collectives, fsdp
from rlcore.run.checkpoints import (
    checkpoint_step,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    save_sharded_checkpoint,
)
from rlcore.run.state import RunState, has_state
from rlcore.run.tracking import Trackers

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

DATA_SELECTION = ("task", "path", "eval_path", "num_train", "num_eval", "seed")  # which rows, in which order


def resume_command(run_dir: Path, ranks: int) -> str:
    """The command that continues `run_dir`, trained on `ranks` processes (on one machine)."""
    if ranks == 1:
        return f"rlcore train --resume {run_dir}"
    return f"torchrun --nproc_per_node={ranks} -m rlcore.cli train --resume {run_dir}"


def embedded_model_name(seed: int, num_eval: int) -> str:
    """The embedded model is built from the problems that data.seed and data.num_eval hold out."""
    return f"embedded (data.seed = {seed}, data.num_eval = {num_eval})"


class RunDir:
    """`train.output_dir`, or the directory a --resume continues. `main`: this rank writes the
    files (rank 0). `saved_step` is the step of the newest checkpoint this process knows of."""

    def __init__(self, path: str | os.PathLike, main: bool = True):
        self.path, self.main, self.saved_step = Path(path), main, 0
        self.config_toml = self.path / "config.toml"
        self.metrics_file, self.eval_file = self.path / "metrics.jsonl", self.path / "eval.jsonl"
        self.completions_file = self.path / "completions.jsonl"
        self.trackers = Trackers({})  # train.report_to's, once `create` has started them

    def __str__(self) -> str:
        return str(self.path)

    # ---------------------------------------------------------------- a new run

    def check_new(self) -> None:
        """A new run writes config.toml and checkpoint-<step>/ into the directory, and deletes its
        own older checkpoints: it must hold no checkpoint-* entry and no config.toml that rlcore did
        not write (a run that crashed before its first checkpoint leaves its own). Other files (a
        log, a .gitkeep) stay as they are."""
        path = existing = self.path
        while not existing.exists():  # the nearest existing ancestor: the run directory is created under it
            existing = existing.parent
        if not existing.is_dir():
            what = "is a file" if existing == path else f"is inside {existing}, which is a file"
            raise NotADirectoryError(f"train.output_dir = {path} {what}; choose a directory (it is created)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"train.output_dir = {path}: {existing} is not writable; choose a directory you "
                                  f"can write to")
        if existing != path:
            return
        if (path / "latest").exists():
            raise FileExistsError(f"{path} already holds checkpoints; continue it with --resume {path}, "
                                  "or choose a new train.output_dir (nothing is overwritten)")
        others = sorted(p.name for p in path.glob("checkpoint-*"))
        config = self.config_toml
        if config.is_file() and not config.read_text(errors="replace").startswith(RUN_CONFIG_HEADER):
            others.append("config.toml")
        if others:
            listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise FileExistsError(f"train.output_dir = {path} already holds files that are not an rlcore run's "
                                  f"({listed}); a run writes config.toml and checkpoint-<step>/ there and deletes its "
                                  f"older checkpoints: choose a new or empty train.output_dir (nothing was written)")

    def create(self, cfg: Config, world: int) -> None:
        """Make the directory and write the run's config.toml, its paths absolute so that a --resume
        from another directory finds the model and data (rank 0; a crash leaves the previous one);
        then start the trackers' run, or on a --resume continue it, with that config."""
        if not self.main:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"train.output_dir = {str(self.path)!r} cannot be created ({e.strerror or e}); give a "
                          f"directory you can write to, e.g. --set train.output_dir=runs/my-run") from e
        tmp, recorded = self.path / "config.toml.tmp", with_absolute_paths(cfg)
        toml = dump_config(recorded)
        tmp.write_text(RUN_CONFIG_HEADER + f"# ranks = {world}\n" + toml)
        os.replace(tmp, self.config_toml)
        train_cfg = cfg.train
        self.trackers = Trackers.open(train_cfg.report_to, self.path, train_cfg.run_name or self.path.resolve().name,
                                      dataclasses.asdict(recorded), toml, train_cfg.project, self.saved_step)

    def start(self, state: RunState, baseline: dict, no_accuracy: str) -> None:
        """Begin the run's files afresh with the evaluation before training, `baseline`, whose
        accuracy is `state.before`; `no_accuracy` says why there is none, when there is none."""
        if not self.main:
            return
        self.metrics_file.write_text("")
        self.eval_file.write_text("")
        self.completions_file.unlink(missing_ok=True)  # a crashed attempt's, before any checkpoint
        self.record_eval(0, baseline)
        if state.before is None:
            print("no held-out accuracy: " + no_accuracy, flush=True)

    # ---------------------------------------------------------------- --resume

    @classmethod
    def to_resume(cls, path: str | os.PathLike, world: int, main: bool = True) -> RunDir:
        """The run directory `path`, checked for a --resume on `world` ranks before its config
        loads: it exists, `latest` names a checkpoint, config.toml records the run, and the run
        trained on `world` ranks (a sharded run resumes on any count), besides the ranks that only
        sampled (rollout.rollout_ranks)."""
        run_dir = cls(path, main)
        path = run_dir.path
        if not path.is_dir():
            raise FileNotFoundError(f"--resume {path}: no such run directory")
        if not (path / "latest").is_file():
            raise FileNotFoundError(f"--resume {path}: no checkpoint there (no `latest` file)"
                                    f"{run_dir.no_latest_hint()}")
        if not run_dir.config_toml.is_file():  # deleted: train() writes it into every run directory
            raise FileNotFoundError(f"--resume {path}: the run directory has no config.toml; give the config the run "
                                    f"was started with: rlcore train CONFIG --resume {path}")
        if (ranks := run_dir.recorded_ranks()) is None:
            raise ValueError(f"--resume {path}: {run_dir.config_toml} does not begin as the config.toml rlcore writes "
                             f"({RUN_CONFIG_HEADER.rstrip()!r}, then '# ranks = P'); restore those two lines")
        sharded = run_dir.recorded().get("train", {}).get("fsdp", False)
        samplers = run_dir.recorded().get("rollout", {}).get("rollout_ranks", 0)
        if ranks != world - samplers and not sharded:
            also = f" (and {samplers} that only sampled)" if samplers else ""
            raise ValueError(f"--resume {path}: the run was trained on {ranks} rank(s){also} and this command starts "
                             f"{world}; resume it on as many: {resume_command(path, ranks + samplers)}")
        return run_dir

    def no_latest_hint(self) -> str:
        """What a --resume directory without a `latest` file is instead: one of rlcore's checkpoints, a
        run that stopped before its first save, or a transformers Trainer's (TRL's) output."""
        path = self.path
        if has_state(path):  # a checkpoint, as the Trainer's resume_from_checkpoint takes
            return (f"; it is a checkpoint: --resume takes its run directory, --resume {path.parent} (which "
                    f"continues from the checkpoint its `latest` names)")
        trainer = sorted((p.parent for p in path.glob("checkpoint-*/trainer_state.json")),
                         key=lambda p: int(p.name.rpartition("-")[2]) if p.name.rpartition("-")[2].isdigit() else -1)
        if (path / "trainer_state.json").is_file() or trainer:
            weights = path if (path / "trainer_state.json").is_file() else trainer[-1]
            return (f"; it is a transformers Trainer's (TRL's) output, and rlcore resumes only the runs it wrote: to "
                    f"start a new run from its weights, --set model.path={weights}")
        if self.config_toml.is_file() and self.config_toml.read_text().startswith(RUN_CONFIG_HEADER):
            return ("; the run stopped before its first checkpoint (one is written every train.save_steps steps and "
                    f"at the end), so it starts over: rlcore train {self.config_toml}")
        return ""

    def recorded_ranks(self) -> int | None:
        """The rank count the run's config.toml records on the line after its header (`# ranks = 2`);
        None when the file does not begin as rlcore writes it."""
        lines = self.config_toml.read_text(errors="replace").splitlines()
        header, ranks = RUN_CONFIG_HEADER.rstrip("\n"), "".join(lines[1:2])
        return int(ranks.split("=")[1]) if lines[:1] == [header] and re.fullmatch(r"# ranks = \d+", ranks) else None

    def recorded(self) -> dict:
        """The run's config.toml as written, without applying or checking it ({} when absent)."""
        if not self.config_toml.is_file():
            return {}
        with open(self.config_toml, "rb") as f:
            return tomllib.load(f)

    def recorded_model(self) -> str | None:
        """The model the run's config.toml records: its model.path, or for the embedded model
        "embedded (data.seed = S, data.num_eval = E)", the keys its build depends on; None when the
        file is absent."""
        if not (recorded := self.recorded()):
            return None
        path, data = recorded.get("model", {}).get("path", ""), recorded.get("data", {})
        if path not in EMBEDDED_MODEL_PATHS:
            return path
        return embedded_model_name(data.get("seed", DataArgs.seed), data.get("num_eval", DataArgs.num_eval))

    def changed_data(self, data: DataArgs) -> list[str]:
        """`data.key = now (was before)` for each DATA_SELECTION option that differs from the run's
        config.toml (a path the same file under another spelling does not differ)."""
        recorded, defaults, changes = self.recorded().get("data", {}), DataArgs(), []
        for key in DATA_SELECTION:
            was, now = recorded.get(key, getattr(defaults, key)), getattr(data, key)
            same_file = key.endswith("path") and was and now and Path(was).exists() and Path(now).exists() \
                and os.path.samefile(was, now)
            if was != now and not same_file:
                changes.append(f"data.{key} = {now!r} (was {was!r})")
        return changes

    def check_resumed(self, cfg: Config) -> None:
        """A resumed run keeps the model it started from (its config.toml's), and needs it: the
        tokenizer, and with beta the reference model, come from there. Another spelling of the same
        directory is the same model, and so is a new place once the recorded one is gone (moved).
        The embedded model is the one data.seed and data.num_eval built. Other data is a warning."""
        path, embedded = self.path, cfg.model.path in EMBEDDED_MODEL_PATHS
        started = self.recorded_model()
        now = embedded_model_name(cfg.data.seed, cfg.data.num_eval) if embedded else cfg.model.path
        if not embedded and not Path(now).exists():
            needed = "the tokenizer and the reference model are" if cfg.loss.beta else "the tokenizer is"
            raise FileNotFoundError(f"--resume {path}: the run's model.path {now} is gone (a relative path is taken "
                                    f"from the current directory); {needed} read from it: restore it, or give its "
                                    f"new place with --set model.path=...")
        if started is not None and started != now and (
                embedded or started.startswith("embedded (") or Path(started).exists()
                and not os.path.samefile(started, now)):
            what = ("drop the new data.seed / data.num_eval, which choose the embedded model and its held-out set"
                    if embedded and started.startswith("embedded (") else "drop the new model.path")
            raise ValueError(f"--resume {path}: model.path = {now}, but the run started from {started} (its "
                             f"config.toml); a resumed run keeps its model and tokenizer: {what}, or start a new run "
                             f"from a checkpoint's model/ directory")
        if changes := self.changed_data(cfg.data):
            warnings.warn(f"--resume {path} with other data: {', '.join(changes)}. The checkpoint's data position "
                          f"counts rows of the old order, the held-out set is drawn again (it may hold prompts the "
                          f"run trained on), and 'before=' stays the old set's accuracy; drop those --set values to "
                          f"continue the run as it was, or start a new run from a checkpoint's model/ directory",
                          RlcoreWarning, stacklevel=3)

    def latest(self) -> tuple[Path, dict]:
        """The checkpoint a --resume continues from and its trainer state."""
        checkpoint = latest_checkpoint(self.path)
        self.saved_step = checkpoint_step(checkpoint)
        return checkpoint, load_trainer_state(checkpoint)

    def check_steps_left(self, max_steps: int) -> None:
        """A finished run has nothing to train: nothing is evaluated or rewritten."""
        if self.saved_step >= max_steps:
            raise ValueError(f"--resume {self.path}: its checkpoint is at step {self.saved_step} and "
                             f"train.max_steps = {max_steps}, so there is nothing to train; continue it with --set "
                             f"train.max_steps={self.saved_step + 100} (or any number above {self.saved_step})")

    def restore(self, run, state: RunState) -> None:
        """Restore `run`'s optimizer and schedule (run: the Run, setup.py) and `state` as the checkpoint
        left them, and drop the rows of the run's files written after it (a crash may have left some)."""
        saved, opt, sched = run.saved_state, run.opt, run.sched
        if saved["optimizer"] is None:  # a sharded checkpoint: the weights too, resharded to this run's ranks
            fsdp.load_shards(run.checkpoint / fsdp.SHARDS, run.model, opt)
        else:
            opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        # The saved rate came from the saved run's schedule; a resume with a larger max_steps
        # follows this run's from here on (the same rate when max_steps is unchanged).
        for group, base in zip(opt.param_groups, sched.base_lrs):
            group["lr"] = base * run.schedule(sched.last_epoch)
        state.load_state_dict(saved, run.rank)
        if not self.main:
            return
        if self.metrics_file.is_file():  # one row per step; later (torn) rows go
            kept_rows = self.metrics_file.read_text().splitlines()[:state.step]
        else:
            warnings.warn(f"{self.metrics_file} is missing: its rows up to step {state.step} are lost; the rows from "
                          f"step {state.step + 1} on go to a new one", RlcoreWarning, stacklevel=3)
            kept_rows = []
        self.metrics_file.write_text("".join(ln + "\n" for ln in kept_rows))
        for file in (self.eval_file, self.completions_file):
            drop_rows_after(file, state.step)
        print(f"resumed from {run.checkpoint} at step {state.step}", flush=True)

    # ---------------------------------------------------------------- checkpoints

    def save(self, run, state: RunState, resume_point: dict) -> None:
        """Checkpoint `run` (the Run, setup.py) as it is at `state.step`, to continue from
        `resume_point` (the round's start when its scoring failed). Every rank calls it; rank 0
        writes, and under train.fsdp every rank writes its shards."""
        collectives.check_replicas_agree(run.model, run.world)
        samplers = collectives.gather_objects(resume_point["sampler"], run.world)
        train_cfg, loss_cfg = run.cfg.train, run.cfg.loss
        if train_cfg.fsdp:  # the optimizer state is in the shards; the last checkpoint gets the full model too
            trainer_state = {"optimizer": None, "scheduler": run.sched.state_dict(),
                             **state.state_dict(resume_point, samplers)}
            last = state.step >= run.geometry.max_steps
            with run.generating() if last else contextlib.nullcontext() as full_model:
                save_sharded_checkpoint(self.path, state.step, run.model, run.opt, trainer_state, run.model_dir,
                                        train_cfg.save_total_limit, self.main, run.world, full_model)
        elif self.main:
            trainer_state = {"optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(),
                             **state.state_dict(resume_point, samplers)}
            synced = loss_cfg.sync_ref_model and state.step >= loss_cfg.ref_model_sync_steps
            save_checkpoint(self.path, state.step, run.model, run.model_dir, trainer_state,
                            train_cfg.save_total_limit, run.ref if synced else None)
        self.saved_step = state.step

    @contextlib.contextmanager
    def saved_on_failure(self, run, state: RunState, resume_point: dict, errors: tuple[type[BaseException], ...]
                         ) -> Iterator[None]:
        """Checkpoint the run (to continue from `resume_point`) before an error of `errors` leaves the block,
        when no checkpoint holds the steps taken since the newest one: a reward function that
        fails loses no training, and `--resume` continues once it is fixed."""
        try:
            yield
        except errors:
            if state.step > self.saved_step:
                self.save(run, state, resume_point)
            raise

    # ---------------------------------------------------------------- what a run records

    def write_row(self, row: dict) -> None:
        """Append a metrics row to metrics.jsonl as one line of strict JSON (NaN and inf as null),
        then give it to the trackers."""
        if self.main:
            row = {key: None if isinstance(v, float) and not math.isfinite(v) else v for key, v in row.items()}
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.trackers.log({key: v for key, v in row.items() if key != "step"}, row["step"])

    def record_eval(self, step: int, evaluation: dict) -> None:
        """Append an evaluation's metrics at `step` to eval.jsonl (step 0 = before training), those
        that are not None, give them to the trackers, and print the accuracy, reward and tool use;
        nothing when all are None (no held-out prompt could be scored)."""
        row = {key: value for key, value in evaluation.items() if value is not None}
        if not self.main or not row:
            return
        with open(self.eval_file, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        self.trackers.log(row, step)
        said = [f"{what} {row[key]:.3f}" for what, key in (("accuracy", "eval/accuracy"),
                                                           ("reward", "eval/reward/mean"),
                                                           ("tool use", "eval/tools/used_frac")) if key in row]
        print(f"step {step}: held-out " + ", ".join(said), flush=True)

    def close(self) -> None:
        """The trackers' last writes, once the run has ended."""
        self.trackers.close()

    def log_completions(self, step: int, texts: list, rewards: torch.Tensor, advantages: torch.Tensor,
                        lengths: torch.Tensor, names: list[str], show: int | None) -> None:
        """Append a round's completions, all ranks' in order, to completions.jsonl with their rewards
        `[N, F]` (None where unscored), advantage `[N]`, length `[N]` and the columns reward
        functions gave `log_extra` (one value per completion); print `show` of them spread over the
        round (None: all), as TRL's log_completions does. `texts` holds each rank's (prompts,
        completions, extra columns)."""
        own = ("step", "prompt", "completion", "rewards", "advantage", "length")
        for prompts, _, extra in texts:
            for column, values in extra.items():
                if column in own:
                    raise ValueError(f"log_extra column {column!r} is one of completions.jsonl's own fields "
                                     f"({', '.join(own)}); give it another name")
                if len(values) != len(prompts):
                    raise ValueError(f"log_extra column {column!r} got {len(values)} values for {len(prompts)} "
                                     f"completions; log one value per completion")
        if not self.main:
            return
        rows = [{"prompt": p, "completion": c, **{k: v[i] for k, v in extra.items()}}
                for prompts, completions, extra in texts for i, (p, c) in enumerate(zip(prompts, completions))]
        records = [{"step": step, **row, "rewards": {n: None if math.isnan(x) else x for n, x in zip(names, r)},
                    "advantage": a, "length": n}
                   for row, r, a, n in zip(rows, rewards.tolist(), advantages.tolist(), lengths.tolist())]
        with open(self.completions_file, "a") as f:
            f.writelines(json.dumps(rec, default=str) + "\n" for rec in records)
        stride = 1 if show is None else max(1, len(records) // max(show, 1))  # across groups, not one
        for i in range(0, len(records), stride)[:show]:
            rec = records[i]
            scores = ", ".join(f"{n} {x:.3g}" if x is not None else f"{n} None" for n, x in rec["rewards"].items())
            print(f"  completion {i + 1}/{len(records)}: {scores}, advantage {rec['advantage']:+.3f}\n"
                  f"    prompt: {str(rec['prompt'])[-200:]!r}\n    completion: {str(rec['completion'])[:300]!r}",
                  flush=True)


def drop_rows_after(file: Path, step: int) -> None:
    """Keep the JSON lines of `file` whose "step" is at most `step` (a resume drops later ones,
    and a line a crash cut short)."""
    if file.exists():
        keep = [ln for ln in file.read_text().splitlines() if _step(ln) <= step]
        file.write_text("".join(ln + "\n" for ln in keep))


def _step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
