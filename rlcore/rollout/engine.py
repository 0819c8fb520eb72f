"""The rollout engine: G sampled completions per prompt in one batched, cached decoding run.

`generate` is the driver; the stages it calls, in order:

    prefill_rows       `prefill` each distinct prompt once, left-padded so every prompt ends at
                       slot T-1, then copy its keys/values to its G rows of the static cache
    start_decoding     the `Batch` of all N rows and the rollout's `Decoding` (decoding.py)
    sample_and_record  token 0 from the prefill's logits (and every later token: sample it,
                       write it to the outputs, mark the rows it stops)
    step_function      the step for a batch: `packed_step` (PackedDecoder, packed.py) on CPU;
                       elsewhere `static_step`, `decode_one_token` with fixed shapes, its state in
                       device tensors updated in place and no host sync, which graphs.py captures
                       in a CUDA graph per batch size
    (the loop)         stretches of CHECK_EVERY steps, each ended by one host sync that stops the
                       loop or `compact`s the batch to `compacted_size`, with a new step for it
    continue_turns     multi-turn only (multi_turn.py): after a step, append ids (tool results, the next
                       assistant header) to the rows whose turn just ended; the steps feed them as
                       forced tokens
    collect_rollout    the outputs as a `Rollout` (decoding.py)

Cache layout: plain tensors `[L, B, H_kv, T + max_new_tokens - 1, D]`. Prompts are left-padded
to T, so completion token t of every row is fed at the same slot T + t; a row's RoPE positions
count only its real tokens (a short prompt gets the positions it would have unpadded). Row b
attends over its slots start[b] .. T + t (attention.py): the padding before start[b] and the
slots not yet written stay out. Finished rows stay in the batch, masked, until the next check
drops them (on GPU, down to a power-of-two batch size, whose graph is captured once).

Sampling noise is a pure function of (a key drawn from `generator`, global row, step)
(sampling.uniforms), so masking, dropping or padding rows changes no row's tokens.

Multi-turn rows (`end_of_turn`): the ids appended after a turn take the row's next completion
slots, one per step, in place of the token the step samples (log-prob 0, tool mask 0). Feeding
them through the same step writes their keys/values into the cache like any token's: the cache
grows by the new tokens only, the conversation is never prefilled again, and the other rows
decode meanwhile. A row's sampling noise stays (key, row, step), so rows that call no tool get
the tokens they get without `end_of_turn`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlcore.models.lora import LoraLinear
from rlcore.models.transformer import KVCache, Transformer, apply_rope, padded_causal_mask, rope_cos_sin
from rlcore.rollout.attention import decode_attention
from rlcore.rollout.graphs import CapturedStep
from rlcore.rollout.packed import PackedDecoder
from rlcore.rollout.sampling import check_sampling_args, sample, uniforms
from rlcore.rollout.decoding import Batch, Decoding, Rollout, collect_rollout, compact, start_decoding
from rlcore.rollout.multi_turn import EndOfTurn, continue_turns

CHECK_EVERY = 8         # steps between "are all rows done?" checks (each one is a host sync)
COMPACT_FRACTION = 8    # compact when at least 1/COMPACT_FRACTION of the batch has finished


def use_packed_decoder(device: torch.device) -> bool:
    """Decode with `PackedDecoder` (weights laid out once per rollout) on CPU, where a step's
    small matmuls pay for re-blocking the weights on every call; the static step elsewhere."""
    return device.type == "cpu"


def prefill(model: Transformer, prompts: list[list[int]],
            dtype: torch.dtype | None = None) -> tuple[KVCache, torch.Tensor]:
    """Run the prompts once as one left-padded batch, under autocast to `dtype` when that is
    not the model's dtype.

    Returns a cache `[L, P, H_kv, T, D]` in `dtype` (T = longest prompt; slots of padding hold
    garbage and stay masked) and fp32 logits `[P, V]` for the first completion token.
    """
    device = model.inv_freq.device
    dtype = dtype or model.lm_head_weight.dtype
    P, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(P, T, dtype=torch.long)
    real = torch.zeros(P, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        real[i, T - len(p):] = 1
    ids, real = ids.to(device), real.to(device)
    mask, positions = padded_causal_mask(real)
    cache = KVCache.empty(model.config, P, T, dtype, device)
    slots = torch.arange(T, device=device).expand(P, T)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != model.lm_head_weight.dtype):
        h = model(ids, positions, mask, cache, slots)
        return cache, (h[:, -1] @ model.lm_head_weight.T).float()


def decoding_attention(device: torch.device):
    """The attention kernels a decoding step may use: on CUDA, not cuDNN's. PyTorch picks cuDNN
    first for bf16 on recent GPUs, and it plans every new shape on the CPU; decoding lengthens the
    keys every step, so every layer of every step would pay that planning."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def matmul_weights_in(model: Transformer, dtype: torch.dtype):
    """Put `dtype` copies of the decoder layers' linear weights and biases in their modules' places
    inside the block, and the modules' own parameters back after it (also on error). Autocast to
    `dtype` casts exactly these at each call, so the results are the same (the lm_head's weight,
    also the embedding when tied, is left to autocast). On a GPU a decoding step is bound by kernel
    launches, so a cast per call and step costs more than one cast per rollout. A LoRA layer gives
    way to a plain linear holding its merged weight W + s*B@A, so decoding costs what it costs
    without adapters. Costs a `dtype` copy of those weights while the block runs. The parameters
    themselves are not touched (a dtype change through `.data` would drop their gradient hooks)."""
    layers = model.model.layers
    swapped = []  # (parent, leaf name, own module, its copy)
    for name, m in layers.named_modules():
        parent_name, _, leaf = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        if isinstance(m, LoraLinear) or (isinstance(m, torch.nn.Linear) and not isinstance(parent, LoraLinear)):
            copy = torch.nn.Linear(m.weight.shape[1], m.weight.shape[0], bias=m.bias is not None, device="meta")
            copy.weight = torch.nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
            if m.bias is not None:
                copy.bias = torch.nn.Parameter(m.bias.detach().to(dtype), requires_grad=False)
            swapped.append((parent, leaf, m, copy))
    try:
        for parent, leaf, _, copy in swapped:
            setattr(parent, leaf, copy)
        yield
    finally:
        for parent, leaf, m, _ in swapped:
            setattr(parent, leaf, m)


