"""Every script in bench/ runs, at a tiny size: its own command with flags that shrink the model and
the work (defaults: the benchmark's), both sides where it compares two, and its last line the ratio
it reports. A benchmark imports rlcore as a user's script does, so a name moved out from under one
(rlcore.train.reuse_freed_memory, once) fails here instead of in the next person's hands.

The CUDA-only ones, bench/logprobs_cuda.py and bench/gpu.sh, run on a GPU. On a CPU they are
compiled, every rlcore name they use is looked up, and gpu.sh runs against stubs of Python, nvcc
and nvidia-smi that record what it asks Python to run: its snippets' rlcore names, the test files
it names and the flags it gives each benchmark are checked there."""

import ast
import importlib
import json
import math
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_bench import bench_module

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvcc") is None,
                               reason="CUDA-only: needs a GPU, and nvcc to build rlcore's kernels")


def bench_env(**extra) -> dict:
    """The environment a benchmark runs in here: no hub, and this checkout's rlcore first."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=path, **extra)


def run_bench(script: str, *flags: str, timeout: int = 300) -> list[str]:
    """`python bench/<script> <flags>` from the checkout's root; its stdout lines, once it exits 0."""
    proc = subprocess.run([sys.executable, str(BENCH / script), *flags], cwd=ROOT, env=bench_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"bench/{script} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout.strip().splitlines()


def ratio(line: str, name: str) -> float:
    """The value of a `<name>=<number>` line, a finite positive number."""
    m = re.fullmatch(rf"{name}=(\d+\.\d+)", line.strip())
    assert m, f"expected {name}=<ratio>, got {line!r}"
    value = float(m[1])
    assert math.isfinite(value) and value > 0, line
    return value


def lines_starting(lines: list[str], prefix: str) -> list[str]:
    return [line for line in lines if line.lstrip().startswith(prefix)]


# ---------------------------------------------------------------- the CPU benchmarks, tiny

def test_rollout_bench_runs_rlcore_and_transformers_and_ends_with_the_speedup():
    lines = run_bench("rollout.py", "--shape", "tiny", "--prompts", "1", "--G", "2", "--prompt-len", "4",
                      "--new-tokens", "2", "--peak-n", "64", "--copy-gib", "0.001")
    assert len(lines_starting(lines, "rlcore: ")) == 1 and len(lines_starting(lines, "transformers: ")) == 1, lines
    ratio(lines[-1], "rollout_speedup_vs_hf")


def test_train_step_bench_runs_a_trl_and_an_rlcore_step_and_ends_with_the_speedup():
    # rlcore's first step includes loading the model: a second makes its time a step's, as TRL's is
    lines = run_bench("train_step.py", "--shape", "tiny", "--prompt-len", "4", "--G", "2", "--max-new", "2",
                      "--batch", "2", "--ga", "1", "--trl-steps", "1", "--rlcore-steps", "2", "--peak-n", "64")
    assert ratio(lines[-3], "trl_sec_per_step") and ratio(lines[-2], "rlcore_sec_per_step"), lines
    ratio(lines[-1], "train_step_speedup_vs_trl")


def test_rollout_bench_runs_on_a_checkpoint_dir_with_chat_prompts_ended_by_eos(qwen_dir):
    lines = run_bench("rollout.py", "--model", str(qwen_dir), "--prompts", "2", "--G", "2", "--new-tokens", "4",
                      "--peak-n", "64")
    for side in ("rlcore: ", "transformers: "):
        assert len([line for line in lines_starting(lines, side) if "of 4 at the 4-token limit" in line]) == 1, lines
    ratio(lines[-1], "rollout_speedup_vs_hf")


def test_train_step_bench_runs_on_a_checkpoint_dir_with_chat_prompts(qwen_dir):
    lines = run_bench("train_step.py", "--model", str(qwen_dir), "--G", "2", "--max-new", "2", "--batch", "2",
                      "--ga", "1", "--trl-steps", "1", "--rlcore-steps", "2", "--peak-n", "64")
    assert str(qwen_dir) in lines[0] and len(lines_starting(lines, "floor lengths: ")) == 1, lines
    assert ratio(lines[-3], "trl_sec_per_step") and ratio(lines[-2], "rlcore_sec_per_step"), lines
    ratio(lines[-1], "train_step_speedup_vs_trl")


def test_logprobs_bench_runs_naive_and_chunked_and_ends_with_their_ratios():
    lines = run_bench("logprobs.py", "--batch", "1", "--tokens", "64", "--hidden", "32", "--vocab", "8192",
                      "--chunk-size", "16", "--repeats", "1")
    assert len(lines_starting(lines, "naive ")) == 1 and len(lines_starting(lines, "chunked ")) == 1, lines
    ratio(lines[-2], "logprob_time_ratio")
    ratio(lines[-1], "logprob_peak_mem_ratio")


def test_memory_bench_runs_a_full_and_a_lora_step_and_ends_with_their_peak_ratio():
    lines = run_bench("memory.py", "--device", "cpu", "--shape", "tiny", "--prompts", "2", "--G", "2",
                      "--new-tokens", "2", "--rank", "2")
    assert len(lines_starting(lines, "full: peak ")) == 1 and len(lines_starting(lines, "lora: peak ")) == 1, lines
    ratio(lines[-1], "lora_peak_mem_ratio")


def test_fsdp_memory_bench_runs_both_modes_on_two_ranks_and_ends_with_their_ratio():
    lines = run_bench("fsdp_memory.py", "--device", "cpu", "--shape", "tiny", "--rows", "1", "--prompt", "4",
                      "--completion", "4")
    for mode in ("replicated", "fsdp"):
        ranks = [line.split()[1:3] for line in lines_starting(lines, mode + " ")]
        assert ranks == [["rank", "0:"], ["rank", "1:"]], lines
    ratio(lines[-1], "fsdp_rank_mem_ratio")


# ---------------------------------------------------------------- what can be checked without running

def rlcore_names(source: str) -> set[str]:
    """The dotted rlcore names `source` uses: what it imports from rlcore (at any depth, in any
    function), and attributes it reads or sets through a name bound to an rlcore module."""
    tree = ast.parse(source)
    names, bound = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rlcore":
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rlcore":
                    names.add(alias.name)  # `import rlcore.a.b` binds rlcore; `import rlcore.a.b as x`, x
                    bound[alias.asname or "rlcore"] = alias.name if alias.asname else "rlcore"
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):  # the whole attribute chains rooted at a bound name: a.b.c, not a.b
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, root = [], node
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                names.add(".".join([bound[root.id], *reversed(chain)]))
    return names


