"""Peak memory of one GRPO optimizer step: full fine-tuning against LoRA.

Qwen2.5-0.5B's shapes with random weights; one optimizer step of 8 prompts x G = 4 completions of
128 tokens with loss.beta = 0.04, through rlcore's own loop (`rlcore.train.train`), each variant in
a process of its own:
  full  every weight trains in fp32 (AdamW: 16 bytes a parameter); the reference, a second model
  lora  r = 16 adapters on every projection over a bf16 base, gradient checkpointing; the reference,
        the same model with its adapters off
The rollout returns fixed random 128-token completions (its KV cache is not counted: the step's
training memory is). Peak memory is above the process's baseline after imports: the resident set
on CPU (VmHWM), allocated memory on CUDA. The peak is reset as the round starts, with the models
loaded: loading an fp32 file into a bf16 model holds both for a moment, which is not the step's. Then a table of what each setup needs for Qwen2.5's
0.5B, 1.5B, 7B and 14B: weights, gradients, optimizer and reference from their parameter counts,
activations scaled from the measured run by layers x hidden size. Last line:
lora_peak_mem_ratio=<LoRA / full>.

    python bench/memory.py [--device cpu|cuda]

--shape, --prompts, --G, --new-tokens and --rank change the measured run (the table's activations
are then scaled from it); tests/test_bench_smoke.py's smoke run, every line and no figure:

    python bench/memory.py --device cpu --shape tiny --prompts 2 --G 2 --new-tokens 2 --rank 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPE = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
             rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False, bos_token_id=None, eos_token_id=1)
SHAPES = {"qwen2.5-0.5b": SHAPE,  # the measured run's model; tiny: a smoke run's (vocab > the tokenizer's 97)
          "tiny": dict(SHAPE, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)}
# Qwen2.5's sizes: (layers, hidden, intermediate, heads, kv heads, vocab, tied)
MODELS = {"0.5B": (24, 896, 4864, 14, 2, 151936, True), "1.5B": (28, 1536, 8960, 12, 2, 151936, True),
          "7B": (28, 3584, 18944, 28, 4, 152064, False), "14B": (48, 5120, 13824, 40, 8, 152064, False)}
PROMPTS, G, NEW_TOKENS, RANK = 8, 4, 128, 16
GPUS_GB = (24, 80, 141)


def counts(layers, hidden, inter, heads, kv, vocab, tied, r=RANK) -> tuple[int, int]:
    """(all parameters, LoRA parameters of rank r on every projection) of a Qwen2.5-shaped model,
    counted on rlcore's own model built on the meta device (no memory)."""
    from rlcore.models.lora import apply_lora, lora_parameters
    from rlcore.models.transformer import ModelConfig, Transformer

    cfg = ModelConfig.from_hf(dict(SHAPE, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   tie_word_embeddings=tied))
    with torch.device("meta"):
        model = Transformer(cfg)
        total = sum(p.numel() for p in model.parameters())
        apply_lora(model, r, 2 * r)
        return total, sum(p.numel() for p in lora_parameters(model))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The resident set's high-water mark (VmHWM) since the last reset."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def build_checkpoint(path: Path, shape: dict = SHAPE) -> None:
    """Random weights of `shape` (fp32; Qwen2.5-0.5B's) with the embedded model's character tokenizer."""
    from rlcore.models.embedded import write_char_tokenizer
    from rlcore.models.hf_checkpoint import save_model
    from rlcore.models.transformer import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(shape))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer files the embedded arithmetic model has
        write_char_tokenizer(Path(tmp))
        save_model(model, path, extra_files={n: Path(tmp) / n for n in ("tokenizer.json", "tokenizer_config.json")})


