"""What a torchrun user meets besides the arithmetic of data parallelism (test_distributed.py):
an error one rank meets alone reaches every rank, errors print once, a resume names the rank
count it needs, more ranks than GPUs is an error naming both, and machines that share (or do not
share) a cache each build the embedded model once."""

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcore.parallel import collectives
from rlcore.cli import main
from rlcore.models.embedded import build_embedded_model
from rlcore.rewards.scoring import RewardFunctionError, score_completions
from rlcore.data.tasks import unique_problems
from rlcore.train import train
from conftest import exit_spawned_rank
from test_train import aggregate_nan_on, cli_args, config, rows


def _raise_together_on_rank(rank, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    error = None
    if rank == 1:  # rank 1 alone: its reward function failed on its own rows
        error = RewardFunctionError("reward function f raised KeyError: 'x' on sample 6")
        error.trace = "Traceback of the reward function (most recent call last):\n  ...\n"
    try:
        collectives.raise_together(error, 2)
        out[rank] = None
    except RewardFunctionError as e:
        out[rank] = (str(e), e.trace)
    collectives.raise_together(None, 2)  # nobody failed: nothing raised
    dist.destroy_process_group()
    exit_spawned_rank()  # conftest: gloo's last collective could abort the process at exit


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Without it rank 0 waited at the next all-gather and died there with gloo's 'Connection
    closed by peer' traceback, printed over rank 1's message."""
    out = mp.Manager().dict()
    mp.spawn(_raise_together_on_rank, args=(str(tmp_path / "init"), out), nprocs=2)
    want = ("reward function f raised KeyError: 'x' on sample 6 (on rank 1)",
            "Traceback of the reward function (most recent call last):\n  ...\n")
    assert out[0] == want and out[1] == want


def test_reward_errors_number_samples_from_the_ranks_first_row():
    def picky(prompts, completions, **columns):
        if "b" in completions:
            raise KeyError("b")
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'b' on sample 7: prompt='p', completion='b'"):
        score_completions([picky], ["p", "p"], ["a", "b"], {}, first_row=6)
    with pytest.raises(ValueError, match=r"returned inf for sample 7 \(completion='b'\)"):
        score_completions([lambda prompts, completions: [1.0, float("inf")]], ["p", "p"], ["a", "b"], {},
                          first_row=6)


@pytest.mark.usefixtures("embedded_dir")
def test_only_rank_0_prints_an_error_every_rank_meets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main(cli_args(tmp_path / "run", "train.learnig_rate=1e-3")) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(cli_args(tmp_path / "run", "train.learnig_rate=1e-3")) == 2
    assert "unknown config key train.learnig_rate" in capsys.readouterr().err


def test_more_ranks_than_gpus_is_an_error_naming_both(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"torchrun started local rank 1, but this machine has 1 CUDA device\(s\): "
                                         r"one rank per GPU, so --nproc_per_node=1 at most") as caught:
        collectives.init(torch.device("cuda"))
    assert caught.value.rank_local  # printed by the rank that met it (rank 0 has a GPU)


@pytest.mark.usefixtures("embedded_dir")
def test_a_resume_on_another_rank_count_names_the_command_and_changes_nothing(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    config_toml = (run / "config.toml").read_text()
    assert config_toml.splitlines()[1] == "# ranks = 1"
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun --nproc_per_node=2 sets
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 1
    assert (f"--resume {run}: the run was trained on 1 rank(s) and this command starts 2; resume it on as "
            f"many: rlcore train --resume {run}") in capsys.readouterr().err
    assert (run / "config.toml").read_text() == config_toml  # max_steps=2 was not written


@pytest.mark.usefixtures("embedded_dir")
def test_the_run_prints_its_batch_geometry_and_a_skipped_step_raises_no_scheduler_warning(tmp_path, monkeypatch,
                                                                                          capsys):
    aggregate_nan_on(monkeypatch, {1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(config(tmp_path / "run", "train.max_steps=2"))
    assert [r["skipped"] for r in rows(tmp_path / "run")] == [True, False]
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert ("1 rank(s) x 16 completions = 4 prompts x G=4 per round; micro-batches of 16, an optimizer step "
            "every 1 (1 per round, mu=1)") in capsys.readouterr().out


def test_machines_sharing_a_cache_keep_the_first_build(tmp_path, monkeypatch):
    """Each builder works in directories of its own and renames the result into place; one that
    finishes second keeps the first's model."""
    pool = unique_problems("arithmetic", 200, 0)
    path = tmp_path / "embedded"
    build_embedded_model(path, pool, steps=2, batch_size=8, threads=1)
    first = (path / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded"]  # no .build-* or .tmp-* left

    other, real_rename = tmp_path / "other", os.rename

    def rename(src, dst):
        if Path(dst) == other:  # another machine renames its finished build there first
            real_rename(path, other)
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    assert build_embedded_model(other, pool, steps=2, batch_size=8, threads=1, seed=1) == other
    assert (other / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