def missing(dotted: str) -> bool:
    """Whether `dotted` (package.module.attr...) names nothing: each part an attribute of the one
    before, or a submodule of it."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError as e:
                if e.name != ".".join(parts[:i]):
                    raise  # a module exists but cannot import one of its own dependencies
                return True
            if not hasattr(obj, part):
                return True
        obj = getattr(obj, part)
    return False


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_compiles(script, tmp_path):
    py_compile.compile(str(BENCH / script), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_rlcore_name_a_bench_script_uses_exists(script):
    names = rlcore_names((BENCH / script).read_text())
    assert names, f"bench/{script} uses no rlcore name: it benchmarks nothing of rlcore's"
    gone = [n for n in sorted(names) if missing(n)]
    assert not gone, f"bench/{script} uses rlcore names that no longer exist: {gone}"


def test_the_names_check_sees_imports_and_attributes_through_them():
    source = ("import rlcore.rollout.completions\nfrom rlcore import cuda\nfrom rlcore.x import y as z\n"
              "def f():\n    rlcore.rollout.completions.generate = 1\n    cuda.build('k')\n    z.w.v\n")
    assert rlcore_names(source) == {"rlcore.rollout.completions", "rlcore.rollout.completions.generate",
                                    "rlcore.cuda", "rlcore.cuda.build", "rlcore.x.y", "rlcore.x.y.w.v"}


def test_the_names_check_finds_a_moved_name_missing_where_it_was():
    assert missing("rlcore.train.reuse_freed_memory")  # what bench/train_step.py once imported
    assert not missing("rlcore.run.setup.reuse_freed_memory")
    assert not missing("rlcore.parallel.fsdp.shard")  # a submodule not imported yet, then its attribute


def test_gpu_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], check=True)


def gpu_sh_python_calls(tmp_path: Path, smoke: bool) -> list[list[str]]:
    """The argument lists bench/gpu.sh gives Python, in order, from a run in which Python, nvcc and
    nvidia-smi are stubs: Python's records its arguments and does nothing else."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool in ("nvcc", "nvidia-smi"):
        (stubs / tool).write_text("#!/bin/sh\necho stub\n")
        (stubs / tool).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    python = stubs / "python"
    python.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"with open({str(calls)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    python.chmod(0o755)
    env = bench_env(PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", PYTHON=str(python), OUT=str(tmp_path / "out"),
                    GPU_SH_SMOKE="1" if smoke else "0")
    # not its exit status: that is its last grep's, which finds nothing in a log the stub never wrote
    subprocess.run(["bash", str(BENCH / "gpu.sh")], cwd=ROOT, env=env, capture_output=True, timeout=120)
    calls = [json.loads(line) for line in calls.read_text().splitlines()]
    assert "tests/test_gpu.py" in calls[-1], f"bench/gpu.sh stopped before its last step: {calls}"
    return calls