def run_variant(variant: str, model_dir: str, device: str, prompts: int = PROMPTS, G: int = G,
                new_tokens: int = NEW_TOKENS, rank: int = RANK) -> dict:
    """One optimizer step of `variant` in this process; its peak memory above the baseline."""
    import rlcore.rollout.completions
    from rlcore.config import load_config
    from rlcore.rollout.engine import Rollout
    from rlcore.train import train

    cuda = device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # "5": VmHWM back to the current resident set
                f.write("5")

    rounds = []

    def fixed(model, prompts, num_generations, max_new_tokens, pad_token_id, generator=None, **kwargs):
        rounds.append(len(prompts))
        reset_peak()  # the round starts: models loaded, the optimizer's moments not yet allocated
        g = torch.Generator().manual_seed(len(prompts))
        ids = torch.randint(3, 20, (len(prompts), max_new_tokens), generator=g)
        return Rollout(prompt_ids=prompts, completion_ids=ids, completion_mask=torch.ones_like(ids),
                       lengths=torch.full((len(prompts),), max_new_tokens), truncated=torch.ones(len(prompts), dtype=bool),
                       sampling_logprobs=torch.zeros(ids.shape), full_logprobs=None)

    rlcore.rollout.completions.generate = fixed  # the engine as the loop's sampling calls it
    run_dir = tempfile.mkdtemp()  # removed once the step is measured: the full variant saves a model and AdamW's state
    options = [f"model.path={model_dir}", "data.task=arithmetic", "data.num_eval=0", "data.num_train=64",
               f"rollout.num_generations={G}", f"rollout.max_completion_length={new_tokens}",
               f"train.per_device_train_batch_size={prompts * G // 4}", "train.gradient_accumulation_steps=4",
               "train.max_steps=1", "loss.beta=0.04", "train.bf16=false", f"train.device={device}",
               "train.learning_rate=1e-6", f"train.output_dir={run_dir}"]
    if variant == "lora":
        options += ["lora.enabled=true", f"lora.r={rank}", f"lora.alpha={2 * rank}", "model.dtype=bfloat16",
                    "train.gradient_checkpointing=true"]
    try:
        train(load_config(None, options))
        peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if rounds != [prompts * G]:  # else the peak would be reset elsewhere, or never, and include sampling
        raise RuntimeError(f"the fixed rollout stood in for {rounds} rounds of completions, not one of {prompts * G}: "
                           f"the loop no longer samples through rlcore.rollout.completions.generate")
    return {"variant": variant, "peak_bytes": peak - baseline}


def size(shape: dict) -> tuple:
    """A SHAPES entry as MODELS has it: (layers, hidden, intermediate, heads, kv heads, vocab, tied)."""
    return tuple(shape[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size", "tie_word_embeddings"))


def table(measured: dict[str, int], run: tuple = MODELS["0.5B"], rank: int = RANK) -> list[str]:
    """What each setup needs for each model size: fixed parts from parameter counts, activations
    scaled from the measured run of shape `run` (the 0.5B; its peak minus its fixed parts) by
    layers x hidden size."""
    gb = 2**30
    layers0, hidden0 = run[:2]
    total0, lora0 = counts(*run, r=rank)
    fixed0 = {"full": 20 * total0, "lora": 2 * total0 + 16 * lora0}
    activations0 = {v: max(0, measured[v] - fixed0[v]) for v in measured}
    lines = [f"{'model':>5} {'setup':>5} {'weights':>8} {'grads':>7} {'adamw':>7} {'ref':>6} {'activ.':>7} "
             f"{'total':>7}  fits on " + " / ".join(f"{g} GB" for g in GPUS_GB)]
    for name, shape in MODELS.items():
        total, lora = counts(*shape, r=rank)
        scale = shape[0] * shape[1] / (layers0 * hidden0)
        for variant in ("full", "lora"):
            if variant == "full":  # fp32 weights, gradients, AdamW's two moments; the reference, a second copy
                parts = [4 * total, 4 * total, 8 * total, 4 * total]
            else:  # bf16 base; fp32 adapters, their gradients and moments; no second model
                parts = [2 * total + 4 * lora, 4 * lora, 8 * lora, 0]
            parts.append(activations0[variant] * scale)
            need = sum(parts)
            fits = " / ".join("yes" if need <= g * 1e9 else "no" for g in GPUS_GB)
            lines.append(f"{name:>5} {variant:>5} " + " ".join(f"{p / gb:>7.1f}" for p in parts) +
                         f" {need / gb:>7.1f}  {fits}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b", help="the measured run's model")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts in the step")
    parser.add_argument("--G", type=int, default=G, help="completions per prompt (prompts x G: a multiple of 4)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens of every completion")
    parser.add_argument("--rank", type=int, default=RANK, help="LoRA's r")
    parser.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    step = dict(prompts=args.prompts, G=args.G, new_tokens=args.new_tokens, rank=args.rank)
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.model, args.device, **step)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / f"{args.shape}-random"
        build_checkpoint(model_dir, SHAPES[args.shape])
        measured = {}
        for variant in ("full", "lora"):
            cmd = [sys.executable, __file__, "--variant", variant, "--model", str(model_dir), "--device", args.device]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in step.items()]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"the {variant} worker failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            measured[variant] = result["peak_bytes"]
            print(f"{variant}: peak {result['peak_bytes'] / 2**30:.2f} GiB above the process's baseline "
                  f"({args.device}, {args.prompts} prompts x G={args.G} x {args.new_tokens} tokens, beta=0.04)",
                  flush=True)
    print("\n".join(table(measured, size(SHAPES[args.shape]), args.rank)))
    print(f"lora_peak_mem_ratio={measured['lora'] / measured['full']:.3f}")


if __name__ == "__main__":
    main()
