"""The rollout engine: G sampled completions per prompt in one batched, cached decoding run.

    prefill          each distinct prompt once, left-padded so every prompt ends at slot T-1
    (expand)         copy each prompt's keys/values to its G rows of the static cache (in generate)
    decode_one_token all unfinished rows together, one token per step (on CPU: `PackedDecoder`,
                     the same step from weights laid out once per rollout, see packed.py)
    generate         the loop: sample, record, stop rows, compact the batch, repeat

Cache layout: plain tensors `[L, B, H_kv, T + max_new_tokens - 1, D]`. Prompts are left-padded
to T, so completion token t of every row sits at the same slot T + t; a row's RoPE positions
count only its real tokens (a short prompt gets the positions it would have unpadded). The
padding stays masked by a per-row bool mask `[B, 1, 1, S]` that never changes during decoding.
Each step attends over only the filled slots (a view of the first T + t + 1), not the buffer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlcore.lora import LoraLinear
from rlcore.model import KVCache, Transformer, padded_causal_mask
from rlcore.rollout.packed import PackedDecoder
from rlcore.rollout.sampling import check_sampling_args, sample

CHECK_EVERY = 8         # steps between "are all rows done?" checks (each one is a host sync)
COMPACT_FRACTION = 8    # compact when at least 1/COMPACT_FRACTION of the batch has finished


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


def use_packed_decoder(device: torch.device) -> bool:
    """Decode with `PackedDecoder` (weights laid out once per rollout) on CPU, where a step's
    small matmuls pay for re-blocking the weights on every call; the model's forward elsewhere."""
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