def stop_hits(recent: torch.Tensor, eos: torch.Tensor,
              stop_sequences: list[torch.Tensor]) -> torch.Tensor:
    """Rows `[B]` whose completion, ending in `recent` `[B, W]`, ends in EOS or a stop sequence
    (W >= the longest stop sequence; -1 fills `recent` before a row's first token)."""
    hit = (recent[:, -1:] == eos).any(-1)
    for seq in stop_sequences:
        hit |= (recent[:, -len(seq):] == seq).all(-1)
    return hit


def sample_and_record(logits: torch.Tensor, batch: Batch, decoding: Decoding) -> None:
    """Sample token `batch.step` of every row from fp32 logits `[B, V]`, write it to the outputs
    and update the batch: tokens, done, recent, seen. Finished rows get pad, written as not real."""
    draws = uniforms(decoding.key, batch.rows, batch.step)  # one per row, a function of (key, row, step)
    token, logprob, full_logprob = sample(logits, decoding.temperature, decoding.top_k, decoding.top_p,
                                          decoding.min_p, draws, decoding.repetition_penalty, batch.seen)
    token = token.masked_fill(batch.done, decoding.pad)
    where = (batch.rows, batch.step.expand_as(batch.rows))  # each row's cell of the outputs
    if decoding.forced is not None:  # an appended id replaces the sample: the model did not choose it
        forced = decoding.forced[where]
        appended = forced >= 0
        token = torch.where(appended, forced, token)
        logprob = logprob.masked_fill(appended, 0.0)
        full_logprob = None if full_logprob is None else full_logprob.masked_fill(appended, 0.0)
    decoding.completion.index_put_(where, token)
    decoding.written.index_put_(where, ~batch.done)
    decoding.sampling_logprobs.index_put_(where, logprob.masked_fill(batch.done, 0.0))
    if decoding.full_logprobs is not None:
        decoding.full_logprobs.index_put_(where, full_logprob.masked_fill(batch.done, 0.0))
    if batch.seen is not None:
        batch.seen.scatter_(1, token[:, None], True)
    batch.recent.copy_(torch.cat((batch.recent[:, 1:], token[:, None]), 1))
    if decoding.forced is not None:  # appended ids never stop a row, nor start a stop sequence of the next turn
        batch.recent.masked_fill_(appended[:, None], -1)
    batch.done |= stop_hits(batch.recent, decoding.eos, decoding.stops)
    decoding.stopped.index_put_((batch.rows,), batch.done)
    batch.tokens.copy_(token)


