"""Disaggregated rollouts: under torchrun, rollout.rollout_ranks = k ranks only sample and the
others only train.

Of W ranks, 0 .. T-1 train (T = W - k; their collectives, FSDP2's included, run in a group of
their own, so the loop is the loop of T ranks) and T .. W-1 sample. Trainer rank 0 and the
samplers form two more groups: over them trainer rank 0 broadcasts, once, where the run starts
(the data position, each trainer's sampler RNG), then for each round the version of the weights
that samples it (`Versions` in rlcore.rollout.sources fixes which), the tensors themselves only
when they are a version the samplers do not hold yet. A round's rows are cut as for T ranks that sample their own:
trainer rank r's rows are sampled with trainer r's RNG stream, by sampler rank T + r % k, and sent
to rank r point to point as a pickled byte tensor (the rollout, its tool turns, the version, the
RNG state after it). So the run samples exactly what T ranks that sample for themselves would, at
the same staleness, and a resume continues it the same way.

Every wait has a deadline (rollout.sampler_timeout), and a peer that dies closes its connections:
either way the waiting rank stops with an error that says which rank and how to resume, instead
of hanging. gloo on CPU; on GPU the weights go over NCCL like the rest, and the headers and the
rounds' bytes over gloo.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from rlcore.parallel import collectives
from rlcore.rollout.sources import Sample, SampledRound, Versions, publishes, weights_of


class SamplerRankError(ConnectionError):
    """A sampler rank (or trainer rank 0, for a sampler) stopped answering; the message says how to resume."""
    rank_local = True  # every rank that meets it says so (the command line prints rank 0's errors alone)


class Ranks:
    """This rank's place in a disaggregated run: `trainers` (T) ranks train, the rest sample."""

    def __init__(self, world: int, samplers: int, timeout: float):
        self.world, self.trainers, self.samplers = world, world - samplers, samplers
        self.rank, self.timeout = dist.get_rank(), datetime.timedelta(seconds=timeout)
        # every rank creates every group, in this order (new_group is collective over the whole world)
        self.training = dist.new_group(list(range(self.trainers)), timeout=self.timeout)
        self.weights = dist.new_group([0, *range(self.trainers, world)], timeout=self.timeout)  # the tensors
        self.bytes = dist.new_group([0, *range(self.trainers, world)], backend="gloo",
                                    timeout=self.timeout)  # the start and each round's header, on the CPU
        self.mail = dist.new_group(list(range(world)), backend="gloo", timeout=self.timeout)  # rounds, on the CPU
        if self.rank < self.trainers:
            collectives.train_among(self.training)

    @property
    def samples(self) -> bool:
        return self.rank >= self.trainers

    def sampler_of(self, trainer: int) -> int:
        """The sampler rank that samples trainer rank `trainer`'s rows."""
        return self.trainers + trainer % self.samplers

    def wait(self, receive: Callable, what: str, peer: int, resume: str) -> None:
        """Start `receive` (a receive from rank `peer`, returning its work) and wait for it until
        the deadline; a dead peer or the deadline is a SamplerRankError that names both and how to
        go on."""
        try:
            receive().wait(self.timeout)
        except RuntimeError as e:
            role = "sampler" if peer >= self.trainers else "trainer"
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SamplerRankError(
                f"{role} rank {peer} stopped, or sent rank {self.rank} no {what} within rollout.sampler_timeout = "
                f"{self.timeout.total_seconds():g} s ({cause}); the run stops here. {resume}") from None


