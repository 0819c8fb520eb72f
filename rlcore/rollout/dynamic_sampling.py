"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2; verl's
algorithm.filter_groups): a round's generation batches, which of their groups it keeps, and the
round it trains on.

A group whose rewards are all equal has advantages 0 and teaches nothing. With rollout.filter_groups
the loop samples and scores generation batches (the next N/G prompts, G completions each, every
rank its rows) and hands each to `GenerationBatches.add`, which judges its groups: a group is kept
when its judged rewards differ (`varied_groups`), the weighted total reward or one reward
function's scores (rollout.filter_groups_metric). Once it is `full` (N/G groups kept, or
rollout.max_num_gen_batches batches sampled), `take` builds the round: the first N/G kept groups in
the order sampled (later ones are dropped, as verl drops them), and at the cap with fewer, the
first dropped groups after them, as many as make N/G. docs/loop.md has the rules and why.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch

from rlcore.losses.advantages import varied_groups, weighted_rewards
from rlcore.parallel import collectives
from rlcore.rollout.engine import Rollout
from rlcore.tools.turns import ToolCounts, ToolTurns


@dataclass
class SampledRows:
    """One rank's rows of a generation batch, all that the round may take of them (picklable, for
    the all-gather under torchrun)."""
    rollout: Rollout
    prompts: list  # as the reward functions saw them
    completions: list
    extra_columns: dict[str, list]  # the reward functions' log_extra columns
    tools: ToolCounts | None  # with tools, each row's calls, failures and turns

    def on_cpu(self) -> SampledRows:
        """These rows with the rollout's tensors in host memory (to pickle them for another rank)."""
        tensors = {key: value.cpu() for key, value in vars(self.rollout).items() if isinstance(value, torch.Tensor)}
        return dataclasses.replace(self, rollout=dataclasses.replace(self.rollout, **tensors))


@dataclass
class GenerationBatch:
    """A scored generation batch: this rank's rows, every rank's scores, and the judged groups."""
    rows: SampledRows
    rewards: torch.Tensor  # R [N, F], every rank's rows
    accuracy: torch.Tensor  # [N]: the task's accuracy, NaN where it cannot score
    logged: dict[str, float]  # the reward functions' log_metric means
    varied: torch.Tensor  # [N / G] bool: the groups whose judged rewards differ


@dataclass
class KeptRound:
    """The round dynamic sampling trains on: this rank's n rows of it, and every rank's scores."""
    rollout: Rollout
    tools: ToolCounts | None
    prompts: list
    completions: list
    extra_columns: dict[str, list]
    rewards: torch.Tensor  # R [N, F]
    accuracy: torch.Tensor  # [N]
    logged: dict[str, float]  # each generation batch's log_metric means, averaged over the batches


def take_rows(rows: list[tuple[Rollout, int]], pad_token_id: int) -> Rollout:
    """One Rollout of `rows`, each (a rollout, a row of it), in that order, right-padded to the
    longest (as the engine pads: `pad_token_id`, mask 0, log-prob 0, tool mask 1). The rollouts
    must agree on whether they have full_logprobs and a tool_mask (they do when sampled alike)."""
    width = max(int(rollout.lengths[i]) for rollout, i in rows)

    def stack(field: str, pad: float) -> torch.Tensor | None:
        if getattr(rows[0][0], field) is None:
            return None
        picked = [getattr(rollout, field)[i, :width] for rollout, i in rows]
        out = picked[0].new_full((len(picked), width), pad)
        for k, row in enumerate(picked):
            out[k, :len(row)] = row
        return out

    return Rollout(prompt_ids=[rollout.prompt_ids[i] for rollout, i in rows],
                   completion_ids=stack("completion_ids", pad_token_id), completion_mask=stack("completion_mask", 0),
                   lengths=torch.stack([rollout.lengths[i] for rollout, i in rows]),
                   truncated=torch.stack([rollout.truncated[i] for rollout, i in rows]),
                   sampling_logprobs=stack("sampling_logprobs", 0.0), full_logprobs=stack("full_logprobs", 0.0),
                   tool_mask=stack("tool_mask", 1))