def forward_one_token(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      slot: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The model's forward pass (rlcore.models.transformer, its own modules) for tokens `[B]` at RoPE positions
    `[B]`, their keys/values written at cache slot `slot` (`[]` long) of every row, each row
    attending over its slots start..slot. Returns the final hidden states `[B, H]`."""
    B = tokens.shape[0]
    x = model.model.embed_tokens(tokens)
    cos, sin = rope_cos_sin(model.inv_freq, positions[:, None], x.dtype)  # [B, 1, 1, D]
    end = (slot + 1).expand(B)
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(B, attn.n_heads, 1, attn.head_dim)
        k = attn.k_proj(h).view(B, attn.n_kv, 1, attn.head_dim)
        v = attn.v_proj(h).view(B, attn.n_kv, 1, attn.head_dim)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cache.k[i].index_copy_(2, slot.view(1), apply_rope(k, cos, sin).to(cache.k.dtype))
        cache.v[i].index_copy_(2, slot.view(1), v.to(cache.v.dtype))
        y = decode_attention(apply_rope(q, cos, sin), cache.k[i], cache.v[i], start, end)
        x = x + attn.o_proj(y.reshape(B, -1))
        x = x + block.mlp(block.post_attention_layernorm(x))
    return model.model.norm(x)


def decode_one_token(model: Transformer, batch: Batch, decoding: Decoding) -> None:
    """The static decoding step: feed every row's last token at slot T + step, sample the next.

    Shapes depend on the batch alone, all state is in device tensors updated in place, nothing
    waits on the device: a CUDA graph captures it, and torch.compile(fullgraph=True) traces it."""
    h = forward_one_token(model, batch.tokens, batch.positions, batch.cache, decoding.prompt_width + batch.step,
                          batch.start)
    logits = (h @ decoding.head.T).float()
    batch.positions.add_(1)
    batch.step.add_(1)
    sample_and_record(logits, batch, decoding)


def packed_one_token(packed: PackedDecoder, batch: Batch, decoding: Decoding, slot: int,
                     mask: torch.Tensor | None) -> None:
    """`decode_one_token` with PackedDecoder's forward pass (the CPU path): the batch's tokens are
    fed at `slot` (= T + batch.step, from the host) and attend over the filled slots only
    (`mask` `[B, 1, 1, slots]`, or None when no row is padded)."""
    view = KVCache(batch.cache.k[:, :, :, :slot + 1], batch.cache.v[:, :, :, :slot + 1])
    logits = packed(batch.tokens, batch.positions, view, None if mask is None else mask[..., :slot + 1], slot)
    batch.positions.add_(1)
    batch.step.add_(1)
    sample_and_record(logits, batch, decoding)


def bucket(rows: int) -> int:
    """The batch size a static step runs `rows` rows at: the next power of two, so a rollout
    captures at most log2(N) + 1 graphs."""
    return 1 << (rows - 1).bit_length()


def cuda_graphs_enabled() -> bool:
    """RLCORE_CUDA_GRAPHS=0 runs the static step eagerly on CUDA (for debugging and profiling)."""
    return os.environ.get("RLCORE_CUDA_GRAPHS", "1") != "0"


def check_generate_args(prompts: list[list[int]], num_generations: int, max_new_tokens: int,
                        stop_sequences: list[list[int]], end_of_turn: EndOfTurn | None,
                        max_turns: int | None) -> None:
    """`generate`'s checks beyond the sampling options' (sampling.check_sampling_args), before any work."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (got an empty prompt list or prompt)")
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(f"num_generations and max_new_tokens must be >= 1, got "
                         f"{num_generations} and {max_new_tokens}")
    if any(len(s) == 0 for s in stop_sequences):
        raise ValueError("stop_sequences must not contain an empty sequence")
    if max_turns is not None and (end_of_turn is None or max_turns < 0):
        raise ValueError(f"max_turns={max_turns} needs end_of_turn (the ids to append after a turn) and must be >= 0")


def compute_dtype(model: Transformer, dtype: torch.dtype | None) -> torch.dtype:
    """The rollout's compute dtype: `dtype`, or the model's when None. Autocast only narrows, so a
    wider one is an error."""
    dtype = dtype or model.lm_head_weight.dtype
    if dtype.itemsize > model.lm_head_weight.dtype.itemsize:
        raise ValueError(f"dtype {dtype} is wider than the model's {model.lm_head_weight.dtype}: autocast only "
                         f"narrows; load the model in {dtype} instead")
    return dtype


