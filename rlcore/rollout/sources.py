"""Where step 1 of the loop gets its rounds: sampled in line, or ahead by a sampler thread.

A round sampled with the weights the trainer holds when it takes the round is on-policy; one
sampled ahead, while earlier rounds train, comes from older weights. `max_staleness` (s, TRL's
name) fixes how much older: round r is sampled with the weights the trainer held when it started
round r - s (rounds before the first s: the first round's), or with weight_sync_steps = w > 1 the
newest copy the trainer published at a multiple of w steps by then. Fixing the version, not just
bounding it, makes an asynchronous run as deterministic as a synchronous one: the sampler's RNG
draws one key per round, in round order, and the weights of each round are known in advance, so a
run (or its resume) samples the same rounds whatever the timing. docs/async.md states the
estimator that trains on such rounds.

`InlineRounds` samples when asked (the synchronous loop). `ThreadedRounds` samples on a thread of
its own, on its own copy of the weights, at most s + 1 rounds ahead of the trainer.
`rlcore.parallel.sampler_ranks` does the same on ranks of their own.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlcore.rollout.engine import Rollout
from rlcore.tools.turns import ToolTurns

Weights = dict[str, torch.Tensor]
Sample = Callable[[torch.nn.Module, list[dict], torch.Generator, str], tuple[Rollout, ToolTurns | None]]
"""sample(policy, rows, generator, label): one completion per row, and the tool turns (None without tools)"""


@dataclass
class SampledRound:
    """One round as step 1 takes it: this rank's rows, their rollout, and where it came from."""
    rows: list[dict]
    rollout: Rollout
    turns: ToolTurns | None
    version: int  # the optimizer step of the weights that sampled it
    sampler_rng: torch.Tensor  # the sampler's RNG state after it: where a resume samples the next round from


def publishes(step: int, weight_sync_steps: int) -> bool:
    """Whether the trainer's weights after optimizer step `step` are a version the sampler may use."""
    return step % weight_sync_steps == 0


def weights_of(policy: torch.nn.Module) -> Weights:
    """A copy of `policy`'s weights that later optimizer steps leave alone: one version."""
    return {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}