def test_gpu_sh_python_snippets_use_only_rlcore_names_that_exist(tmp_path):
    snippets = [call[1] for call in gpu_sh_python_calls(tmp_path, smoke=False) if call[0] == "-c"]
    names = set().union(*map(rlcore_names, snippets))
    assert "rlcore.cuda.build" in names
    gone = [n for n in sorted(names) if missing(n)]
    assert not gone, f"bench/gpu.sh uses rlcore names that no longer exist: {gone}"


@pytest.mark.parametrize("smoke", [False, True], ids=["benchmark", "smoke"])
def test_gpu_sh_runs_test_files_that_exist(tmp_path, smoke):
    tests = [arg for call in gpu_sh_python_calls(tmp_path, smoke) if call[:2] == ["-m", "pytest"]
             for arg in call if arg.startswith("tests/")]
    assert tests and all((ROOT / t).is_file() for t in tests), tests


@pytest.mark.parametrize("smoke", [False, True], ids=["benchmark", "smoke"])
def test_gpu_sh_gives_each_benchmark_flags_it_takes(tmp_path, smoke):
    runs = [call for call in gpu_sh_python_calls(tmp_path, smoke) if call[0].startswith("bench/")]
    assert sorted({call[0] for call in runs}) == ["bench/logprobs_cuda.py", "bench/rollout.py"], runs
    for script, *flags in runs:
        args = bench_module(Path(script).stem).parse_args(flags)  # argparse exits (SystemExit) on a flag it lacks
        if smoke and script == "bench/rollout.py":
            assert args.shape == "tiny"


# ---------------------------------------------------------------- on a GPU

@needs_gpu
def test_logprobs_cuda_bench_runs_kernels_twins_and_naive_and_ends_with_the_speedup():
    lines = run_bench("logprobs_cuda.py", "--batch", "1", "--tokens", "32", "--hidden", "32", "--vocab", "1024",
                      "--chunk-size", "16", "--repeats", "1", "--warmup", "1", timeout=600)
    for name in ("kernels", "twin", "naive"):
        assert len([line for line in lines if f" fp32: {name}: " in line]) == 1, lines
    ratio(lines[-1], "logprob_kernel_speedup_vs_twin")


@needs_gpu
def test_gpu_sh_smoke_run_builds_runs_each_benchmark_and_collects_the_gpu_tests(tmp_path):
    out = tmp_path / "out"
    subprocess.run(["bash", str(BENCH / "gpu.sh")], cwd=ROOT, capture_output=True, timeout=1200,
                   env=bench_env(OUT=str(out), PYTHON=sys.executable, GPU_SH_SMOKE="1"))  # its logs say how it went

    def log(name: str) -> str:
        return (out / name).read_text()

    assert log("build.log").count("build exit status 0") == 2, log("build.log")[-3000:]
    for tests in ("test_cuda_kernels", "test_gpu"):
        assert f"tests/{tests}.py exit status 0" in log(f"{tests}.log"), log(f"{tests}.log")[-3000:]
    ratio(log("logprobs_cuda.log").strip().splitlines()[-1], "logprob_kernel_speedup_vs_twin")
    speedups = [line for line in log("rollout.log").splitlines() if line.startswith("rollout_speedup_vs_hf=")]
    assert len(speedups) == 5, log("rollout.log")[-3000:]
    for line in speedups:
        ratio(line, "rollout_speedup_vs_hf")
