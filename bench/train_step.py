"""Seconds per GRPO optimizer step, rlcore vs TRL's GRPOTrainer, on the same CPU and checkpoint.

    flock /tmp/rlcore-bench.lock python bench/train_step.py [--trl-steps 2] [--rlcore-steps 3]
                                                            [--side both|trl|rlcore] [--grad-ckpt]
                                                            [--trl-glibc-malloc] [--bf16]

Setup (same model shape as bench/rollout.py), written into a temp dir by this script:
  model       random Qwen2ForCausalLM, hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 1408,
              vocab 32000, tied embeddings, fp32, saved with transformers' save_pretrained
  tokenizer   `tokenizers` WordLevel over <pad> <eos> <unk> + "w0".."w31996" (32000 ids), whitespace
              pre-tokenizer, no chat template, no BOS: a prompt of 64 words is exactly 64 tokens
  data        64 prompts of 64 random words (prompts.jsonl, a "prompt" column for both sides)
  one step    8 prompts x G=8 = 64 completions of up to 128 tokens, per_device_train_batch_size 16,
              gradient_accumulation_steps 4 (= steps_per_generation, so one rollout per optimizer step
              on both sides, on-policy, no old log-prob pass), beta 0, temperature 1.0, lr 1e-6,
              dropout off
  reward      a deterministic pseudo-random score of the completion text (nonzero advantages)

A random model samples EOS with probability ~1/32000 per token, so nearly every completion runs to
128 tokens on both sides; the mean completion length of each side is printed to show it.

Each side runs in its own subprocess (same threads and allocator setting, nothing shared but the
checkpoint dir). The
first optimizer step of each side is warm-up and is dropped; the reported time is the mean wall
clock of the remaining steps. TRL: between consecutive `on_step_end` callbacks, split into
generation / scoring (TRL's `_generate_single_turn` and `_generate_and_score_completions`, timed
by wrapping them) and update (the rest). rlcore: between the moments consecutive lines land in
metrics.jsonl (written at the end of each step), split by the step's own time/rollout,
time/scoring, time/old_logp and time/update. TRL steps take minutes on 2 cores, hence 2 TRL steps
(one timed) by default.

TRL runs with GRPOConfig defaults except as set in `run_trl`, and three deliberate changes, each
to compare like with like:
- bf16=False (GRPOConfig defaults it to True; the model is fp32 and rlcore computes in fp32, so
  both sides run fp32);
- gradient_checkpointing=False (GRPOConfig defaults it to True, which recomputes every layer's
  forward in backward; rlcore's train.gradient_checkpointing defaults to False). --grad-ckpt
  turns it on for both sides;
- the TRL worker makes the allocator setting rlcore's train() makes for its own process
  (`rlcore.run.setup.reuse_freed_memory`: glibc keeps freed memory instead of unmapping it, so
  large tensors do not come back as fresh zero-filled pages). It speeds TRL's update more than
  rlcore's (docs/benchmarks.md). --trl-glibc-malloc runs TRL as it runs out of the box instead.
--bf16 runs both sides in mixed precision instead: TRL with bf16=True (its default: bf16
autocast over the fp32 model) and rlcore with train.bf16=true (bf16 autocast for the training
forwards, log-probs still from fp32 hidden states and weights, and a bf16 rollout). That pays
only on a CPU with bf16 matrix units (AMX), where a bf16 matmul runs several times faster than
an fp32 one.

The load average before and after each side is printed. Other work on the machine slows both
sides, decoding most (many small multi-threaded ops, each waiting at an OpenMP barrier for a
descheduled thread): under a load above the core count, step times can more than double. Time on
a quiet machine, or pass --threads 1, which is slower but steady under load.
Before the last lines, the step's FLOP floor: the model FLOPs of the least work a step needs (one
forward to sample, one forward and backward to train, each prompt once; 4 x bench/rollout.py's
count), the seconds they take at this machine's matmul peak (measured here before and after the
sides), each side's share of that peak, and the share 3x TRL's speed would need. It shows whether
3x TRL is within this machine's reach, whatever either side does.
The last line is `train_step_speedup_vs_trl=<TRL seconds per step / rlcore seconds per step>`.

`--model DIR` runs the same comparison on a real checkpoint directory with a chat template
(SmolLM2-135M-Instruct from `rlcore fetch-smollm2`) instead of the random model: both sides load
DIR in fp32; the prompts are bench/rollout.py's CHAT_PROMPTS (cycled to 64), one user message each
in the checkpoint's chat template (TRL's conversational prompts, rlcore's data.use_chat_template);
completions end at EOS, so each side's step does the work of its own sampled lengths (printed),
and the FLOP floor is taken at the chat prompts' mean length and the sides' mean completion length:

    flock /tmp/rlcore-bench.lock python bench/train_step.py --model ~/.cache/rlcore/SmolLM2-135M-Instruct

The workload's sizes are flags, their defaults the setup above: --shape (bench/rollout.py's shapes),
--prompt-len, --G, --max-new, --batch, --ga, and --peak-n for the matmul peak's size. The smoke run
tests/test_bench_smoke.py makes, both sides at a tiny size, every line and no figure:

    python bench/train_step.py --shape tiny --prompt-len 4 --G 2 --max-new 2 --batch 2 --ga 1 \
                               --trl-steps 1 --rlcore-steps 2 --peak-n 64
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 64
SPECIALS = ["<pad>", "<eos>", "<unk>"]


@dataclass(frozen=True)
class Workload:
    """The model and the sizes of one step (the defaults: the benchmark's). The driver writes it
    into the work dir (workload.json), where each side's worker reads it."""
    shape: str = "bench"  # bench/rollout.py's SHAPES
    model: str = ""  # a checkpoint dir with a chat template (--model); "" = a random model of `shape`
    prompt_len: int = 64
    G: int = 8
    max_new: int = 128
    batch: int = 16  # per_device_train_batch_size
    ga: int = 4  # gradient_accumulation_steps

    def model_dir(self, d: Path) -> Path:
        """The checkpoint directory both sides load: --model's, or the random one built in work dir `d`."""
        return Path(self.model) if self.model else d

    @property
    def prompts_per_step(self) -> int:
        return self.batch * self.ga // self.G  # one round, one optimizer step (the benchmark: 8 prompts)

    def save(self, d: Path) -> None:
        (d / "workload.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, d: Path) -> "Workload":
        return cls(**json.loads((d / "workload.json").read_text()))


# ----------------------------------------------------------------------------- setup

def build_checkpoint(d: Path, w: Workload = Workload()) -> None:
    """Random Qwen2 checkpoint + WordLevel tokenizer in d, prompts in d/prompts.jsonl, the workload
    in d/workload.json."""
    import torch
    from rollout import SHAPES  # bench/rollout.py, beside this script
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[w.shape], max_position_embeddings=1024)
    words_n = shape["vocab_size"] - len(SPECIALS)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(words_n)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(d)
    pad, eos = tok.pad_token_id, tok.eos_token_id

    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(d)

    rnd = random.Random(0)
    with open(d / "prompts.jsonl", "w") as f:
        for _ in range(PROMPTS):
            words = " ".join(f"w{rnd.randrange(words_n)}" for _ in range(w.prompt_len))
            f.write(json.dumps({"prompt": words}) + "\n")
    ids = load_tokenizer(d)(words)["input_ids"]
    assert len(ids) == w.prompt_len, f"a {w.prompt_len}-word prompt encoded to {len(ids)} tokens"
    w.save(d)


def write_chat_prompts(d: Path, w: Workload) -> None:
    """--model's work dir: PROMPTS prompts of one user message each (bench/rollout.py's CHAT_PROMPTS,
    cycled) in d/prompts.jsonl, which both sides render with the checkpoint's chat template, and the
    workload in d/workload.json."""
    from rollout import CHAT_PROMPTS  # bench/rollout.py, beside this script

    with open(d / "prompts.jsonl", "w") as f:
        for i in range(PROMPTS):
            f.write(json.dumps({"prompt": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]}) + "\n")
    w.save(d)


