"""The Python side of decode_attention.cu: argument checks, the split count, and the ctypes call.

The kernel file has no torch headers (it builds in seconds), so it is called as a plain C function
with the tensors' device pointers and torch's current CUDA stream; a CUDA graph being captured on
that stream records its two launches like any other.
"""

from __future__ import annotations

import ctypes
import math

import torch

KEYS_PER_SPLIT = 64  # the fewest slots one block of pass 1 walks; fewer would cost more in pass 2
BLOCKS_PER_SM = 4    # enough blocks of pass 1 to keep every SM busy while some wait on memory
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class DecodeAttention:
    """`kernel(q, k, v, start, end)`: see `rlcore.rollout.attention.decode_attention_twin`."""

    def __init__(self, library_path: str):
        lib = ctypes.CDLL(library_path)
        lib.rlcore_decode_attention.restype = ctypes.c_int
        lib.rlcore_decode_attention.argtypes = (
            [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5 + [ctypes.c_int64] * 3
            + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p])
        lib.rlcore_cuda_error_string.restype = ctypes.c_char_p
        lib.rlcore_cuda_error_string.argtypes = [ctypes.c_int]
        self.lib = lib
        self.group = lib.rlcore_decode_attention_group()

    def splits(self, device: torch.device, blocks: int, slots: int) -> int:
        """How many pieces to cut the `slots` slots into: enough blocks for BLOCKS_PER_SM a multiprocessor,
        at least KEYS_PER_SPLIT slots each. Depends on shapes only, so a captured graph keeps it."""
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = math.ceil(BLOCKS_PER_SM * sms / blocks)
        return max(1, min(wanted, math.ceil(slots / KEYS_PER_SPLIT)))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor) -> torch.Tensor:
        B, Hq, _, D = q.shape
        _, Hkv, slots, _ = k.shape
        if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"decode_attention takes fp32 or bf16 q, k and v of one dtype, got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}; use decode_attention_twin for others")
        if k.shape != v.shape or k.stride() != v.stride() or k.stride(-1) != 1 or k.shape[0] != B or k.shape[3] != D:
            raise ValueError(f"k and v must be [B, Hkv, slots, D] views with the same strides and contiguous D (q is "
                             f"{tuple(q.shape)}, k {tuple(k.shape)} strides {k.stride()}, v {tuple(v.shape)} strides "
                             f"{v.stride()})")
        if Hq % Hkv or D > 256:
            raise ValueError(f"decode_attention needs query heads ({Hq}) a multiple of kv heads ({Hkv}) and a head "
                             f"dim of at most 256 (got {D}); use decode_attention_twin")
        if start.dtype != torch.long or end.dtype != torch.long or start.shape != (B,) or end.shape != (B,):
            raise ValueError(f"start and end must be long [{B}], got {start.dtype} {tuple(start.shape)} and "
                             f"{end.dtype} {tuple(end.shape)}")
        q = q.reshape(B, Hq, D).contiguous()
        start, end = start.contiguous(), end.contiguous()
        out = torch.empty_like(q)
        head_groups = math.ceil(Hq // Hkv / self.group)
        splits = self.splits(q.device, B * Hkv * head_groups, slots)
        workspace = torch.empty(B * Hq * splits * (D + 2), dtype=torch.float32, device=q.device)
        code = self.lib.rlcore_decode_attention(
            DTYPES[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), start.data_ptr(),
            end.data_ptr(), workspace.data_ptr(), B, Hq, Hkv, slots, D, k.stride(0), k.stride(1), k.stride(2),
            splits, D ** -0.5, torch.cuda.current_stream(q.device).cuda_stream)
        if code != 0:
            raise RuntimeError(f"decode_attention did not launch: {self.lib.rlcore_cuda_error_string(code).decode()} "
                               f"(code {code}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
        return out.view(B, Hq, 1, D)
