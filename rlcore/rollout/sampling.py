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

Randomness: one uniform per row and step, a hash of (the rollout's key, the row's global index,
the step) computed on the device (`uniforms`), so a row's draws do not depend on which other rows
share its batch, and a decoding step needs no generator state of its own.
"""

from __future__ import annotations

import torch


def filters_active(top_k: int, top_p: float, min_p: float) -> bool:
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def reports_full_logprobs(temperature: float, top_k: int, top_p: float, min_p: float,
                          repetition_penalty: float) -> bool:
    """Whether `sample` returns full_logprobs (with `seen` given when the penalty is on)."""
    return repetition_penalty != 1.0 or (temperature != 0.0 and filters_active(top_k, top_p, min_p))


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


def sampling_key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Two 31-bit words `[2]` (long, on `device`) drawn from `generator` (the default generator of
    `device` when None): the key of one rollout's `uniforms`. One draw per rollout, so a generator
    seeded alike gives the same rollouts, and its saved state resumes them."""
    where = generator.device if generator is not None else device
    return torch.randint(2**31 - 1, (2,), generator=generator, device=where).to(device)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values held in int64 `x` (Mueller's integer hash): every product of a
    value < 2^32 and the constant < 2^31 fits in int64, so no platform's overflow rules enter."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def uniforms(key: torch.Tensor, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row `[B]`, a pure function of (key, global row, step): multiples of
    2^-24, as CPU torch.rand draws them. Nothing about the batch enters, so dropping finished rows,
    masking them or padding the batch cannot change any row's draws (a counter-based generator,
    like the Philox streams behind torch.rand on CUDA)."""
    h = mix32(mix32(mix32(key[0] ^ rows) ^ step) ^ key[1])
    return (h >> 8).float() * 2.0**-24


def draw(logits: torch.Tensor, uniforms: torch.Tensor):
    """`K` tokens per row of logits `[B, V]` (-inf = excluded), one per uniform of `uniforms`
    `[B, K]`, and their log-probs `[B, K]`.

    Inverse CDF: each uniform searched in the running sum of exp(logits - max).
    One cumsum and one search per row: on CPU far cheaper than `torch.multinomial` at a large
    vocabulary. Exact up to fp32 granularity (the uniforms are multiples of 2^-24, the running
    sum fp32): within ~4e-4 total variation of the softmax at V = 32000, with tokens far below
    2^-24 drawn too rarely; the returned log-prob is exact.
    """
    top = logits.amax(-1, keepdim=True)
    z = (logits - top).exp_()
    log_total = z.sum(-1, keepdim=True).log_()  # summed apart from cdf: the accurate normaliser
    cdf = z.cumsum_(-1)
    u = uniforms * cdf[:, -1:]
    # u < cdf[-1] strictly, so the first slot with cdf > u exists and has probability > 0.
    u = torch.minimum(u, cdf[:, -1:].nextafter(torch.zeros_like(cdf[:, -1:])))
    tokens = torch.searchsorted(cdf, u, right=True)
    return tokens, logits.gather(-1, tokens) - top - log_total


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, uniforms: torch.Tensor | None = None,
           repetition_penalty: float = 1.0, seen: torch.Tensor | None = None):
    """Draw one token per row from fp32 logits `[B, V]` with one uniform per row `[B]` (see
    `uniforms`; unused and may be None when greedy); `seen` `[B, V]` (bool) marks the tokens
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
        tokens, logprobs = draw(scaled, uniforms[:, None])
        return tokens[:, 0], logprobs[:, 0], None
    if filters_active(top_k, top_p, min_p):
        scaled = filter_logits(scaled, top_k, top_p, min_p)
    tokens, logprobs = draw(scaled, uniforms[:, None])
    raw_scaled = raw / temperature if temperature != 1.0 else raw
    full = raw_scaled.gather(-1, tokens)[:, 0] - raw_scaled.logsumexp(-1)
    return tokens[:, 0], logprobs[:, 0], full
