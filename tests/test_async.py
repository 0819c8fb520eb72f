"""Asynchronous rollouts (rollout.max_staleness, docs/async.md): a round sampled ahead by a thread
equals the synchronous loop at staleness 0, and at staleness 1 equals a reference written here: the
synchronous loop whose round k is sampled from the weights saved before round k - 1 trained."""

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rlcore.train
from rlcore import ConfigError
from rlcore.rollout.sources import SampledRound
from rlcore.train import next_prompts, sample_round, train
from test_train import assert_same_run, cli_args, config, rows, torchrun, without_timing
from test_resume import run_and_crash
from rlcore.cli import DEFAULT_CONFIG, main
from rlcore.config import load_config
from rlcore.run.checkpoints import latest_checkpoint

from test_train_tools import model_dir  # noqa: F401 (a fixture: the tiny Qwen2 with tools)

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread
# rounds of 2 optimizer steps (S = 2, GA = 1), so a round's version is not just the step before it
ROUNDS_OF_TWO = ["train.steps_per_generation=2", "loss.tis_mode=token_truncate", "train.max_steps=6",
                 "train.save_steps=6"]


def same_runs(a, b, step: int) -> None:
    """Runs a and b trained alike: metrics rows field for field, weights bit for bit."""
    assert_same_run(a, b, step)
    assert len(rows(a)) == step


def test_a_sampler_thread_at_staleness_0_equals_the_inline_loop(tmp_path):
    train(config(tmp_path / "inline", *ROUNDS_OF_TWO))
    train(config(tmp_path / "thread", *ROUNDS_OF_TWO, "rollout.sampler_thread=true"))
    same_runs(tmp_path / "inline", tmp_path / "thread", 6)
    assert {r["async/staleness"] for r in rows(tmp_path / "thread")} == {0}


class DelayedRounds:
    """The reference: synchronous, in line, but round k sampled by a copy of the policy holding the
    weights saved when round k - 1 started (round 0: the first weights)."""

    def __init__(self, run, state):
        self.run, self.saved = run, []  # (step, weights) at each round's start
        self.policy = copy.deepcopy(run.model)

    def next(self, state) -> SampledRound:
        run, geometry = self.run, self.run.geometry
        self.saved.append((state.step, {k: v.clone() for k, v in run.model.state_dict().items()}))
        step, saved = self.saved[max(0, len(self.saved) - 2)]
        self.policy.load_state_dict(saved)
        prompts = next_prompts(run.train_set, state.data_pos, geometry.prompts_per_round, run.cfg.train.seed)
        rows = [example for example in prompts for _ in range(geometry.G)]
        rollout, turns = sample_round(run, self.policy.eval(), rows, state.sampler, "reference")
        return SampledRound(rows, rollout, turns, step, state.sampler.get_state())

    def trained(self, step):
        pass

    def resume_point(self):
        return {}

    def close(self):
        pass


def test_staleness_1_equals_the_synchronous_loop_sampling_from_the_weights_before_the_last_round(tmp_path,
                                                                                                 monkeypatch):
    train(config(tmp_path / "async", *ROUNDS_OF_TWO, "rollout.max_staleness=1"))
    with monkeypatch.context() as patch:
        patch.setattr(rlcore.train, "round_source", DelayedRounds)
        train(config(tmp_path / "reference", *ROUNDS_OF_TWO, "rollout.max_staleness=1"))
    same_runs(tmp_path / "reference", tmp_path / "async", 6)
    assert [r["async/staleness"] for r in rows(tmp_path / "async")] == [0, 0, 2, 2, 2, 2]
    # and it is not the synchronous run: the rounds after the first came from older weights
    train(config(tmp_path / "sync", *ROUNDS_OF_TWO))
    assert without_timing(rows(tmp_path / "sync")[2]) != without_timing(rows(tmp_path / "async")[2])


def test_staleness_2_with_weights_published_every_3_steps_samples_from_the_versions_it_fixed(tmp_path):
    """Rounds of 2 steps, weight_sync_steps = 3: versions at steps 0, 3, 6, ...; round r is sampled
    with the newest one at the start of round r - 2: rounds 0-2 at 0, round 3 (start of round 1,
    step 2) at 0, round 4 (step 4) at 3. The staleness is the round's start minus that."""
    train(config(tmp_path / "run", *ROUNDS_OF_TWO, "rollout.max_staleness=2", "rollout.weight_sync_steps=3",
                 "train.max_steps=10", "train.save_steps=10"))
    staleness = [r["async/staleness"] for r in rows(tmp_path / "run")]
    assert staleness == [0, 0, 2, 2, 4, 4, 6, 6, 5, 5]