def load_tokenizer(d: Path):
    """The WordLevel tokenizer as transformers sees it. Not AutoTokenizer: with config.json saying
    qwen2 it builds a Qwen2Tokenizer (BPE) from the vocab and every prompt encodes to zero tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(d)


def bench_reward(prompts, completions, **kwargs):
    """Deterministic pseudo-random score in [0, 1) of each completion's text (TRL and rlcore); a
    chat prompt's completion comes as a list of messages, the reply the last one's content."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [(sum(map(ord, t)) * 2654435761 % 1000) / 1000.0 for t in texts]


def read_prompts(d: Path) -> list:
    with open(d / "prompts.jsonl") as f:
        return [json.loads(line)["prompt"] for line in f]


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux reports KiB). Both sides keep freed memory
    (the allocator setting), so the peak is the largest the process needed at once."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def after_warmup(times: list[float]) -> float:
    """Mean of the per-step times with the first (warm-up) step dropped."""
    rest = times[1:] or times
    return sum(rest) / len(rest)


# ----------------------------------------------------------------------------- TRL

def run_trl(d: Path, steps: int, grad_ckpt: bool, bf16: bool, glibc_malloc: bool = False) -> dict:
    import torch

    if not glibc_malloc:  # the allocator setting rlcore's train() makes, so both sides get it
        sys.path.insert(0, str(ROOT))
        from rlcore.run.setup import reuse_freed_memory

        reuse_freed_memory()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.logs = [], []

        def on_train_begin(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    out, w = d / "trl_out", Workload.load(d)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=w.batch, gradient_accumulation_steps=w.ga,
                      num_generations=w.G, max_completion_length=w.max_new, beta=0.0, use_cpu=True, bf16=bf16,
                      report_to="none", logging_steps=1, max_steps=steps, save_strategy="no", use_vllm=False,
                      temperature=1.0, disable_dropout=True, learning_rate=1e-6, seed=0,
                      gradient_checkpointing=grad_ckpt, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(w.model_dir(d), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(w.model) if w.model else load_tokenizer(d)
    data = Dataset.from_dict({"prompt": read_prompts(d)})
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=bench_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    # Phase split: generation, and generation + rewards + advantages (TRL's round), timed by wrapping
    # the trainer's own methods; the rest of each step is the update.
    spent = {"generate": [], "generate_and_score": []}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            r = fn(*a, **kw)
            spent[key].append(time.perf_counter() - t)
            return r
        return wrapper

    trainer._generate_single_turn = timed(trainer._generate_single_turn, "generate")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "generate_and_score")
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0
    per_step = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    lens = [lg["completions/mean_length"] for lg in clock.logs if "completions/mean_length" in lg]
    gen, round_ = spent["generate"], spent["generate_and_score"]
    assert len(gen) == len(round_) == steps, f"expected one generation per optimizer step, got {len(gen)}"
    phases = {"generate": after_warmup(gen), "scoring": after_warmup([r - g for r, g in zip(round_, gen)]),
              "update": after_warmup([s - r for s, r in zip(per_step, round_)])}
    return {"per_step": per_step, "sec_per_step": after_warmup(per_step), "wall": wall, "phases": phases,
            "train_runtime": result.metrics.get("train_runtime"), "completion_len_mean": sum(lens) / max(len(lens), 1),
            "gradient_checkpointing": grad_ckpt, "threads": torch.get_num_threads(), "peak_rss_gb": peak_rss_gb()}


# ----------------------------------------------------------------------------- rlcore

def run_rlcore(d: Path, steps: int, grad_ckpt: bool, bf16: bool) -> dict:
    import torch
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))  # so the reward resolves as train_step:bench_reward
    from rlcore.config import load_config
    from rlcore.train import train

    out, w = d / "rlcore_out", Workload.load(d)
    cfg = load_config(None, [
        f"model.path={w.model_dir(d)}", "model.dtype=float32", "data.task=jsonl", f"data.path={d / 'prompts.jsonl'}",
        "data.num_eval=0", 'data.answer_column=""', f"data.use_chat_template={str(bool(w.model)).lower()}",
        f"rollout.num_generations={w.G}", f"rollout.max_completion_length={w.max_new}", "rollout.temperature=1.0",
        f"train.per_device_train_batch_size={w.batch}", f"train.gradient_accumulation_steps={w.ga}",
        f"train.max_steps={steps}", f"train.output_dir={out}", "train.learning_rate=1e-6", "train.device=cpu",
        "train.seed=0", "loss.beta=0.0", "loss.reward_funcs=[\"train_step:bench_reward\"]",
        f"train.bf16={str(bf16).lower()}", f"train.gradient_checkpointing={str(grad_ckpt).lower()}",
    ])
    metrics = out / "metrics.jsonl"
    marks, done = [], threading.Event()

    def watch():  # wall clock at which each step's metrics line lands (train() writes one per step)
        seen = 0
        while True:
            finished = done.is_set()  # one more look once train() has returned: its last line may be new
            n = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            marks.extend([time.perf_counter()] * (n - seen))
            seen = max(seen, n)
            if finished:
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    train(cfg)
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    phases = ("time/rollout", "time/scoring", "time/old_logp", "time/update")
    assert len(marks) == len(rows) == steps, f"{len(rows)} metrics lines for {steps} steps"
    per_step_phases = [sum(r[p] for p in phases) for r in rows]
    # the watcher polls: on a busy machine two rows can land in one poll, and a step lasts at least its phases
    per_step = [max(b - a, spent) for a, b, spent in zip([t0] + marks, marks, per_step_phases)]
    return {"per_step": per_step, "sec_per_step": after_warmup(per_step), "wall": wall,
            "per_step_phases": per_step_phases, "phase_sum": after_warmup(per_step_phases),
            "completion_len_mean": sum(r["completion/len_mean"] for r in rows) / len(rows),
            "phases": {p: after_warmup([r[p] for r in rows]) for p in phases},
            "threads": torch.get_num_threads(), "peak_rss_gb": peak_rss_gb()}