def static_step_weights(model: Transformer, dtype: torch.dtype,
                        packed: bool) -> contextlib.AbstractContextManager:
    """`matmul_weights_in(model, dtype)` where it changes what the static step multiplies (`dtype`
    narrower than the model's, or LoRA layers to merge); a no-op context otherwise, and for the
    packed step, which keeps its own `dtype` copies of the weights."""
    merge = dtype != model.lm_head_weight.dtype or any(isinstance(m, LoraLinear) for m in model.modules())
    return matmul_weights_in(model, dtype) if merge and not packed else contextlib.nullcontext()


def distinct_prompts(prompts: list[list[int]], G: int,
                     device: torch.device) -> tuple[list[list[int]], torch.Tensor]:
    """The prompts without repeats (in order of first appearance), and `which` `[N]` long: for each
    of the N = len(prompts) * G rows, prompt-major, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}  # prompt -> its row in the prefill batch
    for p in prompts:
        index.setdefault(tuple(p), len(index))
    which = torch.tensor([index[tuple(p)] for p in prompts for _ in range(G)], device=device)
    return [list(p) for p in index], which


def prefill_rows(model: Transformer, distinct: list[list[int]], which: torch.Tensor, max_new_tokens: int,
                 dtype: torch.dtype) -> tuple[KVCache, torch.Tensor]:
    """Prefill each distinct prompt once, then copy its keys/values to its rows (`which` `[N]`) of a
    static cache with room for the completions.

    Returns that cache `[L, N, H_kv, T + max_new_tokens - 1, D]` (T = the longest prompt) and the
    prefill's fp32 logits `[P, V]`, one row per distinct prompt (`logits[which]` is row order)."""
    prompt_cache, first_logits = prefill(model, distinct, dtype)
    if not bool(torch.isfinite(first_logits).all()):  # one sync per rollout; NaN logits would sample id V
        raise FloatingPointError("the model's logits are not finite (NaN or inf) after the prompts: its weights or "
                                 "activations overflowed; if training diverged, lower train.learning_rate and "
                                 "start again from the model or an earlier checkpoint")
    T = prompt_cache.k.shape[3]
    cache = KVCache.empty(model.config, len(which), T + max_new_tokens - 1, prompt_cache.k.dtype,
                          model.inv_freq.device)
    cache.k[:, :, :, :T] = prompt_cache.k[:, which]
    cache.v[:, :, :, :T] = prompt_cache.v[:, which]
    return cache, first_logits


def packed_step(packed: PackedDecoder, batch: Batch, decoding: Decoding, padded: bool) -> Callable[[int], None]:
    """The CPU step on `batch`: `step(t)` feeds token t - 1 of every row at slot T + t - 1 and samples
    token t. With `padded` (some prompt is shorter than T), a mask `[B, 1, 1, slots]` keeps each
    row's left padding out, built once per batch; without, the step needs none."""
    mask = None
    if padded:
        slots = torch.arange(batch.cache.k.shape[3], device=batch.cache.k.device)
        mask = (slots >= batch.start[:, None])[:, None, None]
    return lambda t: packed_one_token(packed, batch, decoding, decoding.prompt_width + t - 1, mask)


def static_step(model: Transformer, batch: Batch, decoding: Decoding, dtype: torch.dtype) -> Callable[[int], None]:
    """The static step on `batch`: `decode_one_token` under autocast to `dtype`, on CUDA captured in
    a CUDA graph (graphs.CapturedStep) unless RLCORE_CUDA_GRAPHS=0. `step(t)` does not read t: the
    step counter is a device tensor, which a graph replay can advance."""
    device = batch.cache.k.device
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != model.lm_head_weight.dtype,
                              cache_enabled=False)

    def step() -> None:
        with autocast, decoding_attention(device):
            decode_one_token(model, batch, decoding)

    captured = CapturedStep(step) if device.type == "cuda" and cuda_graphs_enabled() else step
    return lambda t: captured()


def step_function(model: Transformer, batch: Batch, decoding: Decoding, dtype: torch.dtype,
                  packed: PackedDecoder | None, padded: bool) -> Callable[[int], None]:
    """`step(t)`: feed token t - 1 of every row of `batch`, sample and record token t. The packed
    step when there is a `packed` decoder (CPU), the static step otherwise. One per batch: a
    compaction makes a new batch, which needs a new step (and on CUDA, a new graph)."""
    if packed is not None:
        return packed_step(packed, batch, decoding, padded)
    return static_step(model, batch, decoding, dtype)