def decode_one_token(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor,
                     cache: KVCache, mask: torch.Tensor, slot: int,
                     logits_out: torch.Tensor) -> torch.Tensor:
    """Feed tokens `[B]` at RoPE positions `[B]`, written at cache slot `slot` of every row.

    `cache` and `mask` `[B, 1, 1, S]` cover slots 0..slot only. Returns fp32 logits `[B, V]`,
    written into `logits_out` (reused every step: an 8 MB allocation per step costs page faults).
    """
    B = tokens.shape[0]
    slots = torch.full((B, 1), slot, dtype=torch.long, device=tokens.device)
    h = model(tokens[:, None], positions[:, None], mask, cache, slots)[:, -1]
    w = model.lm_head_weight
    if w.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type):
        return torch.mm(h, w.T, out=logits_out)
    return logits_out.copy_(h @ w.T)


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
    """Rows `[B]` whose completion, ending in `recent` `[B, W]`, ends in EOS or a stop sequence."""
    hit = torch.isin(recent[:, -1], eos)
    for seq in stop_sequences:
        if recent.shape[1] >= len(seq):
            hit |= (recent[:, -len(seq):] == seq).all(-1)
    return hit


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
) -> Rollout:
    """Sample `num_generations` completions of at most `max_new_tokens` for each prompt.

    A row stops after any id in `eos_token_ids` or any of `stop_sequences` (both are kept in
    the completion and its mask). `generator` seeds sampling (same seed, same completions).
    `repetition_penalty` (1.0 = off) applies to each row's prompt tokens and the tokens it has
    generated so far, as in transformers (left padding excluded).
    `dtype` (default: the model's) is the compute dtype: bf16 for an fp32 model runs the
    rollout under bf16 autocast, with a bf16 KV cache and bf16 copies of the weights of matmuls.
    `progress(tokens, finished)`, when given, is called every CHECK_EVERY tokens, at the check
    that already syncs with the device: `tokens` sampled per row so far, `finished` rows stopped.
    """
    check_sampling_args(temperature, top_k, top_p, min_p, repetition_penalty)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (got an empty prompt list or prompt)")
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(f"num_generations and max_new_tokens must be >= 1, got "
                         f"{num_generations} and {max_new_tokens}")
    if any(len(s) == 0 for s in stop_sequences):
        raise ValueError("stop_sequences must not contain an empty sequence")
    device = model.inv_freq.device
    G, N = num_generations, len(prompts) * num_generations

    # Prefill each distinct prompt once, then copy its keys/values to its G rows.
    distinct: dict[tuple[int, ...], int] = {}  # prompt -> its row in the prefill batch
    for p in prompts:
        distinct.setdefault(tuple(p), len(distinct))
    which = torch.tensor([distinct[tuple(p)] for p in prompts for _ in range(G)], device=device)
    dtype = dtype or model.lm_head_weight.dtype
    if dtype.itemsize > model.lm_head_weight.dtype.itemsize:
        raise ValueError(f"dtype {dtype} is wider than the model's {model.lm_head_weight.dtype}: autocast only "
                         f"narrows; load the model in {dtype} instead")
    narrowing = dtype != model.lm_head_weight.dtype
    use_packed = use_packed_decoder(device)  # on CPU: it keeps `dtype` copies of the weights itself
    merge = narrowing or any(isinstance(m, LoraLinear) for m in model.modules())
    weights = matmul_weights_in(model, dtype) if merge and not use_packed else contextlib.nullcontext()
    with weights:
        prompt_cache, first_logits = prefill(model, [list(p) for p in distinct], dtype)
        if not bool(torch.isfinite(first_logits).all()):  # one sync per rollout; NaN logits would sample id V
            raise FloatingPointError("the model's logits are not finite (NaN or inf) after the prompts: its weights or "
                                     "activations overflowed; if training diverged, lower train.learning_rate and "
                                     "start again from the model or an earlier checkpoint")
        T = prompt_cache.k.shape[3]
        cache = KVCache.empty(model.config, N, T + max_new_tokens - 1, prompt_cache.k.dtype, device)
        cache.k[:, :, :, :T] = prompt_cache.k[:, which]
        cache.v[:, :, :, :T] = prompt_cache.v[:, which]
        del prompt_cache
        prompt_len = torch.tensor([len(p) for p in distinct], device=device)[which]
        slot = torch.arange(cache.k.shape[3], device=device)
        valid = (slot >= T - prompt_len[:, None])[:, None, None, :]  # [N, 1, 1, S]: not padding

        # Outputs, indexed by global row; `rows` maps the (shrinking) batch to global rows.
        completion = torch.full((N, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        written = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=device)
        samp_lp = torch.zeros(N, max_new_tokens, dtype=torch.float32, device=device)
        full_lp = torch.zeros_like(samp_lp)
        stopped = torch.zeros(N, dtype=torch.bool, device=device)
        rows = torch.arange(N, device=device)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
        stops = [torch.tensor(s, dtype=torch.long, device=device) for s in stop_sequences]
        longest_stop = max([1] + [len(s) for s in stop_sequences])
        positions = prompt_len.clone()
        logits = first_logits[which]
        seen = None  # [B, V] bool: the tokens already in each row, for the repetition penalty
        if repetition_penalty != 1.0:
            seen = torch.zeros(len(distinct), logits.shape[-1], dtype=torch.bool, device=device)
            for i, p in enumerate(distinct):
                seen[i, torch.tensor(p, device=device)] = True
            seen = seen[which]
        packed = PackedDecoder(model, N, dtype) if use_packed else None
        autocast = torch.autocast(device.type, dtype=dtype, enabled=narrowing)
        logits_buf = torch.empty_like(logits) if packed is None else None
        padded = not bool(valid.all())  # else a decoding step's single query needs no mask at all
        has_full = False

        for t in range(max_new_tokens):
            tok, lp, flp = sample(logits, temperature, top_k, top_p, min_p, generator, repetition_penalty, seen)
            tok = tok.masked_fill(done, pad_token_id)
            if seen is not None:
                seen[torch.arange(len(rows), device=device), tok] = True
            completion[rows, t] = tok
            written[rows, t] = ~done
            samp_lp[rows, t] = lp.masked_fill(done, 0.0)
            if flp is not None:
                has_full = True
                full_lp[rows, t] = flp.masked_fill(done, 0.0)
            if len(eos) or stops:
                recent = completion[rows, max(0, t + 1 - longest_stop):t + 1]
                done = done | stop_hits(recent, eos, stops)
                stopped[rows] = done
            if t == max_new_tokens - 1:
                break
            if (t + 1) % CHECK_EVERY == 0:
                n_done = int(done.sum())  # host sync, once every CHECK_EVERY steps
                if progress is not None:
                    progress(t + 1, N - len(rows) + n_done)
                if n_done == len(rows):
                    break
                if n_done * COMPACT_FRACTION >= len(rows):
                    # Drop finished rows; copying the cache's filled part is cheaper than decoding them.
                    keep = (~done).nonzero()[:, 0]
                    filled = T + t
                    k = cache.k[:, keep, :, :filled]
                    v = cache.v[:, keep, :, :filled]
                    cache = KVCache.empty(model.config, len(keep), cache.k.shape[3], k.dtype, device)
                    cache.k[:, :, :, :filled] = k
                    cache.v[:, :, :, :filled] = v
                    del k, v
                    rows, done, positions, valid = rows[keep], done[keep], positions[keep], valid[keep]
                    tok = tok[keep]
                    if seen is not None:
                        seen = seen[keep]
                    if packed is not None:
                        packed.repack(len(keep))
            S = T + t + 1  # slots 0..T+t are filled once this token is written at slot T+t
            view = KVCache(cache.k[:, :, :, :S], cache.v[:, :, :, :S])
            if packed is not None:
                logits = packed(tok, positions, view, valid[..., :S] if padded else None, T + t)
            else:
                with autocast, decoding_attention(device):
                    logits = decode_one_token(model, tok, positions, view, valid[..., :S], T + t,
                                              logits_buf[:len(rows)])
            positions = positions + 1

    lengths = written.sum(1)
    width = int(lengths.max())
    return Rollout(
        prompt_ids=[list(p) for p in prompts for _ in range(G)],
        completion_ids=completion[:, :width].contiguous(),
        completion_mask=written[:, :width].long(),
        lengths=lengths,
        truncated=~stopped,
        sampling_logprobs=samp_lp[:, :width].contiguous(),
        full_logprobs=full_lp[:, :width].contiguous() if has_full else None,
    )
