"""The `rlcore` command line: what it prints, the errors it turns bad input into (exit codes,
messages naming the problem and the fix), --resume's refusals, and `rlcore options`. The runs
use the embedded model (conftest) and test_train.py's `SMALL` overrides and helpers."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlcore.run.checkpoints import kept_checkpoint
from rlcore.cli import interrupt, main
from rlcore.run.state import read_state
from test_train import NUM_EVAL, SEED, SMALL, cli_args, rows, weights

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread


def test_cli_last_line_reports_held_out_accuracy_before_and_after(tmp_path, capsys):
    assert main(cli_args(tmp_path / "run", "train.max_steps=1")) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"held-out accuracy: before=(\d\.\d{3}) after=(\d\.\d{3})", last)
    assert m, last
    for acc in map(float, m.groups()):  # a fraction of the NUM_EVAL held-out problems
        assert 0 <= acc <= 1 and abs(acc * NUM_EVAL - round(acc * NUM_EVAL)) <= NUM_EVAL * 5e-4


def test_cli_options_prints_every_option_and_train_help_points_to_it(capsys):
    from rlcore.config.values import options_table

    assert main(["options"]) == 0
    assert capsys.readouterr().out.strip() == options_table().strip()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "rlcore options" in capsys.readouterr().out


@pytest.mark.parametrize("args, hint", [
    (["--config", "grpo.toml"], "--config; give the config file without a flag: rlcore train grpo.toml"),
    (["--max_steps", "5"], "--max_steps; rlcore sets options with --set: --set max_steps=5"),
    (["--learning-rate=1e-6"], "--learning-rate=1e-6; rlcore sets options with --set: --set learning_rate=1e-6"),
    (["--resume_from_checkpoint", "out/checkpoint-5"],
     "--resume_from_checkpoint; continue a run with --resume RUN_DIR"),
])
def test_cli_flags_from_trl_scripts_name_what_rlcore_takes_instead(args, hint, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", *args])
    assert exit.value.code == 2 and f"rlcore: error: unrecognized arguments: {hint}" in capsys.readouterr().err


def test_cli_shows_rlcore_warnings_as_plain_lines(tmp_path, capsys):
    assert main(cli_args(tmp_path / "run", "train.max_steps=1", "disable_tqdm=true")) == 0
    err = capsys.readouterr().err
    assert "rlcore: warning: TRL's disable_tqdm = True is ignored" in err and "UserWarning" not in err


def test_cli_prints_each_warning_once_even_from_a_dataclass_init(tmp_path, capsys):
    # validate() runs when the config loads and when the run starts; cispo's warning comes from
    # Config.__post_init__, whose caller is the dataclass's generated __init__ (file "<string>")
    assert main(cli_args(tmp_path / "run", "train.max_steps=1", "loss.importance_sampling_level=sequence",
                         "loss.policy_loss=cispo")) == 0
    err = capsys.readouterr().err
    assert err.count("rlcore: warning: loss.importance_sampling_level = 'sequence' (GSPO)") == 1, err
    assert err.count("rlcore: warning: loss.policy_loss='cispo' uses loss.epsilon_high") == 1, err
    assert "UserWarning" not in err


def test_cli_imports_reward_modules_from_the_current_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "cwd_rewards_for_cli_test.py").write_text(
        "def longer(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])  # as the script has it
    assert main(cli_args(tmp_path / "run", "train.max_steps=1",
                         "loss.reward_funcs=['cwd_rewards_for_cli_test:longer']")) == 0, capsys.readouterr().err
    assert "reward/cwd_rewards_for_cli_test:longer/mean" in rows(tmp_path / "run")[0]


def test_cli_a_reward_function_that_cannot_take_the_arguments_fails_before_the_run_starts(tmp_path, capsys):
    assert main(cli_args(tmp_path / "run", f"loss.reward_funcs=['{__name__}:wrong_signature']")) == 1
    err = capsys.readouterr().err
    assert "reward function wrong_signature cannot be called" in err and "missing a required argument: 'completion'" in err
    assert not (tmp_path / "run").exists()  # was: after the "before" evaluation, leaving a run directory


def wrong_signature(completion, answer_text):  # TRL passes prompts=, completions=, ... and the columns
    return [0.0]


def test_cli_resume_of_a_run_without_config_toml_asks_for_its_config(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    (run / "config.toml").unlink()  # deleted by hand
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 1
    assert f"the run directory has no config.toml; give the config the run was started with: rlcore train " \
           f"CONFIG --resume {run}" in capsys.readouterr().err
    assert not (run / "config.toml").exists() and (run / "latest").read_text().strip() == "checkpoint-1"


def test_cli_resume_keeps_the_embedded_model_its_data_seed_built(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    recorded = (run / "config.toml").read_bytes()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2", "--set", f"data.seed={SEED + 1}"]) == 1
    assert (f"--resume {run}: model.path = embedded (data.seed = {SEED + 1}, data.num_eval = {NUM_EVAL}), but the "
            f"run started from embedded (data.seed = {SEED}, data.num_eval = {NUM_EVAL}) (its config.toml); a resumed run "
            f"keeps its model and tokenizer: drop the new data.seed / data.num_eval") in capsys.readouterr().err
    assert (run / "config.toml").read_bytes() == recorded  # and no second model was built


def test_cli_resume_with_other_data_says_what_changed(tmp_path, capsys, monkeypatch):
    """Another data.path / seed / num_train on --resume (was silent): the checkpoint's data position
    counts rows of the old order, and the held-out set is drawn again."""
    from rlcore.config.options import DataArgs
    from rlcore.run.rundir import RunDir

    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 0
    assert "with other data" not in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3", "--set", "data.num_train=50"]) == 0
    err = capsys.readouterr().err
    assert f"rlcore: warning: --resume {run} with other data: data.num_train = 50 (was " in err
    assert "the held-out set is drawn again (it may hold prompts the run trained on)" in err
    # paths: another spelling of the recorded file is the same data
    data = tmp_path / "d.jsonl"
    data.write_text("")
    (tmp_path / "config.toml").write_text(f'[data]\ntask = "jsonl"\npath = "{data}"\nseed = 3\n')
    monkeypatch.chdir(tmp_path)
    assert RunDir(tmp_path).changed_data(DataArgs(task="jsonl", path="./d.jsonl", seed=3)) == []
    assert RunDir(tmp_path).changed_data(DataArgs(task="jsonl", path="e.jsonl", seed=4)) == [
        f"data.path = 'e.jsonl' (was '{data}')", "data.seed = 4 (was 3)"]


def test_cli_resume_keeps_the_runs_model_and_needs_it(tmp_path, capsys, embedded_dir, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(embedded_dir, model)
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    assert main(cli_args(run, "train.max_steps=1", "model.path=model")) == 0  # recorded as an absolute path
    monkeypatch.chdir(run)
    recorded = (run / "config.toml").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(embedded_dir, other)
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2", "--set", f"model.path={other}"]) == 1
    assert (f"--resume {run}: model.path = {other}, but the run started from {model} (its config.toml); a resumed "
            f"run keeps its model and tokenizer") in capsys.readouterr().err  # was: trained on with other's tokenizer
    model.rename(tmp_path / "moved")
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 1
    assert f"the run's model.path {model} is gone (a relative path is taken from the current directory)" in \
        capsys.readouterr().err
    assert (run / "config.toml").read_bytes() == recorded and [r["step"] for r in rows(run)] == [1]
    # the recorded one gone, its new place is the model; another spelling of a directory is the same one
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2", "--set", "model.path=../moved"]) == 0
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3", "--set", "model.path=../moved/"]) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3]


def test_cli_ctrl_c_says_what_is_kept_and_how_to_continue(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("rlcore.train.train", interrupted)
    try:  # a KeyboardInterrupt the CLI lets through would stop the whole pytest session
        codes = [main(["train", "--resume", str(run), "--set", "train.max_steps=2"]),
                 main(cli_args(tmp_path / "new", "train.max_steps=1"))]
    except KeyboardInterrupt:
        pytest.fail("the command line let Ctrl-C through as a KeyboardInterrupt")
    err = capsys.readouterr().err
    assert codes == [130, 130] and "Traceback" not in err
    assert f"rlcore: interrupted; {run} keeps checkpoint-1: continue with rlcore train --resume {run}" in err
    assert "no checkpoint was written yet" in err


def test_cli_sigterm_stops_the_run_as_ctrl_c_does(tmp_path, capsys, monkeypatch):
    """SIGTERM (`kill`, job schedulers, torchrun when it is terminated itself): the same message
    and exit status as Ctrl-C, and the previous handler back after the command."""
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0

    def terminated(*args, **kwargs):
        assert signal.getsignal(signal.SIGTERM) is interrupt, "no handler: SIGTERM would end pytest itself"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises in here
        pytest.fail("SIGTERM did not stop the run")

    def second_sigterm_while_reporting(run):  # schedulers send more than one: it must not cut the report short
        os.kill(os.getpid(), signal.SIGTERM)
        return kept_checkpoint(run)

    monkeypatch.setattr("rlcore.train.train", terminated)
    monkeypatch.setattr("rlcore.run.checkpoints.kept_checkpoint", second_sigterm_while_reporting)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["train", "--resume", str(run), "--set", "train.max_steps=2"])
    except KeyboardInterrupt:
        pytest.fail("the command line let SIGTERM through as a KeyboardInterrupt")
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert f"rlcore: interrupted; {run} keeps checkpoint-1: continue with rlcore train --resume {run}" in err
    assert signal.getsignal(signal.SIGTERM) is before


def test_cli_a_file_in_the_current_directory_does_not_shadow_a_dependency(tmp_path):
    (tmp_path / "jinja2.py").write_text("raise ImportError('the user file, not jinja2')\n")
    run = subprocess.run([sys.executable, "-I", "-c", "import sys; from rlcore.cli import main; "
                          "sys.exit(main(['train', '--resume', 'nowhere']))"],  # -I: no cwd on the path, as `rlcore`
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "--resume nowhere: no such run directory" in run.stderr, run.stderr


def test_cli_says_when_a_config_builds_on_the_embedded_default(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rlcore.train.train", lambda cfg, resume=None: {"before": None, "after": None})
    monkeypatch.setattr("rlcore.cli.plot_metrics", lambda run: "")
    (tmp_path / "sapo.toml").write_text("[loss]\npolicy_loss = 'sapo'\n")
    assert main(["train", str(tmp_path / "sapo.toml")]) == 0
    assert (f"{tmp_path / 'sapo.toml'} names no model (model.path), so it trains the embedded tiny model; the keys "
            f"it leaves unset take the embedded default's values") in capsys.readouterr().err
    assert main(["train", str(tmp_path / "sapo.toml"), "--set", "model.path=/ckpt"]) == 0
    assert "names no model" not in capsys.readouterr().err


def test_cli_without_a_config_naming_a_model_takes_rlcores_defaults(tmp_path, capsys, monkeypatch):
    """The embedded default run's recipe (4-token completions, lr 1e-4) is for its tiny model: a
    --set that names another model runs on the dataclass defaults (TRL's values), and says so."""
    import rlcore.train
    from rlcore.config.options import RolloutArgs, TrainArgs

    seen = []
    monkeypatch.setattr(rlcore.train, "train", lambda cfg, resume=None: seen.append(cfg) or {"before": 0, "after": 0})
    monkeypatch.setattr("rlcore.cli.plot_metrics", lambda run: "")
    for model in ("/ckpt/qwen", "embedded"):
        assert main(["train", "--set", f"model_name_or_path={model}", "--set", f"train.output_dir={tmp_path}"]) == 0
    real, embedded = seen
    assert (real.rollout.max_completion_length, real.train.learning_rate) == (RolloutArgs.max_completion_length,
                                                                              TrainArgs.learning_rate)
    assert (embedded.rollout.max_completion_length, embedded.train.learning_rate) == (4, 1e-4)  # rlcore/config/default.toml
    err = capsys.readouterr().err
    assert err.count("rlcore: no config file, and --set names a model (/ckpt/qwen): the options it leaves unset "
                     "take rlcore's defaults") == 1, err


def test_cli_refuses_to_train_over_an_existing_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    before = weights(run / "checkpoint-1" / "model")
    assert main(cli_args(run, "train.max_steps=1")) == 1
    assert f"{run} already holds checkpoints; continue it with --resume" in capsys.readouterr().err
    assert all(torch.equal(v, weights(run / "checkpoint-1" / "model")[k]) for k, v in before.items())


def test_cli_resume_of_a_directory_without_checkpoints_is_an_error(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 1
    assert "no such run directory" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 1
    assert "no checkpoint there" in capsys.readouterr().err
    ck = tmp_path / "run" / "checkpoint-3"  # the Trainer's resume_from_checkpoint takes a checkpoint
    ck.mkdir(parents=True)
    (ck / "run_state.json").write_text("{}")
    assert main(["train", "--resume", str(ck)]) == 1
    assert f"it is a checkpoint: --resume takes its run directory, --resume {ck.parent}" in capsys.readouterr().err


def test_cli_resume_refuses_a_new_output_dir_it_would_ignore(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    before = sorted(p.name for p in run.iterdir())
    assert main(["train", "--resume", str(run), "--set", f"train.output_dir={tmp_path / 'elsewhere'}"]) == 2
    assert (f"--resume {run} continues that run in its own directory, so --set train.output_dir="
            f"{tmp_path / 'elsewhere'} would be ignored") in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before and not (tmp_path / "elsewhere").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_an_error_naming_the_fix(tmp_path, capsys):
    assert main(cli_args(tmp_path / "run", "train.device=cuda")) == 1  # was a raw traceback from pin_memory
    assert "train.device = 'cuda', but this machine has no CUDA device" in capsys.readouterr().err


def test_cli_resume_of_a_finished_run_says_there_is_nothing_to_train_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=2")) == 0
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra in ([], ["--set", "train.max_steps=1"]):
        capsys.readouterr()
        assert main(["train", "--resume", str(run), *extra]) == 1
        err = capsys.readouterr().err
        assert "its checkpoint is at step 2 and train.max_steps = " in err and "--set train.max_steps=102" in err
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # config.toml, eval.jsonl kept


def test_cli_output_dir_that_is_a_file_is_an_error(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    assert main(cli_args(tmp_path / "afile", "train.max_steps=1")) == 1
    assert f"train.output_dir = {tmp_path / 'afile'} is a file; choose a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "keep me"


def test_cli_output_dir_under_a_file_or_unwritable_is_named_before_anything_loads(tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    assert main(cli_args(tmp_path / "afile" / "sub", "train.max_steps=1")) == 1
    assert f"train.output_dir = {tmp_path / 'afile' / 'sub'} is inside {tmp_path / 'afile'}, which is a file" \
        in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        assert main(cli_args(tmp_path / "locked" / "run", "train.max_steps=1")) == 1
        assert f"{tmp_path / 'locked'} is not writable" in capsys.readouterr().err


def test_cli_will_not_train_into_a_directory_of_other_checkpoints(tmp_path, capsys):
    """Unsloth's and the Trainer's output_dir holds checkpoint-<step>/ directories too; rlcore's
    rotation must never delete them, nor the model being trained from."""
    outputs = tmp_path / "outputs"
    for name in ("checkpoint-500", "checkpoint-1000"):
        (outputs / name).mkdir(parents=True)
        (outputs / name / "trainer_state.json").write_text("{}")
    assert main(cli_args(outputs, "train.max_steps=1")) == 1
    err = capsys.readouterr().err
    assert f"train.output_dir = {outputs} already holds files that are not an rlcore run's (checkpoint-1000, " \
           f"checkpoint-500)" in err and "choose a new or empty train.output_dir" in err
    assert sorted(p.name for p in outputs.iterdir()) == ["checkpoint-1000", "checkpoint-500"]
    mine = tmp_path / "here"  # output_dir = "." beside the user's own config.toml
    mine.mkdir()
    (mine / "config.toml").write_text("# my recipe\n[train]\nmax_steps = 1\n")
    assert main(cli_args(mine, "train.max_steps=1")) == 1
    assert "already holds files that are not an rlcore run's (config.toml)" in capsys.readouterr().err
    assert (mine / "config.toml").read_text().startswith("# my recipe")


def test_a_new_run_may_share_its_directory_with_a_log_and_dotfiles(tmp_path, capsys):
    run = tmp_path / "run"
    (run / ".ipynb_checkpoints").mkdir(parents=True)
    (run / "train.log").write_text("started\n")  # tee or a batch system's --output, opened before the run
    (run / ".gitkeep").write_text("")
    assert main(cli_args(run, "train.max_steps=1")) == 0
    assert (run / "train.log").read_text() == "started\n" and (run / "latest").is_file()


def test_checkpoint_rotation_deletes_only_rlcore_checkpoints(tmp_path):
    from rlcore.run.checkpoints import checkpoints

    run = tmp_path / "run"
    for step in (1, 2, 3):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / "checkpoint-2" / "run_state.json").write_text("{}")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert checkpoints(run) == [run / "checkpoint-2"]


def test_a_save_does_not_replace_a_directory_that_is_not_an_rlcore_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "notes.txt").write_text("mine")
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 1
    assert f"{run / 'checkpoint-2'} exists and is not an rlcore checkpoint" in capsys.readouterr().err
    assert (run / "checkpoint-2" / "notes.txt").read_text() == "mine"
    assert (run / "latest").read_text() == "checkpoint-1"
    assert not (run / ".checkpoint-2.tmp").exists()  # refused before a copy of the model was written


@pytest.mark.parametrize("where, error", [
    ("save_file", "SafetensorError: Error while serializing: I/O error: File too large (os error 27)"),
    ("state.save_file", "OSError: [Errno 28] No space left on device"),
])
def test_a_checkpoint_that_cannot_be_written_is_named_and_the_previous_one_kept(where, error, tmp_path, capsys,
                                                                              monkeypatch):
    import errno

    import safetensors

    import rlcore.models.hf_checkpoint
    import rlcore.run.state

    saves = []

    def failing(real, exc):
        def save(*args, **kwargs):
            saves.append(None)
            if len(saves) == 2:
                raise exc
            return real(*args, **kwargs)
        return save

    if where == "save_file":
        exc = safetensors.SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
        monkeypatch.setattr(rlcore.models.hf_checkpoint, "save_file", failing(rlcore.models.hf_checkpoint.save_file, exc))
    else:
        exc = OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(rlcore.run.state, "save_file", failing(rlcore.run.state.save_file, exc))
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=2", "train.save_steps=1")) == 1
    err = capsys.readouterr().err
    assert f"rlcore: error: could not write checkpoint {run / 'checkpoint-2'} ({error}); {run / 'checkpoint-1'} " \
           f"is intact: make room, then continue with --resume {run}" in err, err
    assert sorted(p.name for p in run.glob("*checkpoint-*")) == ["checkpoint-1"]  # the partial save is removed
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0


def test_cli_resume_from_a_damaged_trainer_state_names_it_and_the_way_back(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=2", "train.save_steps=1")) == 0
    (run / "checkpoint-2" / "run_state.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{trunc")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'checkpoint-2' / 'run_state.safetensors'} cannot be read" in err
    assert f"the run keeps checkpoint-1: write that name into {run / 'latest'} to resume from it" in err
    (run / "latest").write_text("checkpoint-1")  # the way back the message gives
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3"]) == 0
    assert [r["step"] for r in rows(run)] == [1, 2, 3]


class RunsCode:
    """A pickle payload: unpickling it calls os.system, as a tampered trainer_state.pt could."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cli_resume_never_unpickles_a_trainer_state(tmp_path, capsys):
    """A run directory may come from someone else: its trainer state loads without running code. A
    pickled trainer_state.pt (an unreleased rlcore's) is refused, naming the file, never unpickled."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    ck = run / "checkpoint-1"
    state = read_state(ck)
    for name in ("run_state.json", "run_state.safetensors"):
        (ck / name).unlink()
    torch.save({**state, "evil": RunsCode(marker)}, ck / "trainer_state.pt")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 1
    assert f"{ck / 'trainer_state.pt'} is a pickled trainer state, which rlcore does not read" in capsys.readouterr().err
    assert not marker.exists()


def test_cli_resume_from_truncated_weights_names_them_and_the_way_back(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=2", "train.save_steps=1")) == 0
    weights_file = run / "checkpoint-2" / "model" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"{weights_file}: unreadable safetensors file" in err
    assert f"the run keeps checkpoint-1: write that name into {run / 'latest'} to resume from it" in err


def test_cli_time_placeholder_gives_each_run_its_own_directory(tmp_path):
    args = ["train", *(a for o in [*SMALL, "train.max_steps=1", f"train.output_dir={tmp_path}/r-{{time}}"]
                       for a in ("--set", o))]
    assert main(args) == 0
    (run,) = tmp_path.iterdir()
    assert re.fullmatch(r"r-\d{8}-\d{6}", run.name) and (run / "latest").is_file()


def test_a_diverged_run_is_an_error_not_a_traceback(tmp_path, capsys):
    # AdamW moves every weight by about the learning rate: at 1e30 the next rollout's logits overflow
    assert main(cli_args(tmp_path / "run", "train.max_steps=2", "train.learning_rate=1e30",
                         "train.lr_scheduler_type=constant")) == 1
    assert "rlcore: error: the model's logits are not finite (NaN or inf) after the prompts" in capsys.readouterr().err


def test_an_error_rlcore_did_not_word_says_where_it_came_from_and_the_traceback_switch(tmp_path, capsys,
                                                                                       monkeypatch):
    """rlcore's own errors are one line; any other ValueError / TypeError / OSError (a bug, or a
    value no check caught) names no option, so the line says where it was raised."""
    import rlcore.run.setup
    from rlcore.cli import internal_origin
    from rlcore.config import load_config

    cfg = load_config(None, ["train.lr_scheduler_type=cosine", "train.max_steps=10"])
    cfg.train.lr_scheduler_kwargs = {"num_cycles": "x"}  # past the config check, as before it checked values
    with pytest.raises(TypeError) as e:
        rlcore.run.setup.lr_lambda(cfg, 10)(5)
    assert re.fullmatch(r"\nrlcore: \(raised at rlcore/run/setup\.py:\d+ in f; RLCORE_TRACEBACK=1 prints the traceback\)",
                        internal_origin(e.value))
    with pytest.raises(ValueError) as e:
        load_config(None, ["train.max_steps=0"])
    assert internal_origin(e.value) == ""  # a raise of rlcore's: its message says it all

    def broken(*args, **kwargs):
        return "x" * 0.5

    monkeypatch.setattr(rlcore.run.setup, "lr_lambda", broken)
    assert main(cli_args(tmp_path / "run", "train.max_steps=1")) == 1
    err = capsys.readouterr().err
    assert f"rlcore: error: can't multiply sequence by non-int of type 'float'\nrlcore: (raised at {__file__}:" in err
    assert "Traceback" not in err
    monkeypatch.setenv("RLCORE_TRACEBACK", "1")
    assert main(cli_args(tmp_path / "run2", "train.max_steps=1")) == 1
    err = capsys.readouterr().err
    assert err.index("Traceback (most recent call last)") < err.index('return "x" * 0.5') < err.index("rlcore: error:")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_dir_that_cannot_be_created_names_the_option(tmp_path, capsys):
    assert main(cli_args(Path("/proc/rlcore-no/run"), "train.max_steps=1")) == 1  # was '[Errno 2] ...' alone
    assert ("rlcore: error: train.output_dir = '/proc/rlcore-no/run' cannot be created (No such file or directory); "
            "give a directory you can write to") in capsys.readouterr().err


def test_a_run_that_failed_before_its_first_checkpoint_says_how_to_start_over(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1", "loss.reward_funcs=['test_train:explode']")) == 1
    assert ("rlcore: it failed before the run's first checkpoint (in the held-out evaluation before training, or in "
            "the first round), so there is none: a run started again starts over") in capsys.readouterr().err
    assert main(["train", "--resume", str(run)]) == 1
    assert (f"--resume {run}: no checkpoint there (no `latest` file); the run stopped before its first checkpoint "
            f"(one is written every train.save_steps steps and at the end), so it starts over: rlcore train "
            f"{run / 'config.toml'}") in capsys.readouterr().err
    assert main(["train", str(run / "config.toml"), "--set", "loss.reward_funcs=['test_train:first_digit']"]) == 0
    assert [r["step"] for r in rows(run)] == [1]
    (tmp_path / "other").mkdir()  # another tool's directory with a config.toml: no rlcore advice
    (tmp_path / "other" / "config.toml").write_text("[trainer]\nepochs = 3\n")
    assert main(["train", "--resume", str(tmp_path / "other")]) == 1
    assert capsys.readouterr().err.rstrip().endswith("no checkpoint there (no `latest` file)")


def fails_from_step_2(prompts, completions, trainer_state, **columns):
    if trainer_state.global_step >= 1:
        raise TimeoutError("the judge timed out")
    return [float(c[:1] == "1") for c in completions]


def test_a_reward_function_failing_after_a_checkpoint_says_how_to_continue(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=3", "train.save_steps=1",
                         f"loss.reward_funcs=['{__name__}:fails_from_step_2']")) == 1
    assert (f"rlcore: {run} keeps checkpoint-1, the run as it was when the function failed: once the function is "
            f"fixed, continue with rlcore train --resume {run}") in capsys.readouterr().err


def test_resume_of_a_trainer_output_directory_names_it_and_how_to_start_from_its_weights(tmp_path, capsys):
    for step in (50, 500, 100):  # TRL's GRPOTrainer output: checkpoint-<step>/ with trainer_state.json
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    for where, start in ((tmp_path / "out", tmp_path / "out" / "checkpoint-500"),
                        (tmp_path / "out" / "checkpoint-100", tmp_path / "out" / "checkpoint-100")):
        assert main(["train", "--resume", str(where)]) == 1
        assert (f"it is a transformers Trainer's (TRL's) output, and rlcore resumes only the runs it wrote: to start "
                f"a new run from its weights, --set model.path={start}") in capsys.readouterr().err


def test_resume_names_the_runs_config_when_it_is_wrong_and_survives_a_deleted_metrics_file(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1")) == 0
    good = (run / "config.toml").read_text()
    (run / "config.toml").write_text(good.replace("num_generations", "num_generation"))
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 2
    assert f"rlcore: config error in {run / 'config.toml'} (the run's configuration, or the --set values): " \
           f"unknown config key rollout.num_generation" in capsys.readouterr().err
    (run / "config.toml").write_text(good)
    (run / "metrics.jsonl").unlink()
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=2"]) == 0
    assert "metrics.jsonl is missing: its rows up to step 1 are lost" in capsys.readouterr().err
    assert [r["step"] for r in rows(run)] == [2]


def test_a_reward_function_that_raises_prints_its_message_and_its_own_frames_only(tmp_path, capsys):
    assert main(cli_args(tmp_path / "run", "train.max_steps=1", "loss.reward_funcs=['test_train:explode']")) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: reward function explode raised ValueError: this reward always fails on "
                          "sample 0"), err
    assert "Traceback of the reward function (most recent call last):" in err and "test_train.py" in err
    assert "rlcore/" not in err.replace("rlcore/tests", "")  # none of rlcore's frames
