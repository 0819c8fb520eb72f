"""Optimizer steps per second with asynchronous rollouts, and the accuracy one round of staleness costs.

    flock /tmp/rlcore-bench.lock python bench/async.py [--steps-default 100] [--steps-calculator 30]
                                                       [--accuracy-steps 40] [--accuracy-seeds 3]
                                                       [--tasks default,calculator] [--modes sync,thread,ranks]
                                                       [--threads 0] [--set SECTION.KEY=VALUE ...]

Two tasks, each as its own config runs it: `default` (plain `rlcore train`, the embedded default:
two-digit addition, 4-token completions, 128 per round) and `calculator` (configs/calculator.toml:
up to 96 tokens and one tool call per completion, 64 per round). Each trains for a fixed number of
optimizer steps in three modes, each `rlcore train` in a subprocess of its own, one after the other:

  sync    one process: sample a round, then train on it (rollout.max_staleness = 0, the default)
  thread  one process, a sampler thread with its own copy of the weights sampling the next round
          while the trainer trains on this one: --set rollout.max_staleness=1
  ranks   torchrun --nproc_per_node=2, rank 1 only samples and rank 0 only trains:
          --set rollout.rollout_ranks=1 --set rollout.max_staleness=1

What is timed: the wall clock between the moments the run's first and last metrics.jsonl rows land
(one row per optimizer step, written as the step ends; this script polls the file), so a mode's
steps/s is (steps - 1) / that time. It leaves out the process start, model loading (and the
embedded model's SFT on a first run), the held-out evaluation before training, the first step
(it includes the first round's sampling, which no mode can overlap) and the evaluation and
checkpoint after the last step. Every run sets train.eval_steps = 0 and train.save_steps = 0, so
nothing but steps happens in between. Every round is the same size in every mode (rollout ranks
do not count in the round's b*S*P), so steps/s compare like with like.

From the sync run's rows: the mean rollout time R and the rest of a step T (scoring, old log-probs,
update) after the first step; from the thread run's, the old log-prob pass O that a stale round
needs and an on-policy one skips; and (R + T) / max(R, T + O), the speedup one step of overlap
gives where the sampler and the trainer do not compete (docs/async.md). On 2 CPU cores they
share the cores, so the measured speedup stays below it.

Accuracy: --accuracy-seeds pairs of default-task runs of --accuracy-steps steps (train.seed 42,
43, ...; the config's schedule over those steps), sync against thread (max_staleness 0 against
1), each ending with its held-out greedy accuracy on the 200 held-out prompts (eval.jsonl's last
row, the run's `held-out accuracy: before=X after=Y`). The difference of the means is one run's
noise unless it is larger than the spread over seeds, which is printed.

The last lines: `staleness1_minus_0_accuracy=<difference of means>` and then, per task,
`async_thread_speedup_<task>=` and `async_ranks_speedup_<task>=` (the mode's steps/s over sync's);
the last line is a speedup. Load averages are printed around each run: other work on the two
cores slows every mode, the ones with two busy threads or processes most.

--quick is a smoke run in well under a minute per run (with the embedded models cached: the
calculator's SFT takes about 3 minutes the first time): 4 and 3 steps, one accuracy pair of 3
steps. --set adds an option to every run (e.g. data.num_eval=16 with a cache built for it, as the
tests do); --tasks and --modes run a subset.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, no install
from rlcore import EMBEDDED_DEFAULT, ConfigError
from rlcore.config.load import load_config

TASKS = {"default": None, "calculator": ROOT / "configs" / "calculator.toml"}  # None: plain `rlcore train`
MODES = {  # name: (torchrun ranks, the mode's own --set values)
    "sync": (1, []),
    "thread": (1, ["rollout.max_staleness=1"]),
    "ranks": (2, ["rollout.rollout_ranks=1", "rollout.max_staleness=1"]),
}
MODE_TEXT = {"sync": "1 process, sample then train", "thread": "1 process + sampler thread",
             "ranks": "torchrun 2: 1 sampler rank, 1 trainer"}
SEED = 42  # the configs' train.seed; the accuracy pairs use SEED, SEED + 1, ...
SIZES = {"steps_default": 100, "steps_calculator": 30, "accuracy_steps": 40, "accuracy_seeds": 3}
QUICK = {"steps_default": 4, "steps_calculator": 3, "accuracy_steps": 3, "accuracy_seeds": 1}


@dataclass
class Result:
    """One `rlcore train` run: when each metrics row landed, the rows, and its held-out accuracies."""
    name: str
    marks: list[float]  # time.perf_counter() when each metrics.jsonl row appeared
    rows: list[dict]
    before: float | None
    after: float | None
    load: tuple[float, float]  # load average before and after
    wall: float  # the whole process, setup and evaluations included
    geometry: str = ""  # the run's first line: ranks, completions and prompts per round

    @property
    def steps_per_s(self) -> float:
        """Optimizer steps per second between the first and the last row (the first step is warm-up)."""
        return (len(self.marks) - 1) / (self.marks[-1] - self.marks[0])

    @property
    def window(self) -> float:
        return self.marks[-1] - self.marks[0]

    def staleness(self) -> str:
        """The mean of the rows' async/staleness after the first step, '-' when the rows lack it."""
        values = [row["async/staleness"] for row in self.rows[1:] if row.get("async/staleness") is not None]
        return f"{sum(values) / len(values):.2f}" if values else "-"

    def mean_time(self, *keys: str) -> float:
        """The mean over steps (the first left out) of the rows' time/<key> summed over `keys`."""
        rows = self.rows[1:] or self.rows
        return sum(row[f"time/{key}"] for row in rows for key in keys) / len(rows)


