"""What a run records of each step: the metrics row (micro-batches and ranks combined) that
`StepLog` builds from what the loop hands it, one call per round and one per optimizer step, the
progress line, and how far long work has got (`Progress`). Every rank calls them; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlcore.losses.metrics import rollout_mismatch
from rlcore.parallel import collectives
from rlcore.run.state import RunState
from rlcore.tools.turns import ToolCounts, ToolTurns


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
    for i, part in enumerate(parts[1:], 1):
        if set(part) != set(keys):
            odd = sorted(set(part) ^ set(keys))[0]
            raise ValueError(f"the metrics of micro-batch {i} {'lack' if odd in keys else 'add'} {odd!r} (micro-batch "
                             f"0 has {sorted(keys)}); a loss must return the same metric keys for every micro-batch")
    maxes = [k for k in keys if k.endswith(("_max", "/max"))]
    mins = [k for k in keys if k.endswith(("_min", "/min"))]
    means = [k for k in keys if k not in ("loss", "tokens", *maxes, *mins)]
    sums = [sum(part.get("loss", 0.0) for part in parts), sum(part["tokens"] for part in parts)]
    sums = collectives.sum_over_ranks(sums + [sum(part[k] * part["tokens"] for part in parts) for k in means],
                                      world, device)
    peaks = collectives.max_over_ranks([max(part[k] for part in parts) for k in maxes] +
                                       [-min(part[k] for part in parts) for k in mins], world, device)  # min = -max(-x)
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
        return {"memory/peak_gb": collectives.max_over_ranks(
            [torch.cuda.max_memory_allocated() / 2**30], world, device)[0]}
    return {"memory/peak_rss_gb": collectives.max_over_ranks(  # Linux reports KiB
        [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], world, device)[0]}


def tool_metrics(turns: ToolTurns | ToolCounts, world: int, device: torch.device) -> dict[str, float]:
    """The round's tool use over all ranks: calls per completion, failures per call, tool-calling
    turns per completion and the fraction of completions that called a tool (TRL's metrics)."""
    calls, failures, turn_count, used, rows = collectives.sum_over_ranks(
        [sum(turns.calls), sum(turns.failures), sum(turns.turns), sum(c > 0 for c in turns.calls), len(turns.calls)],
        world, device)
    return {"tools/call_frequency": calls / rows, "tools/failure_frequency": failures / max(calls, 1),
            "tools/turns": turn_count / rows, "tools/used_frac": used / rows}


def clock(device: torch.device) -> float:
    """Wall-clock seconds once the device's queued work is done (CUDA runs asynchronously), so a
    phase's time is its own and not the next one's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


@dataclass
class MicroBatch:
    """What a micro-batch's loss left for the step's metrics."""
    loss: float
    diagnostics: dict  # policy_loss's metrics (0-dim tensors), with `tokens`
    logp: torch.Tensor  # [b, Tc] its log-probs, detached: on-policy, the engine-vs-trainer mismatch
    rows: torch.Tensor  # [b] its rows of the round


@dataclass
class Stepped:
    """What the optimizer step did, for its metrics row."""
    grad_norm: float  # before clipping
    finite: bool  # taken (else skipped)
    lr: float  # the rate it used
    loss_scale: float | None  # train.fp16's scale it used
    entropy_coef: float  # the entropy bonus's coefficient it used, before adaptation


class StepLog:
    """Each optimizer step's row of metrics.jsonl, and the progress line.

    `timed(phase)` times a phase of the round (`time/<phase>`, summed over its blocks, on the
    round's first step's row); `round` takes the round's statistics (every rank's rows), writes
    completions.jsonl and measures the engine-vs-trainer mismatch when the round has old log-probs;
    `step` adds the step's micro-batch metrics and optimizer figures, writes the row and prints the
    progress line."""

    def __init__(self, run, state: RunState):
        """`run`: the Run (setup.py), whose RunDir gets the rows; `state`: its RunState."""
        self.train_cfg, self.run_dir, self.state = run.cfg.train, run.dir, state
        self.world, self.device, self.main = run.world, run.device, run.main
        self.max_steps, self.reward_names = run.geometry.max_steps, run.reward_names
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = clock(self.device)
        yield
        key = f"time/{phase}"  # summed over the round (dynamic sampling times each generation batch)
        self.times[key] = self.times.get(key, 0.0) + clock(self.device) - start

    def round(self, scores, lengths: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor, samp: torch.Tensor,
              turns: ToolTurns | ToolCounts | None, old: torch.Tensor | None, tis: torch.Tensor | None,
              staleness: int = 0) -> None:
        """A round's statistics: `scores` (train.RoundScores), this rank's completion `lengths` and
        `truncated` `[n]`, loss `mask` and engine log-probs `samp` `[n, Tc]`, the tools' `turns`, the
        old log-probs and TIS weights `[n, Tc]` when the round has them, and its `staleness`: the
        optimizer steps between the weights that sampled it and those that start training on it.
        Starts the update's clock."""
        world, device = self.world, self.device
        every_length = collectives.gather_rows(lengths, world)  # the round's completions, all ranks
        every_truncated = collectives.gather_rows(truncated.float(), world)
        self.round_stats = {**scores.stats,
                            "completion/len_mean": every_length.float().mean().item(),
                            "completion/len_min": every_length.min().item(),
                            "completion/len_max": every_length.max().item(),
                            "completion/truncated_frac": every_truncated.mean().item(),
                            "tokens_per_s/rollout": every_length.sum().item() / max(self.times["time/rollout"], 1e-9),
                            "async/staleness": staleness,
                            **(tool_metrics(turns, world, device) if turns else {})}
        if self.train_cfg.log_completions:  # every rank's texts and log_extra columns; rank 0 writes them
            texts = collectives.gather_objects((scores.prompts, scores.completions, scores.extra_columns), world)
            self.run_dir.log_completions(self.state.step + 1, texts, scores.rewards, scores.advantages, every_length,
                                         self.reward_names, self.train_cfg.num_completions_to_print)
        # Engine vs trainer log-probs: over the round from `old` when it was computed, else per
        # micro-batch from its log-probs (on-policy, every micro-batch runs before the step).
        self.mismatch = None if old is None else reduce_metrics(
            [{k: float(v) for k, v in rollout_mismatch(old, samp, mask, tis).items()}], world, device)
        if self.mismatch is not None:
            self.mismatch.pop("tokens")
        self.lengths, self.mask, self.samp, self.logged = lengths, mask, samp, scores.logged
        self.update_start = clock(device)

    def step(self, replay: int, rows: torch.Tensor, micro_batches: list[MicroBatch], stepped: Stepped) -> dict:
        """The row of the optimizer step just taken (`state.step`), on pass `replay` over the round,
        from its `micro_batches` (`rows`: all of theirs); written to metrics.jsonl and printed
        every train.logging_steps steps. The round's phase times go on its first step (0 on the
        others), so times sum over steps."""
        world, device, state, bonus = self.world, self.device, self.state, self.state.bonus
        t_step = clock(device) - self.update_start
        completion_tokens = collectives.sum_over_ranks([self.lengths[rows].sum().item()], world, device)[0]
        parts = []
        for micro_batch in micro_batches:
            diagnostics = dict(micro_batch.diagnostics)
            if self.mismatch is None:  # on-policy: from this micro-batch's own log-probs (its `tokens` = diag's)
                diagnostics.update(rollout_mismatch(micro_batch.logp, self.samp[micro_batch.rows],
                                                    self.mask[micro_batch.rows]))
            # one host sync per value: free on CPU, a wait for the GPU's queue on CUDA
            parts.append({"loss": micro_batch.loss, **{key: float(v) for key, v in diagnostics.items()}})
        row = {"step": state.step, "epoch": replay, **self.round_stats, **reduce_metrics(parts, world, device),
               **(self.mismatch or {}), "grad_norm": stepped.grad_norm, "lr": stepped.lr, "skipped": not stepped.finite,
               "nonfinite_total": state.nonfinite_total, **self.times, "time/update": t_step,
               "tokens_per_s/train": completion_tokens / max(t_step, 1e-9)}
        if bonus.enabled:  # TRL logs the coefficient after adaptation, for the next step
            row["entropy_coef"], row["entropy_coef/applied"] = bonus.coef, stepped.entropy_coef
        if bonus.adaptive:  # what the controller compared with entropy_target (the bonus's tokens)
            row["entropy_coef/entropy"] = bonus.last_entropy
        if self.train_cfg.fp16:
            row["loss_scale"], row["overflow_skips"] = stepped.loss_scale, state.overflow_skips
        add_reward_metrics(row, self.logged)
        self.times = dict.fromkeys(self.times, 0.0)
        row.update(memory_metrics(device, world))
        self.run_dir.write_row(row)
        if self.main and (state.step % self.train_cfg.logging_steps == 0 or state.step in (1, self.max_steps)):
            print(log_line(state.step, self.max_steps, row), flush=True)
        self.update_start = clock(device)
        return row
