"""Resume and crashes: a run killed at any point (a checkpoint half written, a reward function that
fails mid-run, a metrics row torn) resumes from its newest checkpoint and ends at the weights and
metrics of a run that was never interrupted, under options that keep more state too."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlcore.run.rundir
from rlcore.cli import main
from rlcore.config import load_config
from rlcore.models.hf_checkpoint import load_model
from rlcore.run.checkpoints import latest_checkpoint
from rlcore.train import train
from test_train import (aggregate_nan_on, assert_same_run, cli_args, config, first_digit,
                        first_digit_if_odd_sum, rows)  # noqa: F401 (RESUMED_OPTIONS names the last by module)

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread


def test_a_run_ended_inside_a_round_says_so(tmp_path, capsys):
    # mu = 2: a round is 2 optimizer steps. max_steps=3 stops after the first step of the
    # second round, whose other step a later --resume would not replay; max_steps=2 does not.
    train(config(tmp_path / "cut", "train.max_steps=3", "loss.num_iterations=2"))
    assert "ended the run inside a round of 2 optimizer steps" in capsys.readouterr().out
    train(config(tmp_path / "whole", "train.max_steps=2", "loss.num_iterations=2"))
    assert "inside a round" not in capsys.readouterr().out
    # resumed from the cut at step 3, rounds are steps 4-5, 6-7: 5 ends one, 6 does not
    train(config(tmp_path / "cut", "train.max_steps=5", "loss.num_iterations=2"), resume=tmp_path / "cut")
    assert "inside a round" not in capsys.readouterr().out
    train(config(tmp_path / "cut", "train.max_steps=6", "loss.num_iterations=2"), resume=tmp_path / "cut")
    assert "ended the run inside a round of 2 optimizer steps" in capsys.readouterr().out


class Killed(BaseException):
    """Stands in for the process dying: nothing after it runs, only what is on disk survives."""


def run_and_crash(tmp_path, steps, crash_step=4) -> tuple[Path, Path]:
    """Run A: the CLI with `steps`, uninterrupted, in tmp_path/a. Run B: the same in tmp_path/b,
    killed as it reaches its step-`crash_step` checkpoint (the metrics rows before it written)."""
    assert main(cli_args(tmp_path / "a", *steps)) == 0
    real = rlcore.run.rundir.save_checkpoint

    def dies(run, step, *args, **kwargs):
        if step == crash_step:
            raise Killed
        return real(run, step, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rlcore.run.rundir, "save_checkpoint", dies)
        with pytest.raises(Killed):
            main(cli_args(tmp_path / "b", *steps))
    return tmp_path / "a", tmp_path / "b"


def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path, capsys):
    # Run B dies when it reaches the step-4 checkpoint, after writing metrics rows 3 and 4:
    # on disk it has checkpoint-2, `latest` -> checkpoint-2, and two rows the resume must drop.
    steps = ["train.max_steps=4", "train.save_steps=2", "train.log_completions=true", "train.num_completions_to_print=0"]
    run_and_crash(tmp_path, steps)
    assert [r["step"] for r in rows(tmp_path / "b")] == [1, 2, 3, 4]
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-2"

    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert_same_run(tmp_path / "a", tmp_path / "b", 4)
    completions = [(run / "completions.jsonl").read_text().splitlines() for run in (tmp_path / "a", tmp_path / "b")]
    assert len(completions[0]) == 4 * 16 and completions[0] == completions[1]  # the crash's rows dropped


JUDGE = {"down_from_step": None}  # set by a test: the optimizer step from which `judge` fails


def judge(prompts, completions, trainer_state, **columns):
    """`first_digit` as scored by a remote judge, which may be down (JUDGE)."""
    down = JUDGE["down_from_step"]
    if down is not None and trainer_state.global_step >= down:
        raise TimeoutError("the judge timed out")
    return first_digit(prompts, completions)


def test_a_reward_function_failing_mid_run_keeps_the_round_before_and_resumes_as_if_it_had_not(tmp_path, capsys,
                                                                                              monkeypatch):
    """No checkpoint is due (save_steps = 0, only at the end), and the reward function fails in
    round 3: the run keeps checkpoint-2, the state before that round (weights, optimizer, the
    round's data position and RNG states). Once it works again, --resume gives the weights,
    metrics rows and completions of a run in which it never failed."""
    steps = ["train.max_steps=4", f"loss.reward_funcs=['{__name__}:judge']", "train.log_completions=true",
             "train.num_completions_to_print=0"]
    assert main(cli_args(tmp_path / "a", *steps)) == 0
    monkeypatch.setitem(JUDGE, "down_from_step", 2)
    assert main(cli_args(tmp_path / "b", *steps)) == 1
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-2"
    assert "keeps checkpoint-2, the run as it was when the function failed" in capsys.readouterr().err
    monkeypatch.setitem(JUDGE, "down_from_step", None)
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    assert_same_run(tmp_path / "a", tmp_path / "b", 4)
    completions = [(run / "completions.jsonl").read_text() for run in (tmp_path / "a", tmp_path / "b")]
    assert completions[0] == completions[1]


RESUMED_OPTIONS = {  # with test_train_options.py's synced reference and adaptive entropy control
    "sapo, constant schedule, top_p": ["loss.policy_loss=sapo", "train.lr_scheduler_type=constant",
                                       "rollout.top_p=0.9"],
    "tis, entropy and off-policy masks, top_k": ["loss.tis_mode=token_truncate", "loss.top_entropy_quantile=0.5",
                                                 "loss.off_policy_mask_threshold=0.01", "rollout.top_k=5"],
    # rounds of S * mu / GA = 4 steps, checkpointed at round ends: the crash comes at the second
    "cispo, bnpo, mu = 2, S = 2, linear schedule": ["loss.policy_loss=cispo", "loss.epsilon_high=5.0",
                                                    "loss.loss_type=bnpo", "loss.num_iterations=2",
                                                    "train.steps_per_generation=2", "train.lr_scheduler_type=linear",
                                                    "train.max_steps=8", "train.save_steps=4"],
    "vespo, bf16, min_p, GA = 2, entropy bonus": ["loss.policy_loss=vespo", "train.bf16=true", "rollout.min_p=0.1",
                                                  "train.per_device_train_batch_size=8",
                                                  "train.gradient_accumulation_steps=2", "loss.entropy_coef=0.01"],
    # several generation batches a round, the data position past N/G prompts a round, a cap met
    "dynamic sampling with a cap, GA = 2": ["rollout.filter_groups=true", "rollout.max_num_gen_batches=2",
                                            f"loss.reward_funcs=['{__name__}:first_digit_if_odd_sum']",
                                            "train.per_device_train_batch_size=8",
                                            "train.gradient_accumulation_steps=2"],
}


@pytest.mark.parametrize("case", RESUMED_OPTIONS)
def test_resume_after_a_crash_matches_an_uninterrupted_run_with_other_options(case, tmp_path):
    # As above (a crash at the last checkpoint, a resume from the one before), under options that
    # keep more state or draw more random numbers: the resumed run ends at the same weights and
    # writes the same metrics rows.
    steps = ["train.max_steps=4", "train.save_steps=2", *RESUMED_OPTIONS[case]]  # later keys win
    last = int(next(o for o in reversed(steps) if o.startswith("train.max_steps=")).split("=")[1])
    run_and_crash(tmp_path, steps, crash_step=last)
    assert latest_checkpoint(tmp_path / "b").name == f"checkpoint-{last // 2}"
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    assert_same_run(tmp_path / "a", tmp_path / "b", last)


def test_a_run_started_from_python_resumes_from_the_command_line_with_its_own_config(tmp_path):
    run = tmp_path / "run"
    cfg = config(run, "train.max_steps=1", "train.learning_rate=3e-3", "rollout.temperature=0.9")
    train(cfg)  # train() writes config.toml itself (it was the CLI's job: a resume then got the default config)
    assert load_config(str(run / "config.toml")) == cfg
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 0
    resumed = load_config(str(run / "config.toml"))
    assert resumed.train.max_steps == 2 and resumed.train.learning_rate == 3e-3 and resumed.rollout.temperature == 0.9
    assert resumed.loss.reward_funcs == cfg.loss.reward_funcs and [r["step"] for r in rows(run)] == [1, 2]


MAX_STEPS_SEEN = []


def first_digit_seeing_max_steps(prompts, completions, trainer_state, **columns):
    """first_digit, recording the run length reward functions are told (TRL's trainer_state)."""
    MAX_STEPS_SEEN.append((trainer_state.global_step, trainer_state.max_steps))
    return first_digit(prompts, completions)


def test_resume_with_a_larger_max_steps_follows_the_new_schedule(tmp_path):
    # A finished 2-step cosine run ends at rate 0; extended to 4 steps, steps 3 and 4 run at the
    # rates of a 4-step run, not at the old schedule's final 0 (it was restored with the optimizer).
    # Reward functions see the new length; eval.jsonl keeps the stopped run's final evaluation.
    a, b = tmp_path / "a", tmp_path / "b"
    train(config(a, "train.max_steps=4", "train.lr_scheduler_type=cosine"))
    funcs = f"loss.reward_funcs=['{__name__}:first_digit_seeing_max_steps']"
    MAX_STEPS_SEEN.clear()
    train(config(b, "train.max_steps=2", "train.lr_scheduler_type=cosine", funcs))
    train(config(b, "train.max_steps=4", "train.lr_scheduler_type=cosine", funcs), resume=b)
    assert [r["lr"] for r in rows(b)][2:] == [r["lr"] for r in rows(a)][2:]
    assert rows(a)[2]["lr"] > 0
    # (global_step, max_steps) at each call: the evaluation before training, rounds 1-2, the final
    # evaluation of the 2-step run; then the resumed run's rounds 3-4 and its final evaluation
    assert MAX_STEPS_SEEN == [(0, 2), (0, 2), (1, 2), (2, 2), (2, 4), (3, 4), (4, 4)]
    evals = [json.loads(ln)["step"] for ln in (b / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2, 4]  # before, the stopped run's end (step 2), the resumed run's end


def test_resume_keeps_counting_nonfinite_steps_in_a_row(tmp_path, monkeypatch):
    # Step 2 is non-finite and checkpointed; step 3 is too: with max_nonfinite_steps=2 the resumed
    # run stops at step 3, as an uninterrupted one does (the count in a row is saved).
    run = tmp_path / "run"
    aggregate_nan_on(monkeypatch, {2})
    train(config(run, "train.max_steps=2", "train.max_nonfinite_steps=2", "train.lr_scheduler_type=constant"))
    monkeypatch.undo()
    aggregate_nan_on(monkeypatch, {1})  # the resumed run's first step is step 3
    with pytest.raises(FloatingPointError, match=r"2 non-finite steps in a row"):
        train(config(run, "train.max_steps=4", "train.max_nonfinite_steps=2", "train.lr_scheduler_type=constant"),
              resume=run)


def test_resume_drops_a_metrics_row_torn_by_the_crash(tmp_path, monkeypatch):
    # The process dies while appending row 3 (after checkpoint-2): the file ends in half a row.
    import rlcore.run.steplog

    run, real = tmp_path / "run", rlcore.run.steplog.log_line

    def torn_at_step_3(step, *args):
        if step == 3:
            text = (run / "metrics.jsonl").read_text()
            (run / "metrics.jsonl").write_text(text[:len(text) - 100])
            raise Killed
        return real(step, *args)

    monkeypatch.setattr(rlcore.run.steplog, "log_line", torn_at_step_3)
    with pytest.raises(Killed):
        main(cli_args(run, "train.max_steps=3", "train.save_steps=1", "train.logging_steps=1"))
    monkeypatch.undo()
    assert latest_checkpoint(run).name == "checkpoint-2"
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3]


HARNESS = """
import pathlib, sys, time
import rlcore.models.hf_checkpoint
from rlcore.cli import main
from rlcore.config import load_config

real, calls = rlcore.models.hf_checkpoint.save_file, []

def save_file_then_hang(tensors, filename, metadata=None):
    calls.append(filename)
    real(tensors, filename, metadata=metadata)
    if len(calls) == 2:  # the second checkpoint: leave its weights half written and stall
        data = pathlib.Path(filename).read_bytes()
        pathlib.Path(filename).write_bytes(data[:len(data) // 2])
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(600)

rlcore.models.hf_checkpoint.save_file = save_file_then_hang
sys.exit(main(sys.argv[2:]))
"""


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, capsys):
    run, ready = tmp_path / "run", tmp_path / "ready"
    (tmp_path / "harness.py").write_text(HARNESS)
    args = cli_args(run, "train.max_steps=3", "train.save_steps=1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}  # first_digit
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "harness.py"), str(ready), *args],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.time() < deadline, "the harness never reached the second checkpoint"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (run / ".checkpoint-2.tmp").is_dir()  # killed mid-write
    assert latest_checkpoint(run).name == "checkpoint-1"
    load_model(run / "checkpoint-1" / "model")

    assert main(["train", "--resume", str(run)]) == 0
    assert f"resumed from {run / 'checkpoint-1'} at step 1" in capsys.readouterr().out
    assert latest_checkpoint(run).name == "checkpoint-3"
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert not (run / ".checkpoint-2.tmp").exists()
