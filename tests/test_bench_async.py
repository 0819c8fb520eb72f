"""bench/async.py without its runs: the command lines it gives each mode (the --set flags that
turn asynchronous rollouts on, and nothing else), that rlcore's config takes them, how it times
rows landing in metrics.jsonl, and the ratio lines it ends with; then its quick run on the default
task."""

import pytest
from test_bench import bench_module
from test_bench_smoke import lines_starting, ratio, run_bench

bench = bench_module("async")


def sets(cmd: list[str]) -> list[str]:
    """The values of a command line's --set flags, in order."""
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]


def test_each_mode_adds_only_its_own_async_options_to_the_same_run(tmp_path):
    common = ["train.max_steps=5", "train.eval_steps=0", "train.save_steps=0", f"train.output_dir={tmp_path}",
              "train.seed=42"]
    cmds = {mode: bench.command("default", mode, 5, tmp_path, 42, ["data.num_eval=16"]) for mode in bench.MODES}
    assert sets(cmds["sync"]) == [*common, "data.num_eval=16"]
    assert sets(cmds["thread"]) == [*common, "rollout.max_staleness=1", "data.num_eval=16"]
    assert sets(cmds["ranks"]) == [*common, "rollout.rollout_ranks=1", "rollout.max_staleness=1", "data.num_eval=16"]
    for mode in ("sync", "thread"):
        assert cmds[mode][1:5] == ["-m", "rlcore.cli", "train", "--set"]  # plain `rlcore train`: the embedded default
    assert cmds["ranks"][1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                  "-m", "rlcore.cli", "train"]


def test_the_calculator_task_runs_its_config():
    cmd = bench.command("calculator", "sync", 3, "out", 42, [])
    assert cmd[4] == str(bench.ROOT / "configs" / "calculator.toml")


@pytest.mark.parametrize("task", list(bench.TASKS))
@pytest.mark.parametrize("mode", list(bench.MODES))
def test_rlcore_config_takes_every_mode_of_every_task(task, mode):
    assert bench.config_problem(task, mode, []) is None


def test_a_misspelt_option_is_a_config_problem_before_any_run():
    assert "rollout.max_stalenes" in bench.config_problem("default", "sync", ["rollout.max_stalenes=1"])


def test_quick_shrinks_every_size_and_subsets_are_checked():
    args = bench.parse_args(["--quick", "--tasks", "default", "--modes", "sync,thread"])
    assert (args.steps_default, args.steps_calculator, args.accuracy_steps, args.accuracy_seeds) == (4, 3, 3, 1)
    assert args.tasks == ["default"] and args.modes == ["sync", "thread"]
    assert bench.parse_args(["--quick", "--accuracy-seeds", "0"]).accuracy_seeds == 0  # a flag given wins
    assert bench.parse_args([]).steps_default == bench.SIZES["steps_default"]
    for bad in (["--tasks", "gsm8k"], ["--modes", "async"], ["--steps-default", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_row_watch_counts_only_whole_lines_as_they_land(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watch = bench.RowWatch(path)
    watch.look()  # no file yet
    path.write_text('{"step": 1}\n{"step": 2')  # the second row half written
    watch.look()
    assert len(watch.marks) == 1
    with open(path, "a") as f:
        f.write('}\n{"step": 3}\n')
    watch.look()
    watch.look()  # nothing new
    assert len(watch.marks) == 3 and watch.marks[1] == watch.marks[2] >= watch.marks[0]


def test_steps_per_second_leave_out_the_first_step():
    result = bench.Result("r", marks=[10.0, 10.5, 11.0, 12.0], rows=[{}] * 4, before=None, after=None,
                          load=(0.0, 0.0), wall=20.0)
    assert result.steps_per_s == 3 / 2.0  # steps 2..4 in the 2 s after the first row


def test_the_ratio_lines_end_with_a_speedup_and_the_accuracy_difference_is_signed():
    speeds = {("default", "sync"): 2.0, ("default", "thread"): 2.5, ("default", "ranks"): 1.0,
              ("calculator", "sync"): 1.0, ("calculator", "thread"): 1.5}
    assert bench.speedup_lines(speeds) == ["async_thread_speedup_default=1.250", "async_ranks_speedup_default=0.500",
                                           "async_thread_speedup_calculator=1.500"]
    assert bench.accuracy_line([0.8, 0.9], [0.8, 0.8]) == "staleness1_minus_0_accuracy=-0.050"
    assert bench.accuracy_line([0.8], [0.85]) == "staleness1_minus_0_accuracy=+0.050"


def test_the_quick_run_times_every_mode_of_the_default_task_and_ends_with_a_speedup(embedded_dir):
    # the tests' embedded model (data.num_eval=16); the calculator's would need an SFT of its own
    lines = run_bench("async.py", "--quick", "--tasks", "default", "--set", "data.num_eval=16", timeout=600)
    assert [line.split()[:2] for line in lines_starting(lines, "default ")][:3] == [
        ["default", "sync:"], ["default", "thread:"], ["default", "ranks:"]], lines
    assert lines[-3].startswith("staleness1_minus_0_accuracy="), lines
    ratio(lines[-2], "async_thread_speedup_default")
    ratio(lines[-1], "async_ranks_speedup_default")
