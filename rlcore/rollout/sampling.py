"""Next-token sampling: repetition penalty, temperature, top-k, top-p, min-p, greedy, with log-probs.

Processors apply in transformers' order, each to the distribution left by the one before:
the repetition penalty, then temperature, then top-k, then top-p (nucleus), then min-p. A
filtered-out token gets logit -inf, so the kept tokens are renormalised.

The repetition penalty (transformers' `RepetitionPenaltyLogitsProcessor`, TRL's and vLLM's
`repetition_penalty`) changes the raw logit of every token already in the row (its prompt and
its completion so far): a positive logit is divided by the penalty, a negative one multiplied,
so a penalty > 1 makes repeats less likely and < 1 more likely.

Two log-probs come back per token (SPEC section 4, item 3):
- `sampling_logprobs`: under the distribution actually sampled from (after the penalty and
  the filters);
- `full_logprobs`: under the full temperature-scaled distribution, which is what the trainer
  computes, only when the penalty or a filter is active (otherwise the two are equal and it
  is None).
Greedy decoding (temperature 0) has no temperature to scale by; it reports the log-prob of
the argmax under the unscaled (temperature 1) distribution.
"""

from __future__ import annotations

import torch


def filters_active(top_k: int, top_p: float, min_p: float) -> bool:
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def check_sampling_args(temperature: float, top_k: int, top_p: float, min_p: float,
                        repetition_penalty: float = 1.0) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeats), got {repetition_penalty}")


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Logits `[B, V]` with the repetition penalty applied to the tokens marked in `seen` `[B, V]`
    (bool): a positive logit divided by `penalty`, a negative one multiplied (a new tensor)."""
    hit = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, hit, logits)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> torch.Tensor:
    """Logits `[B, V]` with tokens outside top-k / top-p / min-p set to -inf (a new tensor).

    top_k keeps the k largest (ties at the k-th value are all kept); top_p keeps the smallest
    set of most likely tokens whose probability reaches top_p; min_p keeps tokens whose
    probability is at least min_p times the most likely one's. The argmax always survives.
    """
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        # transformers' formulation: drop the tokens whose mass summed from the bottom is <= 1 - top_p
        # (small-to-large is the accurate order, and ties break as there); the sort costs O(V log V) a row.
        sorted_logits, order = torch.sort(logits, dim=-1)
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        logits.masked_fill_(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = min_p * probs.max(-1, keepdim=True).values
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


def draw(logits: torch.Tensor, generator: torch.Generator | None = None):
    """One token per row of logits `[B, V]` (-inf = excluded), and its log-prob `[B]`.

    Inverse CDF: one uniform per row, searched in the running sum of exp(logits - max).
    One cumsum and one search per row: on CPU far cheaper than `torch.multinomial` at a large
    vocabulary. Exact up to fp32 granularity (the uniform is a multiple of 2^-24, the running
    sum fp32): within ~4e-4 total variation of the softmax at V = 32000, with tokens far below
    2^-24 drawn too rarely; the returned log-prob is exact.
    """
    top = logits.amax(-1, keepdim=True)
    z = (logits - top).exp_()
    log_total = z.sum(-1, keepdim=True).log_()  # summed apart from cdf: the accurate normaliser
    cdf = z.cumsum_(-1)
    u = torch.rand(top.shape, generator=generator, device=logits.device) * cdf[:, -1:]
    # u < cdf[-1] strictly, so the first slot with cdf > u exists and has probability > 0.
    u = torch.minimum(u, cdf[:, -1:].nextafter(torch.zeros_like(u)))
    tokens = torch.searchsorted(cdf, u, right=True)
    return tokens[:, 0], (logits.gather(-1, tokens) - top - log_total)[:, 0]


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, generator: torch.Generator | None = None,
           repetition_penalty: float = 1.0, seen: torch.Tensor | None = None):
    """Draw one token per row from fp32 logits `[B, V]`; `seen` `[B, V]` (bool) marks the tokens
    already in each row, which `repetition_penalty` (1.0 = off) applies to.

    Returns tokens `[B]` (long), sampling_logprobs `[B]` and full_logprobs `[B]` or None
    (see the module docstring).
    """
    raw = logits
    penalized = repetition_penalty != 1.0 and seen is not None
    if penalized:
        logits = penalize(logits, seen, repetition_penalty)
    if temperature == 0.0:
        tokens = logits.argmax(-1)[:, None]
        logprobs = logits.log_softmax(-1).gather(-1, tokens)[:, 0]
        full = raw.log_softmax(-1).gather(-1, tokens)[:, 0] if penalized else None
        return tokens[:, 0], logprobs, full
    scaled = logits / temperature if temperature != 1.0 else logits
    if not penalized and not filters_active(top_k, top_p, min_p):
        tokens, logprobs = draw(scaled, generator)
        return tokens, logprobs, None
    if filters_active(top_k, top_p, min_p):
        scaled = filter_logits(scaled, top_k, top_p, min_p)
    tokens, logprobs = draw(scaled, generator)
    raw_scaled = raw / temperature if temperature != 1.0 else raw
    full = raw_scaled.gather(-1, tokens[:, None])[:, 0] - raw_scaled.logsumexp(-1)
    return tokens, logprobs, full