# ----------------------------------------------------------------------------- driver

def side(name: str, d: Path, steps: int, grad_ckpt: bool, threads: int, bf16: bool,
         glibc_malloc: bool = False) -> dict:
    """Run one side in a fresh interpreter; its result is the last stdout line (JSON)."""
    cmd = [sys.executable, __file__, "--worker", name, "--dir", str(d), "--steps", str(steps),
           "--threads", str(threads)]
    if grad_ckpt:
        cmd.append("--grad-ckpt")
    if bf16:
        cmd.append("--bf16")
    if glibc_malloc:
        cmd.append("--trl-glibc-malloc")
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["load"] = (load, os.getloadavg()[0])
    return res


def steps_text(times: list[float]) -> str:
    return ", ".join(f"{s:.1f}" for s in times)


def step_flops(d: Path, w: Workload = Workload()) -> float:
    """Model FLOPs of the least work one step needs: one forward to sample the round, then one
    forward and its backward (twice the forward) to train on it. Each forward is bench/rollout.py's
    count (each prompt once; every completion token but the last fed; the vocabulary projection
    for each sampled token), so the step is 4 times it."""
    from rollout import rollout_flops  # bench/rollout.py, beside this script
    from rlcore.models.transformer import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((w.model_dir(d) / "config.json").read_text()))
    return 4 * rollout_flops(cfg, w.prompts_per_step, w.G, w.prompt_len, w.max_new)


