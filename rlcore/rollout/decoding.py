"""The decoding state of a rollout, from its start to the `Rollout` it returns.

    Batch           the rows a stretch of decoding steps runs on, updated in place by every step
    Decoding        what every step of the rollout reads, and the outputs it writes, by global row
    start_decoding  both, before token 0: all N rows at their prompts' ends, the outputs empty
    compact         a smaller batch of the unfinished rows (and padding rows up to a bucket size)
    collect_rollout the outputs as a `Rollout`, the engine's result (prompt-major rows)

rlcore.rollout.engine runs the steps; this module holds what they run on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.models.transformer import KVCache, Transformer
from rlcore.rollout.sampling import reports_full_logprobs, sampling_key


@dataclass
class Rollout:
    """N = len(prompts) * G rows, prompt-major: the G samples of a prompt are contiguous.

    T = the longest completion (at most max_new_tokens); rows are right-padded to it.
    """

    prompt_ids: list[list[int]]       # the prompt of each row, N lists
    completion_ids: torch.Tensor      # [N, T] long, pad_token_id after the end
    completion_mask: torch.Tensor     # [N, T] long, 1 up to and including EOS / the stop sequence
    lengths: torch.Tensor             # [N] long, completion_mask.sum(1)
    truncated: torch.Tensor           # [N] bool, hit max_new_tokens without EOS / stop sequence
    sampling_logprobs: torch.Tensor   # [N, T] fp32, log-prob under the distribution sampled from
    full_logprobs: torch.Tensor | None  # [N, T] fp32, under the full distribution; only with a filter
    tool_mask: torch.Tensor | None = None  # [N, T] long, 0 on ids appended after a turn; only with end_of_turn


@dataclass
class Batch:
    """The rows a stretch of decoding steps runs on. Every tensor keeps its shape for the stretch
    and each step updates it in place (a CUDA graph replays on fixed addresses). Finished rows
    stay, masked; padding rows (global row N, a scratch row of the outputs) fill a bucket."""

    cache: KVCache             # [L, B, H_kv, slots, D], slots = T + max_new_tokens - 1
    rows: torch.Tensor         # [B] long, each row's global row
    tokens: torch.Tensor       # [B] long, the token sampled last, fed next
    positions: torch.Tensor    # [B] long, its RoPE position
    start: torch.Tensor        # [B] long, the row's first real slot (left padding before it)
    step: torch.Tensor         # [] long, the completion index of `tokens`, the same for every row
    done: torch.Tensor         # [B] bool, stopped (or padding)
    recent: torch.Tensor       # [B, W] long, the row's last W tokens, for stop sequences
    seen: torch.Tensor | None  # [B, V] bool, the tokens in each row, for the repetition penalty


@dataclass
class Decoding:
    """What every step of one rollout reads and does not change, and the outputs it writes
    (`[N + 1, max_new_tokens]`, by global row; row N takes the padding rows' writes)."""

    prompt_width: int          # T: token t of every completion is fed at slot T + t
    head: torch.Tensor         # [V, H] the output projection in the rollout's dtype
    key: torch.Tensor          # [2] long, the sampling key (sampling.uniforms)
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    eos: torch.Tensor          # [E] long
    stops: list[torch.Tensor]  # stop sequences
    pad: int
    completion: torch.Tensor   # long, pad after the end
    written: torch.Tensor      # bool: the completion mask
    sampling_logprobs: torch.Tensor
    full_logprobs: torch.Tensor | None
    stopped: torch.Tensor      # [N + 1] bool
    forced: torch.Tensor | None = None  # [N + 1, max_new_tokens] long: an id appended after a turn, else -1


def prompt_tokens_seen(distinct: list[list[int]], which: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[N, V]` bool: the tokens of each row's prompt, where the repetition penalty starts from."""
    seen = torch.zeros(len(distinct), vocab_size, dtype=torch.bool, device=which.device)
    for i, p in enumerate(distinct):
        seen[i, torch.tensor(p, device=which.device)] = True
    return seen[which]


def start_decoding(model: Transformer, cache: KVCache, distinct: list[list[int]], which: torch.Tensor,
                   max_new_tokens: int, dtype: torch.dtype, *, temperature: float, top_k: int, top_p: float,
                   min_p: float, repetition_penalty: float, eos_token_ids: list[int], stop_sequences: list[list[int]],
                   pad_token_id: int, generator: torch.Generator | None, multi_turn: bool) -> tuple[Batch, Decoding]:
    """The state before token 0: a `Batch` of all N rows (`cache` from `prefill_rows`, every row at
    its prompt's end, none done) and the rollout's `Decoding`, its outputs `[N + 1, max_new_tokens]`
    empty. A sampled rollout draws its sampling key from `generator` here."""
    device, N = cache.k.device, len(which)
    long = dict(dtype=torch.long, device=device)
    T = max(len(p) for p in distinct)  # the prefill's width: prompts are left-padded to it
    prompt_len = torch.tensor([len(p) for p in distinct], device=device)[which]
    seen = prompt_tokens_seen(distinct, which, model.lm_head_weight.shape[0]) if repetition_penalty != 1.0 else None
    longest_stop = max([1] + [len(s) for s in stop_sequences])
    batch = Batch(cache, rows=torch.arange(N, **long), tokens=torch.zeros(N, **long), positions=prompt_len.clone(),
                  start=T - prompt_len, step=torch.zeros((), **long),
                  done=torch.zeros(N, dtype=torch.bool, device=device),
                  recent=torch.full((N, longest_stop), -1, **long), seen=seen)
    outputs = torch.full((N + 1, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    full = reports_full_logprobs(temperature, top_k, top_p, min_p, repetition_penalty)
    decoding = Decoding(
        prompt_width=T, head=model.lm_head_weight.to(dtype),
        key=sampling_key(generator, device) if temperature > 0 else torch.zeros(2, **long),  # greedy draws nothing
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        eos=torch.tensor(list(eos_token_ids), **long), stops=[torch.tensor(s, **long) for s in stop_sequences],
        pad=pad_token_id,
        completion=outputs, written=torch.zeros_like(outputs, dtype=torch.bool),
        sampling_logprobs=torch.zeros_like(outputs, dtype=torch.float32),
        full_logprobs=torch.zeros_like(outputs, dtype=torch.float32) if full else None,
        stopped=torch.zeros(N + 1, dtype=torch.bool, device=device),
        forced=torch.full_like(outputs, -1) if multi_turn else None)
    return batch, decoding


def compact(batch: Batch, size: int, filled: int, model: Transformer, scratch_row: int) -> Batch:
    """A batch of `size` rows: the unfinished rows of `batch`, then padding rows (done, writing to
    `scratch_row`). Copies the cache's `filled` slots, about the cost of one decoding step."""
    keep = (~batch.done).nonzero()[:, 0]
    extra = size - len(keep)

    def take(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat((x[keep], x.new_full((extra, *x.shape[1:]), fill)))

    k, v = batch.cache.k, batch.cache.v
    cache = KVCache.empty(model.config, size, k.shape[3], k.dtype, k.device)
    cache.k[:, :len(keep), :, :filled] = k[:, keep, :, :filled]
    cache.v[:, :len(keep), :, :filled] = v[:, keep, :, :filled]
    return Batch(cache, take(batch.rows, scratch_row), take(batch.tokens, 0), take(batch.positions, 0),
                 take(batch.start, 0), batch.step.clone(), take(batch.done, True), take(batch.recent, -1),
                 None if batch.seen is None else take(batch.seen, False))


def collect_rollout(decoding: Decoding, prompts: list[list[int]], G: int) -> Rollout:
    """The outputs as a `Rollout`: the N = len(prompts) * G real rows (not the scratch row N), cut to
    the longest completion."""
    N = len(prompts) * G
    lengths = decoding.written[:N].sum(1)
    width = int(lengths.max())
    return Rollout(
        prompt_ids=[list(p) for p in prompts for _ in range(G)],
        completion_ids=decoding.completion[:N, :width].contiguous(),
        completion_mask=decoding.written[:N, :width].long(),
        lengths=lengths,
        truncated=~decoding.stopped[:N],
        sampling_logprobs=decoding.sampling_logprobs[:N, :width].contiguous(),
        full_logprobs=None if decoding.full_logprobs is None else decoding.full_logprobs[:N, :width].contiguous(),
        tool_mask=None if decoding.forced is None else (decoding.forced[:N, :width] < 0).long(),
    )