class InlineRounds:
    """The synchronous loop's rounds: sampled when step 1 asks, with the weights the trainer holds."""

    def __init__(self, sample: Sample, draw: Callable[[int], list[dict]], generating):
        self.sample, self.draw, self.generating = sample, draw, generating

    def next(self, state) -> SampledRound:
        rows = self.draw(state.data_pos)
        with self.generating() as policy:  # under FSDP a plain copy, its full weights gathered once
            rollout, turns = self.sample(policy, rows, state.sampler, f"step {state.step + 1} rollout")
        return SampledRound(rows, rollout, turns, state.step, state.sampler.get_state())

    def trained(self, step: int) -> None:
        """Nothing to publish: the next round samples with the trainer's own weights."""

    def resume_point(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Versions:
    """Which weights sample which round, as the trainer decides it: each version it publishes
    (`publish`, after an optimizer step that is a multiple of weight_sync_steps), and at the start
    of each round q (`start_round`) the newest one fixed as round q + s's. A version stays until
    the round that uses it is taken (`took`), so a checkpoint between the two holds it
    (`resume_point`): the resumed run samples that round again, the same. Rounds are counted from
    the source's first; rounds 0 .. s-1 have the saved run's versions, or the current weights."""

    def __init__(self, staleness: int, current: tuple[int, Weights], saved: dict | None):
        self.staleness = staleness
        versions = [current] * (staleness + 1)
        if saved and len(saved["versions"]) == staleness + 1:  # else the saved run had another max_staleness
            versions = [(step, saved["weights"][i]) for step, i in saved["versions"]]
        self.fixed: dict[int, tuple[int, Weights]] = dict(enumerate(versions[:-1]))  # round -> (step, weights)
        self.newest = versions[-1]
        self.taken = 0  # rounds the trainer has taken

    def start_round(self) -> int:
        """Round `taken` starts: fix the newest version for round taken + s, and return that round."""
        self.fixed.setdefault(self.taken + self.staleness, self.newest)
        return self.taken + self.staleness

    def took(self) -> None:
        del self.fixed[self.taken]
        self.taken += 1

    def publish(self, step: int, weights: Weights) -> None:
        self.newest = (step, weights)

    def resume_point(self) -> dict:
        """The versions fixed for the next s rounds, in order, and the newest: a checkpoint's
        `sampler_weights`, each version's tensors once."""
        versions = [self.fixed[q] for q in range(self.taken, self.taken + self.staleness)] + [self.newest]
        unique = list({id(weights): weights for _, weights in versions}.values())
        order = {id(weights): i for i, weights in enumerate(unique)}
        return {"sampler_weights": {"weights": unique,
                                    "versions": [(step, order[id(weights)]) for step, weights in versions]}}


class ThreadedRounds:
    """Rounds sampled ahead by a thread on its own copy of the policy (`copy.deepcopy` of the
    trainer's, so LoRA adapters and dtypes come along), at most s + 1 rounds ahead of the trainer,
    each with the version `Versions` fixed for it."""

    def __init__(self, sample: Sample, draw: Callable[[int], list[dict]], generating, state, staleness: int,
                 weight_sync_steps: int, rounds: int, prompts_per_round: int, saved: dict | None = None,
                 timeout: float = 600.0):
        self.sample, self.draw, self.generating = sample, draw, generating
        self.weight_sync_steps, self.prompts_per_round, self.rounds = weight_sync_steps, prompts_per_round, rounds
        self.timeout = timeout
        with generating() as policy:
            self.policy = copy.deepcopy(policy).requires_grad_(False).eval()
            self.versions = Versions(staleness, (state.step, weights_of(policy)), saved)
        device = next(self.policy.parameters()).device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # sampling beside training
        self.generator = torch.Generator(device=state.sampler.device)
        self.generator.set_state(state.sampler.get_state())
        self.data_pos = state.data_pos
        self.ready: queue.Queue = queue.Queue()
        self.changed = threading.Condition()  # guards `versions`, shared with the sampler thread
        self.stopping = False
        self.thread = threading.Thread(target=self._sample_rounds, name="rlcore-sampler", daemon=True)
        self.thread.start()

    # -- the trainer's side

    def next(self, state) -> SampledRound:
        """The next round, once sampled; the version of the round s later is fixed first, so the
        sampler can start on it while this one trains."""
        with self.changed:
            self.versions.start_round()
            self.changed.notify_all()
        try:
            item = self.ready.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"the sampler thread gave no round in rollout.sampler_timeout = {self.timeout} s; "
                               f"raise it if sampling a round takes longer") from None
        if isinstance(item, BaseException):
            raise RuntimeError(f"the sampler thread failed: {type(item).__name__}: {item}") from item
        with self.changed:
            self.versions.took()
        state.sampler.set_state(item.sampler_rng)  # what a checkpoint continues from
        return item

    def trained(self, step: int) -> None:
        """After optimizer step `step`: publish the weights when it is a multiple of weight_sync_steps."""
        if publishes(step, self.weight_sync_steps):
            with self.generating() as policy:
                weights = weights_of(policy)
            if self.stream is not None:  # the copy is made before the sampler's stream reads it
                torch.cuda.current_stream().synchronize()
            with self.changed:
                self.versions.publish(step, weights)

    def resume_point(self) -> dict:
        with self.changed:
            return self.versions.resume_point()

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.thread.join()

    # -- the sampler's side

    def _sample_rounds(self) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self._sample_rounds_on_stream()

    def _sample_rounds_on_stream(self) -> None:
        loaded = None  # the weights the sampler's copy holds
        try:
            for q in range(self.rounds):
                with self.changed:
                    self.changed.wait_for(lambda: self.stopping or q in self.versions.fixed)
                    if self.stopping:
                        return
                    version, weights = self.versions.fixed[q]
                if loaded is not weights:
                    self.policy.load_state_dict(weights)
                    loaded = weights
                rows = self.draw(self.data_pos)
                self.data_pos += self.prompts_per_round
                rollout, turns = self.sample(self.policy, rows, self.generator, f"round {q + 1} rollout (sampler)")
                if self.stream is not None:  # the round's tensors are written before the trainer reads them
                    self.stream.synchronize()
                self.ready.put(SampledRound(rows, rollout, turns, version, self.generator.get_state()))
        except BaseException as e:  # the trainer raises it at its next round
            self.ready.put(e)
