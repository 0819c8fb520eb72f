"""The entropy bonus, TRL's `entropy_coef`: L = L_policy - coef * H.

H is the micro-batch's mean token entropy of the current policy over the tokens the policy loss
trains on (the completion mask, times the entropy mask when top_entropy_quantile < 1), divided
by the gradient accumulation steps only. It is not rescaled per loss_type, so a coefficient
means the same for every one (TRL 1.16's definition); averaging gradients over data-parallel
ranks averages it over ranks. A positive coefficient rewards spread-out next-token
distributions (exploration), a negative one penalises them.

Adaptive control (Skywork-OR1, arXiv:2505.22312; TRL's `use_adaptive_entropy`): after every
optimizer step the coefficient moves by `delta` towards keeping the step's entropy (token mean
over all its micro-batches and ranks) above `target`: up when the entropy is at or below it,
down otherwise, within [coef_min, coef_max]. The bonus applies only while the previous step's entropy is at
or below the target (none before the first measurement).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor


def mean_entropy(entropy: Tensor, on: Tensor, gradient_accumulation_steps: int) -> Tensor:
    """sum(H * on) / max(sum(on), 1) / GA: the micro-batch's share of the step's bonus term."""
    on = on.to(entropy.dtype)
    return (entropy * on).sum() / on.sum().clamp(min=1.0) / gradient_accumulation_steps


class EntropyBonus:
    """The coefficient and, with adaptive control, its state across steps (saved for --resume)."""

    def __init__(self, coef: float, adaptive: bool = False, target: float = 0.2, delta: float = 0.005,
                 coef_min: float = 0.0, coef_max: float = 1.0):
        self.coef, self.adaptive = coef, adaptive
        self.target, self.delta, self.coef_min, self.coef_max = target, delta, coef_min, coef_max
        self.last_entropy = math.inf  # no bonus until a step has measured the entropy
        self.window = [0.0, 0.0]      # this step's sum of H * on, and of on, on this rank

    @property
    def enabled(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient this optimizer step uses: fixed for all its micro-batches."""
        if self.adaptive and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def term(self, entropy: Tensor, on: Tensor, gradient_accumulation_steps: int) -> Tensor | float:
        """What one micro-batch subtracts from its loss; records its entropy for adaptive control
        (on the device: end_step reads it once per step)."""
        if self.adaptive:
            self.window[0] = self.window[0] + (entropy.detach() * on).sum().double()
            self.window[1] = self.window[1] + on.sum().double()
        coef = self.applied()
        return coef * mean_entropy(entropy, on, gradient_accumulation_steps) if coef else 0.0

    def end_step(self, sum_over_ranks: Callable[[list[float]], list[float]] | None = None) -> None:
        """After an optimizer step: adapt the coefficient to the step's entropy, over all ranks when
        `sum_over_ranks` sums each number over them (`distributed.sum_over_ranks`); None: this rank's."""
        if not self.adaptive:
            return
        window = [float(x) for x in self.window]
        total, count = window if sum_over_ranks is None else sum_over_ranks(window)
        self.window = [0.0, 0.0]
        self.last_entropy = total / max(count, 1.0)
        if self.last_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