def compacted_size(rows: int, live: int, packed: bool) -> int | None:
    """The size to compact a batch of `rows` rows, `live` of them unfinished, to; None to keep it.
    Compact once 1/COMPACT_FRACTION of the batch has finished: to `live` rows for the packed step,
    to the next power of two for the static one (a CUDA graph is captured per size)."""
    size = live if packed else bucket(live)
    return size if (rows - live) * COMPACT_FRACTION >= rows and size < rows else None


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    num_generations: int,
    max_new_tokens: int,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    stop_sequences: list[list[int]] = (),
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
    end_of_turn: EndOfTurn | None = None,
    max_turns: int | None = None,
) -> Rollout:
    """Sample `num_generations` completions of at most `max_new_tokens` for each prompt.

    A row stops after any id in `eos_token_ids` or any of `stop_sequences` (both are kept in
    the completion and its mask). `generator` seeds sampling (same seed, same completions): a
    sampled rollout draws one key from it (from the device's default generator when None), a
    greedy one nothing.
    `repetition_penalty` (1.0 = off) applies to each row's prompt tokens and the tokens it has
    generated so far, as in transformers (left padding excluded).
    `dtype` (default: the model's) is the compute dtype: bf16 for an fp32 model runs the
    rollout under bf16 autocast, with a bf16 KV cache and bf16 copies of the weights of matmuls.
    `progress(tokens, finished)`, when given, is called every CHECK_EVERY tokens, at the check
    that already syncs with the device: `tokens` sampled per row so far, `finished` rows stopped.
    `end_of_turn` (see EndOfTurn), when given, makes rows multi-turn: a row whose turn ends gets the
    ids it returns appended and decodes on, at most `max_turns` times (None: no limit; TRL's
    max_tool_calling_iterations) and within `max_new_tokens` in all; the Rollout's tool_mask is 0 on
    those ids, whose log-probs are 0. The engine then looks for ended turns after every step, one
    host sync per step (on a GPU the host no longer runs ahead of the device).
    """
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    check_generate_args(prompts, num_generations, max_new_tokens, stop_sequences, end_of_turn, max_turns)
    device, G, N = model.inv_freq.device, num_generations, len(prompts) * num_generations
    dtype = compute_dtype(model, dtype)
    use_packed = use_packed_decoder(device)
    distinct, which = distinct_prompts(prompts, G, device)
    with static_step_weights(model, dtype, use_packed):
        cache, first_logits = prefill_rows(model, distinct, which, max_new_tokens, dtype)
        batch, decoding = start_decoding(
            model, cache, distinct, which, max_new_tokens, dtype, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repetition_penalty=repetition_penalty, eos_token_ids=eos_token_ids,
            stop_sequences=stop_sequences, pad_token_id=pad_token_id, generator=generator,
            multi_turn=end_of_turn is not None)
        turn_counts = [0] * N  # the times ids were appended to each row, for max_turns
        room = [model.config.max_position_embeddings - len(p) for p in prompts for _ in range(G)]
        sample_and_record(first_logits[which], batch, decoding)  # token 0, from the prefill's logits
        if end_of_turn is not None:
            continue_turns(batch, decoding, 0, torch.zeros_like(batch.done), end_of_turn, turn_counts, max_turns, room)

        packed = PackedDecoder(model, N, dtype) if use_packed else None
        padded = use_packed and bool((batch.start > 0).any())  # else a packed step needs no mask at all
        step = step_function(model, batch, decoding, dtype, packed, padded)
        for t in range(1, max_new_tokens):
            if t % CHECK_EVERY == 0:
                live = int((~batch.done).sum())  # host sync, once every CHECK_EVERY steps
                if progress is not None:
                    progress(t, N - live)
                if live == 0:
                    break
                size = compacted_size(len(batch.rows), live, packed is not None)
                if size is not None:  # copying the cache's filled part is cheaper than decoding finished rows
                    batch = compact(batch, size, decoding.prompt_width + t - 1, model, scratch_row=N)
                    if packed is not None:
                        packed.repack(size)
                    step = step_function(model, batch, decoding, dtype, packed, padded)
            was_done = None if end_of_turn is None else batch.done.clone()
            step(t)
            if end_of_turn is not None:
                continue_turns(batch, decoding, t, was_done, end_of_turn, turn_counts, max_turns, room)
    return collect_rollout(decoding, prompts, G)