def send_object(ranks: Ranks, obj, to: int) -> list:
    """Send `obj` to rank `to` as a pickled byte tensor (its length first); the pending works,
    which hold the tensors until sent."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [(dist.isend(size, to, group=ranks.mail), size), (dist.isend(data, to, group=ranks.mail), data)]


def receive_object(ranks: Ranks, source: int, what: str, resume: str):
    """The object `send_object` sent from rank `source` (rlcore's own ranks: unpickling is trusted)."""
    size = torch.zeros(1, dtype=torch.long)
    ranks.wait(lambda: dist.irecv(size, source, group=ranks.mail), what, source, resume)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    ranks.wait(lambda: dist.irecv(data, source, group=ranks.mail), what, source, resume)
    return pickle.loads(data.numpy().tobytes())


class RemoteRounds:
    """A trainer rank's rounds, sampled by the sampler ranks (step 1 of the loop, as
    `rlcore.rollout.sources.ThreadedRounds` on one process)."""

    def __init__(self, ranks: Ranks, draw: Callable[[int], list[dict]], generating, state, staleness: int,
                 weight_sync_steps: int, rounds: int, saved: dict | None, toolbox, tokenizer, resume: str):
        self.ranks, self.draw, self.generating, self.rounds = ranks, draw, generating, rounds
        self.weight_sync_steps, self.toolbox, self.tokenizer, self.resume = weight_sync_steps, toolbox, tokenizer, resume
        self.pending, self.sent = [], None  # rank 0: broadcasts in flight; the weights the samplers hold
        self.versions = None
        rngs = collectives.gather_objects(state.sampler.get_state(), ranks.trainers)  # each trainer's stream
        with generating() as policy:  # under FSDP every trainer gathers the weights; rank 0 keeps them
            if ranks.rank == 0:
                self.versions = Versions(staleness, (state.step, weights_of(policy)), saved)
        if ranks.rank == 0:
            start = [{"rounds": rounds, "data_pos": state.data_pos, "rngs": rngs}]
            dist.broadcast_object_list(start, src=0, group=ranks.bytes)
            for q in range(min(staleness, rounds)):  # the rounds before the first s: their versions now
                self._send_version(q)

    def _send_version(self, q: int) -> None:
        """Broadcast round q's version to the samplers: its step, then its tensors if they are new."""
        step, weights = self.versions.fixed[q]
        new = weights is not self.sent
        header = torch.tensor([q, step, int(new)], dtype=torch.long)
        self.pending = [(work, kept) for work, kept in self.pending if not work.is_completed()]
        self.pending.append((dist.broadcast(header, src=0, group=self.ranks.bytes, async_op=True), header))
        if new:
            for tensor in weights.values():
                self.pending.append((dist.broadcast(tensor, src=0, group=self.ranks.weights, async_op=True), weights))
            self.sent = weights

    def next(self, state) -> SampledRound:
        if self.versions is not None:
            q = self.versions.start_round()
            if q < self.rounds:
                self._send_version(q)
        rows = self.draw(state.data_pos)
        source = self.ranks.sampler_of(self.ranks.rank)
        rollout, turns, version, rng = receive_object(self.ranks, source, f"round at step {state.step + 1}",
                                                      self.resume)
        if self.versions is not None:
            self.versions.took()
        state.sampler.set_state(rng)  # what a checkpoint continues from
        return SampledRound(rows, rollout, None if turns is None else turns.attach(self.toolbox, self.tokenizer),
                            version, rng)

    def trained(self, step: int) -> None:
        if publishes(step, self.weight_sync_steps):
            with self.generating() as policy:  # every trainer, as above
                if self.versions is not None:
                    self.versions.publish(step, weights_of(policy))

    def resume_point(self) -> dict:
        return {} if self.versions is None else self.versions.resume_point()

    def close(self) -> None:
        for work, _ in self.pending:
            work.wait(self.ranks.timeout)


def serve_rounds(ranks: Ranks, policy: torch.nn.Module, sample: Sample, draw_all: Callable[[int], list[dict]],
                 completions_per_rank: int, prompts_per_round: int, resume: str) -> None:
    """A sampler rank's whole run: receive where it starts, then for each round its version of
    the weights, sample the rows of the trainers it serves, and send each its rows."""
    start = [None]
    dist.broadcast_object_list(start, src=0, group=ranks.bytes)
    rounds, data_pos, rngs = start[0]["rounds"], start[0]["data_pos"], start[0]["rngs"]
    mine = [r for r in range(ranks.trainers) if ranks.sampler_of(r) == ranks.rank]
    device = next(policy.parameters()).device
    generators = {r: torch.Generator(device=device).set_state(rngs[r]) for r in mine}
    tensors = list(policy.state_dict().values())  # received in place: the same order trainer 0 sends
    pending = []
    for q in range(rounds):
        header = torch.zeros(3, dtype=torch.long)
        ranks.wait(lambda: dist.broadcast(header, src=0, group=ranks.bytes, async_op=True), "weights", 0, resume)
        _, version, new = header.tolist()
        if new:
            for tensor in tensors:
                ranks.wait(lambda: dist.broadcast(tensor, src=0, group=ranks.weights, async_op=True), "weights", 0,
                           resume)
        rows = draw_all(data_pos)
        data_pos += prompts_per_round
        for r in mine:
            chunk = rows[r * completions_per_rank:(r + 1) * completions_per_rank]
            rollout, turns = sample(policy, chunk, generators[r], f"round {q + 1} rollout (rank {ranks.rank})")
            rollout = dataclasses.replace(rollout, **{name: value.cpu() for name, value in vars(rollout).items()
                                                      if isinstance(value, torch.Tensor)})  # off this rank's GPU
            pending = [(work, kept) for work, kept in pending if not work.is_completed()]
            pending += send_object(ranks, (rollout, turns, version, generators[r].get_state()), r)
    for work, _ in pending:
        work.wait(ranks.timeout)
