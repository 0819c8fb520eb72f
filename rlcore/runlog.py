"""What a run records besides its checkpoints: the metrics row of each step (micro-batches and
ranks combined), the progress line, how far long work has got (`Progress`), held-out accuracy
and rewards in eval.jsonl, and the completions of each round in completions.jsonl
(train.log_completions). Rank 0 writes; `reduce_metrics` is called on every rank.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path

import torch

from rlcore import distributed


def reduce_metrics(parts: list[dict], world: int = 1, device: torch.device | None = None) -> dict:
    """Metric dicts of micro-batches (each with `tokens`, the active tokens it averaged over),
    combined over this rank's parts and all ranks as if computed over all their tokens at once.

    `loss` is summed over the parts (the step's gradient is that of the sum) and averaged over
    ranks (as the gradients are); `tokens` is summed; keys ending in `_max` or `/max` take the
    maximum, `_min` or `/min` the minimum. Every other entry is a mean over active tokens, so it
    is weighted by them (an unweighted mean would let a micro-batch of short completions count as
    much as one of long ones). Every part must have the same keys (a ValueError names the first
    difference). One all-reduce of the sums and one of the extremes, whatever the number of keys.
    """
    keys = list(parts[0])
    for i, d in enumerate(parts[1:], 1):
        if set(d) != set(keys):
            odd = sorted(set(d) ^ set(keys))[0]
            raise ValueError(f"the metrics of micro-batch {i} {'lack' if odd in keys else 'add'} {odd!r} (micro-batch "
                             f"0 has {sorted(keys)}); a loss must return the same metric keys for every micro-batch")
    maxes = [k for k in keys if k.endswith(("_max", "/max"))]
    mins = [k for k in keys if k.endswith(("_min", "/min"))]
    means = [k for k in keys if k not in ("loss", "tokens", *maxes, *mins)]
    sums = [sum(d.get("loss", 0.0) for d in parts), sum(d["tokens"] for d in parts)]
    sums = distributed.sum_over_ranks(sums + [sum(d[k] * d["tokens"] for d in parts) for k in means], world, device)
    peaks = distributed.max_over_ranks([max(d[k] for d in parts) for k in maxes] +
                                       [-min(d[k] for d in parts) for k in mins], world, device)  # min = -max(-x)
    out = {"loss": sums[0] / world} if "loss" in parts[0] else {}
    out["tokens"] = sums[1]
    out.update({k: s / max(sums[1], 1) for k, s in zip(means, sums[2:])})
    out.update(zip(maxes, peaks))
    out.update({k: -v for k, v in zip(mins, peaks[len(maxes):])})
    return out


PROGRESS_AFTER_S = 10.0  # work running longer than this says how far it has got, at most once per this


class Progress:
    """How far a long piece of work has got, for a step or an evaluation that takes minutes (a
    real model on CPU) and would otherwise print nothing until it ends. `report(what)` prints
    `  <label>: <what>, <seconds>s` once the work has run PROGRESS_AFTER_S, then at most once
    every PROGRESS_AFTER_S; quick work prints nothing. Only where `enabled` (rank 0)."""

    def __init__(self, label: str, enabled: bool = True):
        self.label, self.enabled = label, enabled
        self.start = self.last = time.perf_counter()

    def report(self, what: str) -> None:
        now = time.perf_counter()
        if self.enabled and now - self.last > PROGRESS_AFTER_S:
            print(f"  {self.label}: {what}, {now - self.start:.0f}s", flush=True)
            self.last = now


def log_line(step: int, max_steps: int, m: dict) -> str:
    """The progress line: kl_old is the policy's KL to the rollout policy (k3; 0 on-policy),
    kl_ref (with beta > 0) to the reference model, TRL's `kl`; with tools, the fraction of
    completions that called one."""
    clip = f"clip {m['clip_ratio/region']:.3f}  " if "clip_ratio/region" in m else ""  # ppo only
    tools = f"tools {m['tools/used_frac']:.3f}  " if "tools/used_frac" in m else ""  # with rollout.tools
    kl_ref = f"kl_ref {m['kl_ref']:.4f}  " if m.get("kl_ref") is not None else ""
    acc = "-" if m["reward/accuracy"] is None else f"{m['reward/accuracy']:.3f}"  # None: no answers to check
    return (f"step {step:>4}/{max_steps}  reward {m['reward/mean']:.3f}  acc {acc}  "
            f"kl_old {m['kl_old/k3']:.4f}  {kl_ref}{clip}{tools}len {m['completion/len_mean']:.1f}  "
            f"gen {m['tokens_per_s/rollout']:.0f} tok/s  time rollout {m['time/rollout']:.1f}s "
            f"score {m['time/scoring']:.2f}s update {m['time/update']:.1f}s")


def record_eval(run: Path, step: int, held_out: dict) -> None:
    """Append `evaluate`'s metrics at `step` to run/eval.jsonl (step 0 = before training), those
    that are not None, and print the accuracy, reward and tool use; nothing when all are None (no held-out
    prompt could be scored)."""
    row = {key: value for key, value in held_out.items() if value is not None}
    if not row:
        return
    with open(run / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **row}) + "\n")
    said = [f"{what} {row[key]:.3f}" for what, key in (("accuracy", "eval/accuracy"), ("reward", "eval/reward/mean"),
                                                       ("tool use", "eval/tools/used_frac")) if key in row]
    print(f"step {step}: held-out " + ", ".join(said), flush=True)


def drop_rows_after(file: Path, step: int) -> None:
    """Keep the JSON lines of `file` whose "step" is at most `step` (a resume drops later ones,
    and a line a crash cut short)."""
    if file.exists():
        keep = [ln for ln in file.read_text().splitlines() if _step(ln) <= step]
        file.write_text("".join(ln + "\n" for ln in keep))


def _step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def log_completions(run: Path, step: int, texts: list, R: torch.Tensor, adv: torch.Tensor,
                    lengths: torch.Tensor, names: list[str], show: int | None) -> None:
    """Append a round's completions, all ranks' in order, to run/completions.jsonl with their
    rewards `R` `[N, F]` (None where unscored), advantage `[N]`, length `[N]` and the columns
    reward functions gave `log_extra` (one value per completion); print `show` of them spread
    over the round (None: all), as TRL's log_completions does. `texts` holds each rank's
    (prompts, completions, extra columns)."""
    own = ("step", "prompt", "completion", "rewards", "advantage", "length")
    for prompts, _, extra in texts:
        for column, values in extra.items():
            if column in own:
                raise ValueError(f"log_extra column {column!r} is one of completions.jsonl's own fields "
                                 f"({', '.join(own)}); give it another name")
            if len(values) != len(prompts):
                raise ValueError(f"log_extra column {column!r} got {len(values)} values for {len(prompts)} "
                                 f"completions; log one value per completion")
    rows = [{"prompt": p, "completion": c, **{k: v[i] for k, v in extra.items()}}
            for prompts, completions, extra in texts for i, (p, c) in enumerate(zip(prompts, completions))]
    records = [{"step": step, **row, "rewards": {n: None if math.isnan(x) else x for n, x in zip(names, r)},
                "advantage": a, "length": n}
               for row, r, a, n in zip(rows, R.tolist(), adv.tolist(), lengths.tolist())]
    with open(run / "completions.jsonl", "a") as f:
        f.writelines(json.dumps(rec, default=str) + "\n" for rec in records)
    stride = 1 if show is None else max(1, len(records) // max(show, 1))  # across groups, not one
    for i in range(0, len(records), stride)[:show]:
        rec = records[i]
        scores = ", ".join(f"{n} {x:.3g}" if x is not None else f"{n} None" for n, x in rec["rewards"].items())
        print(f"  completion {i + 1}/{len(records)}: {scores}, advantage {rec['advantage']:+.3f}\n"
              f"    prompt: {str(rec['prompt'])[-200:]!r}\n    completion: {str(rec['completion'])[:300]!r}", flush=True)


def add_reward_metrics(row: dict, logged: dict) -> None:
    """Add the reward functions' log_metric means to a step's metrics row; a name rlcore's own metrics
    use is an error (it would overwrite one)."""
    if taken := sorted(set(logged) & set(row)):
        raise ValueError(f"a reward function's log_metric name {taken[0]!r} is one of rlcore's own "
                         f"metrics; log it under another name (e.g. 'custom/{taken[0]}')")
    row.update(logged)


def memory_metrics(device: torch.device, world: int) -> dict:
    """The peak memory so far, the largest over ranks: allocated on CUDA, the process's resident set
    on CPU (one all-reduce)."""
    if device.type == "cuda":
        return {"memory/peak_gb": distributed.max_over_ranks(
            [torch.cuda.max_memory_allocated() / 2**30], world, device)[0]}
    return {"memory/peak_rss_gb": distributed.max_over_ranks(  # Linux reports KiB
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], world, device)[0]}


def write_row(file: Path, row: dict) -> None:
    """Append a metrics row as one line of strict JSON (NaN and inf as null)."""
    with open(file, "a") as f:
        f.write(json.dumps({key: None if isinstance(v, float) and not math.isfinite(v) else v
                            for key, v in row.items()}) + "\n")
