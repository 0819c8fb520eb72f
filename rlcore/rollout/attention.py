"""A decoding step's attention: one new token per row against the whole static KV cache.

Row b attends over its slots start[b] <= s < end[b] (its prompt without left padding, then its
completion so far); the rest of the buffer is not its own yet. The shapes are the buffer's, not
the filled part's, so they do not change from step to step.

`decode_attention_twin` is SDPA under that mask: the CPU path, and the oracle of
rlcore/cuda/decode_attention.cu (flash-decoding), which `decode_attention` runs on CUDA where it
is built and reads only each row's own slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore import cuda


def decode_attention_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                          end: torch.Tensor) -> torch.Tensor:
    """q `[B, Hq, 1, D]` against k, v `[B, Hkv, slots, D]` over slots start..end-1 of each row
    (`[B]` long each); query head h reads kv head h // (Hq / Hkv). Returns `[B, Hq, 1, D]`."""
    slot = torch.arange(k.shape[2], device=q.device)
    mask = (slot >= start[:, None]) & (slot < end[:, None])  # [B, slots]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None],
                                          enable_gqa=k.shape[1] != q.shape[1])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                     end: torch.Tensor) -> torch.Tensor:
    """`decode_attention_twin`'s result, from the CUDA kernel where it is built (fp32 and bf16).
    q is taken in the cache's dtype, as autocast gives SDPA a bf16 rollout's fp32 queries."""
    q = q.to(k.dtype)
    kernel = cuda.kernels("decode_attention", q.device)
    if kernel is None or q.dtype not in (torch.float32, torch.bfloat16):
        return decode_attention_twin(q, k, v, start, end)
    return kernel(q, k, v, start, end)