def floor_lines(flops: float, peak: float, res: dict, peak_n: int = 2048) -> list[str]:
    """How far each side is from the step's FLOP floor at this machine's matmul peak, and what
    3x TRL would need: the evidence for whether that target can be met here."""
    lines = [f"floor: {flops / 1e12:.2f} TFLOP of model FLOPs per step (sample: 1 forward; train: 1 forward "
             f"+ backward; each prompt once) = {flops / peak / 1e9:.1f} s/step at the matmul peak of "
             f"{peak:.0f} GFLOP/s ({peak_n}^3 mm, this process, before and after the sides)"]
    rate = {name: flops / r["sec_per_step"] / 1e9 for name, r in res.items()}
    parts = [f"{name} {rate[name]:.0f} GFLOP/s = {rate[name] / peak:.0%} of peak" for name in res]
    if "trl" in res:
        need = res["trl"]["sec_per_step"] / 3
        parts.append(f"3x trl ({need:.1f} s/step) needs {flops / need / 1e9:.0f} GFLOP/s = "
                     f"{flops / need / 1e9 / peak:.0%} of peak")
    return lines + ["; ".join(parts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-steps", type=int, default=2, help="TRL optimizer steps; the first is warm-up")
    ap.add_argument("--rlcore-steps", type=int, default=3, help="rlcore optimizer steps; the first is warm-up")
    ap.add_argument("--side", choices=("both", "trl", "rlcore"), default="both")
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="both sides with gradient checkpointing (TRL's default; rlcore train.gradient_checkpointing=true)")
    ap.add_argument("--bf16", action="store_true",
                    help="both sides in bf16 mixed precision (TRL bf16=True, rlcore train.bf16=true)")
    ap.add_argument("--trl-glibc-malloc", action="store_true",
                    help="TRL with glibc's malloc defaults (by default it gets rlcore's reuse_freed_memory setting)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per side (0 = torch's default)")
    ap.add_argument("--shape", default=Workload.shape, help="the model: bench/rollout.py's --shape (bench, tiny, ...)")
    ap.add_argument("--model", default="", help="a checkpoint directory with a chat template, instead of --shape: "
                    "chat prompts, completions ended by EOS")
    ap.add_argument("--prompt-len", type=int, default=Workload.prompt_len,
                    help="tokens of every prompt (not with --model)")
    ap.add_argument("--G", type=int, default=Workload.G, help="completions per prompt")
    ap.add_argument("--max-new", type=int, default=Workload.max_new, help="most tokens of a completion")
    ap.add_argument("--batch", type=int, default=Workload.batch, help="per_device_train_batch_size")
    ap.add_argument("--ga", type=int, default=Workload.ga, help="gradient_accumulation_steps (one rollout a step)")
    ap.add_argument("--peak-n", type=int, default=2048, help="size n of the n x n x n matmuls timed for the peak")
    ap.add_argument("--worker", choices=("trl", "rlcore"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        d = Path(a.dir)
        res = (run_trl(d, a.steps, a.grad_ckpt, a.bf16, a.trl_glibc_malloc) if a.worker == "trl"
               else run_rlcore(d, a.steps, a.grad_ckpt, a.bf16))
        print(json.dumps(res))
        return

    import torch
    from rollout import CHAT_PROMPTS, SHAPES, chat_prompts, matmul_peak_gflops  # bench/rollout.py, beside this script
    from rlcore.models.tokenizer import Tokenizer

    if a.shape not in SHAPES:
        ap.error(f"--shape {a.shape!r}: one of {', '.join(sorted(SHAPES))}")
    w = Workload(a.shape, a.model, a.prompt_len, a.G, a.max_new, a.batch, a.ga)
    if w.model:
        prompt_lens = [len(p) for p in chat_prompts(Tokenizer.from_dir(w.model), len(CHAT_PROMPTS))]
        what = (f"{w.model}, one step = {w.prompts_per_step} chat prompts ({min(prompt_lens)}-{max(prompt_lens)} "
                f"tokens) x G={w.G}, completion <= {w.max_new} tokens (EOS ends it)")
    else:
        what = (f"{w.shape} shape, one step = {w.prompts_per_step} prompts x G={w.G}, prompt {w.prompt_len} + "
                f"completion <= {w.max_new} tokens")
    print(f"cpu: {a.threads or torch.get_num_threads()} threads, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{what}, micro-batch {w.batch} x GA {w.ga}, fp32 model, "
          f"{'bf16 autocast' if a.bf16 else 'fp32 compute'}; first step of each side dropped", flush=True)
    if a.threads:
        torch.set_num_threads(a.threads)  # the peak below on the sides' threads

    compute = torch.bfloat16 if a.bf16 else torch.float32
    peak = matmul_peak_gflops(torch.device("cpu"), compute, a.peak_n)
    res = {}
    with tempfile.TemporaryDirectory(prefix="rlcore-bench-") as tmp:
        d = Path(tmp)
        if w.model:
            write_chat_prompts(d, w)
        else:
            build_checkpoint(d, w)
        if a.side in ("both", "trl"):
            r = res["trl"] = side("trl", d, a.trl_steps, a.grad_ckpt, a.threads, a.bf16, a.trl_glibc_malloc)
            print(f"trl: {r['sec_per_step']:.2f} s/step (steps: {steps_text(r['per_step'])}), "
                  f"gradient_checkpointing={r['gradient_checkpointing']}, "
                  f"malloc {'glibc defaults' if a.trl_glibc_malloc else 'as rlcore'}, "
                  f"train_runtime {r['train_runtime']:.1f} s, "
                  f"mean completion length {r['completion_len_mean']:.1f}, peak RSS {r['peak_rss_gb']:.2f} GiB, "
                  f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}", flush=True)
            print("trl phases (s/step): " + ", ".join(f"{p} {v:.2f}" for p, v in r["phases"].items()), flush=True)
        if a.side in ("both", "rlcore"):
            r = res["rlcore"] = side("rlcore", d, a.rlcore_steps, a.grad_ckpt, a.threads, a.bf16)
            print(f"rlcore: {r['sec_per_step']:.2f} s/step wall clock (steps: {steps_text(r['per_step'])}; "
                  f"the first includes model load), mean completion length {r['completion_len_mean']:.1f}, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GiB, "
                  f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}", flush=True)
            print("rlcore phases (s/step): " + ", ".join(f"{p.split('/')[1]} {v:.2f}"
                  for p, v in r["phases"].items()) + f"; sum {r['phase_sum']:.2f} "
                  f"(steps: {steps_text(r['per_step_phases'])})", flush=True)
        if w.model:  # the floor at the mean lengths: the chat prompts', the completions the sides sampled
            completion_len = sum(r["completion_len_mean"] for r in res.values()) / len(res)
            w = replace(w, prompt_len=round(sum(prompt_lens) / len(prompt_lens)), max_new=round(completion_len))
            print(f"floor lengths: prompt {w.prompt_len} tokens (the chat prompts' mean), completion {w.max_new} "
                  f"(the sides' mean)", flush=True)
        flops = step_flops(d, w)
    peak = max(peak, matmul_peak_gflops(torch.device("cpu"), compute, a.peak_n))  # the machine may be shared
    for line in floor_lines(flops, peak, res, a.peak_n):
        print(line, flush=True)
    for name, r in res.items():
        print(f"{name}_sec_per_step={r['sec_per_step']:.3f}")
    if len(res) == 2:
        print(f"train_step_speedup_vs_trl={res['trl']['sec_per_step'] / res['rlcore']['sec_per_step']:.2f}")


if __name__ == "__main__":
    main()
