"""Experiment trackers (train.report_to, TRL's name): TensorBoard, Weights & Biases and trackio.

Each gets what the run directory records, after the run directory has it: every metrics row (the
keys of metrics.jsonl but `step`, which is the x axis), every evaluation of eval.jsonl at its step,
the resolved config and the run's name (train.run_name, else the run directory's name). None needs
the network: TensorBoard writes event files into `<run dir>/tensorboard`, wandb runs offline into
`<run dir>/wandb` unless WANDB_MODE says otherwise, and trackio writes its local store (TRACKIO_DIR,
default ~/.cache/huggingface/trackio) unless TRACKIO_SPACE_ID or TRACKIO_SERVER_URL says otherwise.
A resumed run continues the same tracker run: the same TensorBoard directory with the steps after
the checkpoint purged, wandb's run of the same id (resume="allow"), trackio's run of the same name.

metrics.jsonl is the record: a tracker that raises while logging is a warning, and gets nothing
more of the run, which goes on. Only rank 0 reports.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

from rlcore import RlcoreWarning


def tracker_names(report_to: str | list[str]) -> list[str]:
    """train.report_to as a list of tracker names ('none': [])."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [] if names == ["none"] else names


def check_installed(report_to: str | list[str]) -> None:
    """Raise, naming the extra to install, when a tracker train.report_to names is not installed."""
    for name in tracker_names(report_to):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError(f"train.report_to names {name!r}, which is not installed ({err}): pip install -e "
                              f"\".[{name}]\" (or pip install {name}), or drop it from train.report_to") from None


class TensorBoard:
    """Event files in `<run dir>/tensorboard` (tensorboard --logdir runs/), read back by tensorboard."""

    def __init__(self, run_dir: Path, run_name: str, config: dict, config_toml: str, project: str,
                 resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # on a resume, events past the checkpoint's step (a crashed attempt's) are hidden
        self.writer = SummaryWriter(run_dir / "tensorboard", purge_step=resume_step + 1 if resume_step else None)
        self.writer.add_text("run_name", run_name, resume_step)  # at the step the run (re)starts from
        self.writer.add_text("config", "```toml\n" + config_toml + "```", resume_step)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)):  # a bool too; None (non-finite, or unmeasured) is left out
                self.writer.add_scalar(key, float(value), step)
        self.writer.flush()  # metrics.jsonl's pace: a row is on disk once logged

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """A wandb run in `<run dir>/wandb`, offline unless WANDB_MODE is set (wandb sync uploads it)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict, config_toml: str, project: str,
                 resume_step: int):
        import wandb

        mode = None if "WANDB_MODE" in os.environ else "offline"
        if mode:  # the process's settings too: wandb's own telemetry follows them, not the run's
            wandb.setup(settings=wandb.Settings(mode=mode))
        latest = run_dir / "wandb" / "latest-run"  # wandb's link to the run's files, named ...-<run id>
        run_id = latest.resolve().name.rpartition("-")[2] if resume_step and latest.exists() else None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=run_name, config=config,
                              dir=run_dir, id=run_id, resume="allow" if run_id else None, mode=mode)

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A trackio run in trackio's local store (trackio show opens its dashboard)."""

    def __init__(self, run_dir: Path, run_name: str, config: dict, config_toml: str, project: str,
                 resume_step: int):
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=run_name, config=config, resume="allow" if resume_step else "never",
                     embed=False)

    def log(self, values: dict, step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKER_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}  # config.options.TRACKERS


class Trackers:
    """The run's trackers (none when report_to is 'none'); `log` and `close` warn rather than raise."""

    def __init__(self, trackers: dict):
        self.trackers = trackers  # name -> tracker

    @classmethod
    def open(cls, report_to: str | list[str], run_dir: Path, run_name: str, config: dict, config_toml: str,
             project: str, resume_step: int = 0) -> Trackers:
        """Start (or, from a checkpoint at `resume_step` > 0, continue) a run in each tracker; one that
        cannot start is an error that names it."""
        trackers = cls({})
        for name in tracker_names(report_to):
            try:
                trackers.trackers[name] = TRACKER_CLASSES[name](run_dir, run_name, config, config_toml, project,
                                                                resume_step)
            except Exception as err:
                trackers.close()
                raise RuntimeError(f"train.report_to {name!r} could not start its run ({type(err).__name__}: {err}); "
                                   f"fix that, or drop {name!r} from train.report_to") from err
        return trackers

    def log(self, row: dict, step: int) -> None:
        """A metrics row or an evaluation (eval.jsonl's keys but `step`) at `step`."""
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(row, step)
            except Exception as err:  # a tracker's failure must not stop training
                del self.trackers[name]
                warnings.warn(f"train.report_to {name!r} raised {type(err).__name__} at step {step}: {err}; it gets "
                              f"no more of this run, which goes on (metrics.jsonl and eval.jsonl have every row)",
                              RlcoreWarning, stacklevel=3)

    def close(self) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as err:
                warnings.warn(f"train.report_to {name!r} raised {type(err).__name__} while closing: {err}",
                              RlcoreWarning, stacklevel=3)
        self.trackers = {}