def test_a_resume_with_staleness_1_samples_the_round_in_flight_again_and_matches_an_uninterrupted_run(tmp_path):
    """The crash comes at the step-4 checkpoint; the resume starts from checkpoint-2, whose
    trainer state holds the weights fixed for round 2 (those of step 0): it samples that round
    again, the same, and ends where the uninterrupted run did."""
    steps = [*ROUNDS_OF_TWO, "rollout.max_staleness=1", "train.max_steps=4", "train.save_steps=2"]
    run_and_crash(tmp_path, steps, crash_step=4)
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-2"
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    same_runs(tmp_path / "a", tmp_path / "b", 4)
    assert [r["async/staleness"] for r in rows(tmp_path / "b")] == [0, 0, 2, 2]


def test_lora_at_staleness_1_samples_with_the_adapters_of_the_round_before(tmp_path, monkeypatch):
    """The sampler's copy holds the adapters too (the engine merges them into the weights it samples with)."""
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0.0", "train.learning_rate=1e-2"]
    train(config(tmp_path / "async", *ROUNDS_OF_TWO, *lora, "rollout.max_staleness=1"))
    with monkeypatch.context() as patch:
        patch.setattr(rlcore.train, "round_source", DelayedRounds)
        train(config(tmp_path / "reference", *ROUNDS_OF_TWO, *lora, "rollout.max_staleness=1"))
    assert [without_timing(r) for r in rows(tmp_path / "async")] == [without_timing(r) for r in
                                                                      rows(tmp_path / "reference")]