class GenerationBatches:
    """A round's generation batches under dynamic sampling, judged as they come (`add`)."""

    def __init__(self, groups: int, num_generations: int, max_batches: int, weights: list[float] | None,
                 judged_column: int | None):
        """`groups`: N/G, the groups a round trains on (the prompts of one generation batch);
        `max_batches`: rollout.max_num_gen_batches (0: no cap); `weights`: the reward weights (None:
        all 1); `judged_column`: the column of R that the filter judges (rollout.filter_groups_metric's
        place in loss.reward_funcs), None for the weighted total."""
        self.groups, self.G, self.max_batches = groups, num_generations, max_batches
        self.weights, self.judged_column = weights, judged_column
        self.batches: list[GenerationBatch] = []

    def add(self, rollout: Rollout, turns: ToolTurns | None, scores) -> None:
        """Judge a generation batch: its `rollout` and tool `turns` (this rank's rows) and `scores`
        (train.RoundScores, every rank's rewards). A group is kept when two of its valid judged
        rewards differ; NaN (unscored) takes no part."""
        R = scores.rewards
        if self.judged_column is None:  # in float64, as compute_advantages judges frac_reward_zero_std
            weights = torch.tensor(self.weights or [1.0] * R.shape[1], dtype=torch.float64, device=R.device)
            judged = weighted_rewards(R.double(), weights)
        else:
            judged = R[:, self.judged_column].double()
        tools = None if turns is None else ToolCounts(turns.calls, turns.failures, turns.turns)
        rows = SampledRows(rollout, scores.prompts, scores.completions, scores.extra_columns, tools)
        self.batches.append(GenerationBatch(rows, R, scores.accuracy, scores.logged, varied_groups(judged, self.G)))

    @property
    def kept(self) -> int:
        """Groups kept so far, beyond N/G too."""
        return sum(int(batch.varied.sum()) for batch in self.batches)

    def full(self) -> bool:
        """Whether the round has its N/G kept groups, or the cap's generation batches."""
        return self.kept >= self.groups or 0 < self.max_batches <= len(self.batches)

    def metrics(self) -> dict[str, int]:
        """The round's dynamic_sampling/* metrics (docs/loop.md)."""
        return {"dynamic_sampling/gen_batches": len(self.batches),
                "dynamic_sampling/groups_sampled": len(self.batches) * self.groups,
                "dynamic_sampling/groups_kept": self.kept}

    def take(self, rank: int, n: int, world: int, pad_token_id: int) -> KeptRound:
        """The round's N/G groups: the kept ones, first sampled first, then, short of N/G at the cap,
        dropped ones, first sampled first (those train as without the filter). Rank `rank` holds
        rows [rank * n, (rank + 1) * n) of them, most sampled on other ranks under torchrun: one
        all-gather of every rank's batches moves them (the round's completions times `world`, in
        host memory)."""
        G = self.G
        kept = [(b, g) for b, batch in enumerate(self.batches) for g in batch.varied.nonzero()[:, 0].tolist()]
        dropped = [(b, g) for b, batch in enumerate(self.batches) for g in (~batch.varied).nonzero()[:, 0].tolist()]
        groups = (kept + dropped)[:self.groups] if len(kept) < self.groups else kept[:self.groups]
        rows = [(b, g * G + j) for b, g in groups for j in range(G)]  # (batch, row of the batch)
        every = collectives.gather_objects([batch.rows if world == 1 else batch.rows.on_cpu()
                                            for batch in self.batches], world)  # every[rank][batch]
        mine = [(every[i // n][b], i % n) for b, i in rows[rank * n:(rank + 1) * n]]  # (SampledRows, its row)
        rollout = take_rows([(part.rollout, i) for part, i in mine], pad_token_id)
        columns = dict.fromkeys(column for part, _ in mine for column in part.extra_columns)
        extra = {column: [part.extra_columns[column][i] if column in part.extra_columns else None
                          for part, i in mine] for column in columns}  # None where a batch had no such column
        tools = None if mine[0][0].tools is None else ToolCounts(
            *([getattr(part.tools, count)[i] for part, i in mine] for count in ("calls", "failures", "turns")))
        rewards = torch.cat([self.batches[b].rewards[g * G:(g + 1) * G] for b, g in groups])
        accuracy = torch.cat([self.batches[b].accuracy[g * G:(g + 1) * G] for b, g in groups])
        logged = defaultdict(list)
        for batch in self.batches:
            for key, value in batch.logged.items():
                logged[key].append(value)
        return KeptRound(rollout, tools, [part.prompts[i] for part, i in mine], [part.completions[i] for part, i in mine],
                         extra, rewards, accuracy, {key: sum(v) / len(v) for key, v in logged.items()})
