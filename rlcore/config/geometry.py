"""The batch geometry of SPEC section 1: how a generation round is cut into micro-batches and
optimizer steps, from the config and the rank count.

A round samples G completions for each of its prompts, b * S of them on each of the `world`
ranks; each rank cuts its share into S micro-batches of b completions, takes an optimizer step
every GA of them, and replays the round mu times. rlcore/validation.py checks that these fit
(whole groups of G, whole optimizer steps per pass) on the same `Geometry` the loop runs.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from rlcore import ConfigError

if typing.TYPE_CHECKING:
    from rlcore.config.options import Config, TrainArgs


def generation_steps(train: TrainArgs, world_size: int) -> int:
    """S, micro-batches per generation round on each rank: train.steps_per_generation, or else
    train.generation_batch_size / (per_device_train_batch_size * world_size), as TRL resolves it."""
    if train.steps_per_generation is not None:
        return train.steps_per_generation
    return train.generation_batch_size // max(1, train.per_device_train_batch_size * world_size)


def epoch_steps(num_prompts: int, prompts_per_round: int, steps_per_round: int, epochs: float) -> int:
    """Optimizer steps for `epochs` passes over `num_prompts` training prompts, counted as TRL does:
    ceil(epochs * whole rounds per pass * optimizer steps per round)."""
    rounds = num_prompts // prompts_per_round
    if rounds == 0:
        raise ConfigError(f"train.num_train_epochs: the {num_prompts} training prompts are fewer than one round's "
                          f"{prompts_per_round} (per_device_train_batch_size * steps_per_generation * world size / "
                          f"num_generations); add prompts or set train.max_steps")
    return max(1, math.ceil(epochs * rounds * steps_per_round))


@dataclass(frozen=True)
class Geometry:
    """One run's batch geometry, in SPEC section 1's letters."""

    G: int
    """completions per prompt (rollout.num_generations)"""
    b: int
    """completions per micro-batch on each rank (train.per_device_train_batch_size)"""
    GA: int
    """micro-batches per optimizer step (train.gradient_accumulation_steps)"""
    S: int
    """micro-batches per round on each rank (train.steps_per_generation, or from generation_batch_size)"""
    mu: int
    """passes over each round (loss.num_iterations)"""
    world: int
    """data-parallel ranks (SPEC's P)"""
    max_steps: int
    """optimizer steps the run takes: train.max_steps, or for -1 those of num_train_epochs passes
    over the training prompts (-1 while they are not counted)"""
    staleness: int = 0
    """rounds sampled ahead of the trainer, from older weights (rollout.max_staleness)"""

    @classmethod
    def of(cls, config: Config, world: int, num_train_prompts: int | None = None) -> Geometry:
        """`config`'s geometry on `world` ranks; given `num_train_prompts`, train.max_steps = -1 (TRL's
        "count the epochs") becomes that count (epoch_steps), which raises when a pass is not one round."""
        train = config.train
        geometry = cls(G=config.rollout.num_generations, b=train.per_device_train_batch_size,
                       GA=train.gradient_accumulation_steps, S=generation_steps(train, world),
                       mu=config.loss.num_iterations, world=world, max_steps=train.max_steps,
                       staleness=config.rollout.max_staleness)
        if train.max_steps > 0 or num_train_prompts is None:
            return geometry
        return dataclasses.replace(geometry, max_steps=epoch_steps(
            num_train_prompts, geometry.prompts_per_round, geometry.steps_per_round, train.num_train_epochs))

    @property
    def completions_per_rank(self) -> int:
        """n = b * S: a rank's rows of a round, rows [rank * n, (rank + 1) * n)."""
        return self.b * self.S

    @property
    def completions_per_round(self) -> int:
        """N = n * world: a round's completions over all ranks."""
        return self.completions_per_rank * self.world

    @property
    def prompts_per_round(self) -> int:
        return self.completions_per_round // self.G

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps per round: S * mu / GA (validation makes S a multiple of GA)."""
        return self.S * self.mu // self.GA

    @property
    def off_policy(self) -> bool:
        """After a round's first optimizer step the policy has moved, so its later steps train on
        samples from an older policy: the old log-probs need a pass of their own. A round sampled
        ahead (staleness > 0) is off-policy from its first step."""
        return self.mu > 1 or self.S > self.GA or self.staleness > 0