def test_a_failing_sampler_thread_stops_the_run_with_its_error(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise ValueError("the engine broke")

    monkeypatch.setattr(rlcore.train, "sample_completions", fails)
    with pytest.raises(RuntimeError, match="sampler thread failed: ValueError: the engine broke"):
        train(config(tmp_path / "run", "rollout.max_staleness=1", "train.max_steps=2"))


@pytest.mark.parametrize("setting, message", [
    ("rollout.max_staleness=-1", "rollout.max_staleness = -1 must be >= 0"),
    ("rollout.weight_sync_steps=0", "rollout.weight_sync_steps = 0 must be >= 1"),
    ("rollout.weight_sync_steps=2", "set max_staleness >= 1"),
    ("rollout.rollout_ranks=1", "rollout.rollout_ranks = 1 must be >= 0 and below the world size (1 rank(s))"),
    ("rollout.sampler_timeout=0", "rollout.sampler_timeout = 0"),
])
def test_bad_async_settings_are_config_errors_that_name_the_value(setting, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path / "run", setting)


def test_dynamic_sampling_cannot_be_sampled_ahead(tmp_path):
    with pytest.raises(ConfigError, match="its rounds cannot be sampled ahead"):
        config(tmp_path / "run", "rollout.filter_groups=true", "rollout.max_staleness=1")


def test_staleness_without_tis_warns_that_the_behaviour_policy_is_not_corrected_for(tmp_path):
    with pytest.warns(UserWarning, match="loss.tis_mode is off"):
        train(config(tmp_path / "run", "rollout.max_staleness=1", "train.max_steps=1"))


def test_the_sampled_rounds_weights_are_the_policys_not_a_view_that_training_changes(tmp_path):
    from rlcore.rollout.sources import weights_of
    model = torch.nn.Linear(2, 2)
    copied = weights_of(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copied["weight"], model.weight)


# ---- disaggregated: under torchrun, rollout.rollout_ranks = 1 of 2 ranks only samples ----

def test_a_sampler_rank_and_a_trainer_rank_at_staleness_0_equal_the_one_process_loop(tmp_path):
    train(config(tmp_path / "one", *ROUNDS_OF_TWO))
    out = torchrun(tmp_path, *cli_args(tmp_path / "two", *ROUNDS_OF_TWO, "rollout.rollout_ranks=1"))
    assert out.returncode == 0, out.stderr[-3000:]
    same_runs(tmp_path / "one", tmp_path / "two", 6)


def test_a_sampler_rank_at_staleness_1_samples_what_the_sampler_thread_does(tmp_path):
    """The same versions, RNG streams and rows, whether a thread or a rank samples them (and so the
    delayed reference above)."""
    train(config(tmp_path / "thread", *ROUNDS_OF_TWO, "rollout.max_staleness=1"))
    out = torchrun(tmp_path, *cli_args(tmp_path / "ranks", *ROUNDS_OF_TWO, "rollout.max_staleness=1",
                                       "rollout.rollout_ranks=1"))
    assert out.returncode == 0, out.stderr[-3000:]
    same_runs(tmp_path / "thread", tmp_path / "ranks", 6)
    assert [r["async/staleness"] for r in rows(tmp_path / "ranks")] == [0, 0, 2, 2, 2, 2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_sampler_rank_killed_mid_run_stops_the_trainer_with_an_error_and_the_run_resumes(tmp_path):
    """The two ranks are started as torchrun starts them (its environment variables), so the test
    can kill the sampler with SIGKILL itself and see what the trainer does: it stops within
    seconds, saying which rank and how to resume (not torchrun's teardown), and the resumed run
    ends where an uninterrupted one does."""
    steps = [*ROUNDS_OF_TWO, "rollout.max_staleness=1", "train.max_steps=12", "train.save_steps=2"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    command = [sys.executable, "-m", "rlcore.cli", *cli_args(tmp_path / "run", *steps, "rollout.rollout_ranks=1")]
    trainer, sampler = (subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1))
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5) and time.time() < deadline:
        time.sleep(0.02)
    sampler.send_signal(signal.SIGKILL)
    killed = time.time()
    _, err = trainer.communicate(timeout=120)
    sampler.communicate()
    assert trainer.returncode == 1 and time.time() - killed < 60
    assert "rlcore: error: sampler rank 1 stopped" in err and "Resume it with: torchrun --nproc_per_node=2" in err
    assert len(rows(tmp_path / "run")) < 12  # it stopped mid-run

    out = torchrun(tmp_path, "train", "--resume", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    train(config(tmp_path / "uninterrupted", *steps))  # the thread samples as the rank does (above)
    same_runs(tmp_path / "uninterrupted", tmp_path / "run", 12)


def test_tool_turns_and_environments_sampled_by_a_rank_equal_the_one_process_loop(tmp_path, model_dir):
    """A sampler rank sends each row's tool turns and its environment with the round: the trainer's
    reward functions score them as in one process (test_train_tools.py's tiny Qwen2 and Counter)."""
    import test_train_tools
    data = test_train_tools.chat_data(tmp_path)
    options = ["data.task=jsonl", f"data.path={data}", "rollout.environment_factory=test_train_tools:Counter",
               "loss.reward_funcs=['conftest:token_reward', 'test_train_tools:environment_reward']",
               "train.max_steps=2", "train.save_steps=2"]
    train(test_train_tools.config(model_dir, tmp_path / "one", *options))
    out = torchrun(tmp_path, "train", str(DEFAULT_CONFIG), *(a for o in [f"model.path={model_dir}", "train.device=cpu",
                                                     "data.num_train=64", "data.num_eval=4",
                                                     "data.max_prompt_length=1000", "rollout.num_generations=4",
                                                     "rollout.max_completion_length=48",
                                                     "train.per_device_train_batch_size=8",
                                                     "train.eval_steps=0", "train.eval_max_completion_length=4",
                                                     "rollout.tools=['test_train_tools:add']",
                                                     f"train.output_dir={tmp_path / 'two'}", *options,
                                                     "rollout.rollout_ranks=1"] for a in ("--set", o)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert [without_timing(r) for r in rows(tmp_path / "two")] == [without_timing(r) for r in rows(tmp_path / "one")]


def torchrun_ranks(tmp_path, ranks: int, *args) -> subprocess.CompletedProcess:
    """`ranks` torchrun ranks of `rlcore` with `args` (test_train.torchrun's, for any count)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "rlcore.cli", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_two_sharded_trainers_and_a_sampler_rank_train_as_two_sharded_ranks_and_resume_exactly(tmp_path):
    """FSDP2 over the training ranks' own group: at staleness 0, 2 sharded trainers fed by 1
    sampler rank equal 2 sharded ranks that sample for themselves; at staleness 1, a run stopped at
    its step-2 checkpoint and resumed (the version fixed for round 3 in its sharded checkpoint's
    state) ends where an uninterrupted one does."""
    sharded = ["train.fsdp=true", "train.per_device_train_batch_size=8", "train.lr_scheduler_type=constant",
               "train.max_steps=4", "train.save_steps=2"]
    for name, ranks, extra in (("two", 2, []), ("three", 3, ["rollout.rollout_ranks=1"])):
        out = torchrun_ranks(tmp_path, ranks, *cli_args(tmp_path / name, *sharded, *extra))
        assert out.returncode == 0, out.stderr[-3000:]
    assert [without_timing(r) for r in rows(tmp_path / "three")] == [without_timing(r) for r in rows(tmp_path / "two")]
    assert_same_run(tmp_path / "two", tmp_path / "three", 4)

    stale = [*sharded, "rollout.rollout_ranks=1", "rollout.max_staleness=1", "loss.tis_mode=token_truncate"]
    out = torchrun_ranks(tmp_path, 3, *cli_args(tmp_path / "whole", *stale))
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun_ranks(tmp_path, 3, *cli_args(tmp_path / "resumed", *stale, "train.max_steps=2"))
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun_ranks(tmp_path, 3, "train", "--resume", str(tmp_path / "resumed"), "--set", "train.max_steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(tmp_path / "whole", tmp_path / "resumed", 4)
    assert [r["async/staleness"] for r in rows(tmp_path / "resumed")] == [0, 1, 1, 1]


def test_trls_async_names_load_and_the_others_name_rlcores_options():
    cfg = load_config(None, ["max_staleness=2", "weight_sync_steps=3"])  # TRL's flat AsyncGRPOConfig keys
    assert cfg.rollout.max_staleness == 2 and cfg.rollout.weight_sync_steps == 3
    with pytest.raises(ConfigError, match="heartbeat_stale_after_s: TRL's AsyncGRPOConfig; rlcore's is "
                                          "rollout.sampler_timeout"):
        load_config(None, ["heartbeat_stale_after_s=60"])