def command(task: str, mode: str, steps: int, out: Path, seed: int, extra: list[str]) -> list[str]:
    """The `rlcore train` command line of one run: the task's config, the mode's launcher and --set values."""
    ranks, mode_sets = MODES[mode]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
              if ranks > 1 else [sys.executable])
    config = [str(TASKS[task])] if TASKS[task] else []
    sets = [f"train.max_steps={steps}", "train.eval_steps=0", "train.save_steps=0", f"train.output_dir={out}",
            f"train.seed={seed}", *mode_sets, *extra]
    return [*launch, "-m", "rlcore.cli", "train", *config, *[arg for s in sets for arg in ("--set", s)]]


def config_problem(task: str, mode: str, extra: list[str]) -> str | None:
    """None when rlcore's config takes the mode's options for the task; else its config error
    (an option this checkout does not have yet, or one the mode's rank count rules out)."""
    ranks, mode_sets = MODES[mode]
    try:
        load_config(str(TASKS[task] or EMBEDDED_DEFAULT), [*mode_sets, *extra], world_size=ranks)
    except ConfigError as e:
        return str(e)
    return None


class RowWatch:
    """The wall clock at which each line of a growing metrics.jsonl appears: reads only what was
    appended since the last look, and only when the file's size changed."""

    def __init__(self, path: Path):
        self.path, self.offset, self.marks = path, 0, []

    def look(self) -> None:
        now = time.perf_counter()
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size > self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read(size - self.offset)
            complete = new.rfind(b"\n") + 1  # a row is whole once its newline is written
            self.marks += [now] * new[:complete].count(b"\n")
            self.offset += complete


def run(purpose: str, task: str, mode: str, steps: int, work: Path, seed: int, extra: list[str], threads: int,
        poll_s: float = 0.01) -> Result:
    """Run one `rlcore train` to the end, watching its metrics rows land; its Result."""
    name = f"{purpose}-{task}-{mode}-seed{seed}"
    out = work / name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torchrun's ranks get 1 each when it is unset
    cmd = command(task, mode, steps, out, seed, extra)
    load = os.getloadavg()[0]
    watch = RowWatch(out / "metrics.jsonl")
    with open(work / f"{name}.out", "w+") as log, open(work / f"{name}.err", "w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=err)
        try:
            while proc.poll() is None:  # a step of the default task takes about 0.1 s
                watch.look()
                time.sleep(poll_s)
        except BaseException:  # Ctrl-C: the run stops too (torchrun passes it on to its ranks)
            proc.terminate()
            proc.wait()
            raise
        watch.look()  # the last rows, written before the process ended
        wall = time.perf_counter() - t0
        log.seek(0), err.seek(0)
        stdout, stderr = log.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {' '.join(cmd)}\n{stdout[-2000:]}\n{stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if not len(watch.marks) == len(rows) == steps:
        raise SystemExit(f"{name}: {len(rows)} metrics rows ({len(watch.marks)} seen landing) for {steps} steps")
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    before = next((e["eval/accuracy"] for e in evals if e["step"] == 0), None)
    after = next((e["eval/accuracy"] for e in evals if e["step"] == steps), None)
    geometry = next((line for line in stdout.splitlines() if " per round" in line), "")
    return Result(name, watch.marks, rows, before, after, (load, os.getloadavg()[0]), wall, geometry)


def speedup_lines(speeds: dict[tuple[str, str], float]) -> list[str]:
    """`async_<mode>_speedup_<task>=<mode's steps/s over sync's>` for every task and async mode measured."""
    lines = []
    for task in TASKS:
        for mode in ("thread", "ranks"):
            if (task, "sync") in speeds and (task, mode) in speeds:
                lines.append(f"async_{mode}_speedup_{task}={speeds[task, mode] / speeds[task, 'sync']:.3f}")
    return lines


def accuracy_line(sync: list[float], stale: list[float]) -> str:
    """`staleness1_minus_0_accuracy=<mean held-out accuracy at max_staleness 1 minus at 0>`, signed."""
    return f"staleness1_minus_0_accuracy={sum(stale) / len(stale) - sum(sync) / len(sync):+.3f}"


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-default", type=int,
                    help=f"optimizer steps of each default-task run ({SIZES['steps_default']})")
    ap.add_argument("--steps-calculator", type=int,
                    help=f"optimizer steps of each calculator run ({SIZES['steps_calculator']})")
    ap.add_argument("--accuracy-steps", type=int,
                    help=f"optimizer steps of each accuracy run ({SIZES['accuracy_steps']})")
    ap.add_argument("--accuracy-seeds", type=int,
                    help=f"accuracy pairs, train.seed 42, 43, ... ({SIZES['accuracy_seeds']}; 0 = none)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS of every process (0 = unset: torch's default in one process, 1 per "
                         "torchrun rank)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an rlcore option for every run (repeatable)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else SIZES).items():  # a flag given wins over both
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tasks, args.modes = args.tasks.split(","), args.modes.split(",")
    for given, known, flag in ((args.tasks, TASKS, "--tasks"), (args.modes, MODES, "--modes")):
        if unknown := [x for x in given if x not in known]:
            ap.error(f"{flag}: {unknown[0]!r} is not one of {', '.join(known)}")
    if min(args.steps_default, args.steps_calculator) < 2 or (args.accuracy_seeds and args.accuracy_steps < 1):
        ap.error("--steps-default and --steps-calculator must be >= 2 (the first step is not timed), "
                 "--accuracy-steps >= 1")
    return args


def main() -> None:
    args = parse_args()
    import torch

    accuracy_modes = ("sync", "thread") if args.accuracy_seeds else ()
    problems = {(task, mode): problem for task in {*args.tasks, *(["default"] if accuracy_modes else [])}
                for mode in {*args.modes, *accuracy_modes} if (problem := config_problem(task, mode, args.extra))}
    if problems:
        (task, mode), problem = next(iter(problems.items()))
        raise SystemExit(f"rlcore's config does not take the {mode} mode's options for the {task} task "
                         f"({' '.join(MODES[mode][1]) or 'none'}):\n{problem}\n(--modes and --accuracy-seeds 0 "
                         f"leave modes out)")
    start_load = os.getloadavg()[0]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{'OMP_NUM_THREADS=' + str(args.threads) if args.threads else f'{torch.get_num_threads()} threads'} per "
          f"process ({'the same' if args.threads else '1'} per torchrun rank), "
          f"load average {start_load:.1f}", flush=True)
    steps = {"default": args.steps_default, "calculator": args.steps_calculator}
    print("timed: the wall clock from the first to the last metrics row (steps 2..N) of each run; "
          "train.eval_steps=0, save_steps=0; setup, evaluations and the first step are outside it", flush=True)

    results, speeds = [], {}
    with tempfile.TemporaryDirectory(prefix="rlcore-bench-async-") as tmp:
        work = Path(tmp)
        for task in args.tasks:
            for mode in args.modes:
                r = run("speed", task, mode, steps[task], work, SEED, args.extra, args.threads)
                results.append((task, mode, r))
                speeds[task, mode] = r.steps_per_s
                print(f"{task} {mode}: {r.steps_per_s:.2f} steps/s ({len(r.marks) - 1} steps in {r.window:.1f} s; "
                      f"{r.wall:.0f} s in all), held-out {fmt(r.before)} -> {fmt(r.after)}, load average "
                      f"{r.load[0]:.1f} -> {r.load[1]:.1f}; {r.geometry}", flush=True)
        accuracy = {"sync": [], "thread": []}
        for i in range(args.accuracy_seeds):
            for mode in accuracy_modes:
                r = run("accuracy", "default", mode, args.accuracy_steps, work, SEED + i, args.extra, args.threads)
                if r.after is None:
                    raise SystemExit(f"{r.name}: no held-out accuracy after training (eval.jsonl)")
                accuracy[mode].append(r.after)
                print(f"accuracy default {mode} seed {SEED + i}: held-out {fmt(r.before)} -> {fmt(r.after)} "
                      f"after {args.accuracy_steps} steps ({r.wall:.0f} s)", flush=True)

    print()
    print(f"{'task':<11} {'mode':<7} {'launch':<38} {'steps':>5} {'timed s':>8} {'steps/s':>8} {'staleness':>9} "
          f"{'held-out before -> after':>25}")
    for task, mode, r in results:
        print(f"{task:<11} {mode:<7} {MODE_TEXT[mode]:<38} {len(r.rows):>5} {r.window:>8.2f} {r.steps_per_s:>8.2f} "
              f"{r.staleness():>9} {fmt(r.before):>16} -> {fmt(r.after)}")
    if start_load > 1.0:  # before any run of this script's: other work
        print(f"note: the load average was {start_load:.1f} on {os.cpu_count()} cores before the first run: other "
              f"work slows these runs, a process with more threads than its share of the cores most (its OpenMP "
              f"threads wait for descheduled ones); time on a quiet machine"
              f"{'' if args.threads else ', or compare with --threads 1'}")
    runs = {(task, mode): r for task, mode, r in results}
    for task in args.tasks:
        if (task, "sync") not in runs:
            continue
        sync = runs[task, "sync"]
        rollout, rest = sync.mean_time("rollout"), sync.mean_time("scoring", "old_logp", "update")
        # an asynchronous round is off-policy: it adds the old log-prob pass that an on-policy round skips
        old = runs[task, "thread"].mean_time("old_logp") if (task, "thread") in runs else 0.0
        bound = (rollout + rest) / max(rollout, rest + old, 1e-9)
        print(f"{task}, from the sync rows: rollout R = {rollout:.3f} s, scoring + old log-probs + update "
              f"T = {rest:.3f} s per step; with the thread run's old log-prob pass O = {old:.3f} s, one step of "
              f"overlap gives at most (R + T) / max(R, T + O) = {bound:.2f}")
    lines = speedup_lines(speeds)
    if accuracy["sync"]:
        spread = {mode: f"{min(a):.3f}-{max(a):.3f}" for mode, a in accuracy.items()}
        print(f"held-out accuracy after {args.accuracy_steps} steps, default task, {args.accuracy_seeds} seed(s): "
              f"max_staleness 0 mean {sum(accuracy['sync']) / len(accuracy['sync']):.3f} ({spread['sync']}), "
              f"max_staleness 1 mean {sum(accuracy['thread']) / len(accuracy['thread']):.3f} ({spread['thread']})")
        lines.insert(0, accuracy_line(accuracy["sync"], accuracy["thread"]))
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
