"""One-token decoding steps on CPU from weights re-laid out once per rollout.

A decoding step multiplies only B rows (one token each) by every weight matrix, so on a CPU
the fixed cost of each matmul call dominates: oneDNN/MKL repack the weight into their blocked
layout on every call, and q/k/v and gate/up are five calls where two would do. `PackedDecoder`
pays those costs once per rollout instead of once per step:

- q, k and v are one `[H, q + 2 kv]` matmul, gate and up one `[H, 2 I]` matmul;
- with fp32 weights and MKL present, every matrix (the output projection too) is packed once
  with MKL's `cblas_sgemm_pack` for the batch size B (`torch.ops.mkl._mkl_linear`, the op
  Inductor uses for frozen CPU linears); elsewhere the weights are stored transposed and
  contiguous, the layout a `[B, H] @ [H, N]` product reads best.

The arithmetic is the model's (same ops in the same order, matmuls re-blocked), so logits agree
with `decode_one_token` to fp32 rounding. The packed copies cost extra memory: about 3x the
weights for the benchmark model (hidden 512, MKL's packed format pads small matrices), about
1.4x for large ones. MKL's layout is for one row count: on fewer rows it falls back to an
ordinary matmul on the unpacked weights, slower than packing for that count, so the engine calls
`repack` after it drops finished rows. docs/benchmarks.md has the step times against the module.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from rlcore.models.transformer import KVCache, Transformer, apply_rope, rms_norm, rope_cos_sin

Linear = Callable[[torch.Tensor], torch.Tensor]
LINEARS = ("qkv", "o", "gate_up", "down")  # a layer's matrices; the rest of its entries are norm weights


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, batch: int) -> Linear:
    """`x [B, in] -> x @ weight.T + bias`, with `weight [out, in]` laid out once for B rows."""
    weight, bias = weight.detach().contiguous(), None if bias is None else bias.detach()
    if weight.dtype == torch.float32 and mkl_packing_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, batch)
    weight_t = weight.T.contiguous()
    if bias is None:
        return lambda x: x @ weight_t
    return lambda x: torch.addmm(bias, x, weight_t)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per row, q `[B, nh, 1, d]`, over k, v `[B, nkv, slots, d]` (a view
    of the cache), under bool `mask` `[B, 1, 1, slots]` (padding) or None; no causal structure to
    impose. Query head h reads kv head h // (nh / nkv), as SDPA's enable_gqa. Two batched
    matmuls over the B * nkv groups of nh / nkv query heads: in fp32 faster than SDPA's CPU flash
    kernel, which is built for many queries; in bf16 slower, so SDPA runs there.
    """
    B, nh, _, d = q.shape
    nkv, slots = k.shape[1], k.shape[2]
    if q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=nkv != nh)
    scores = torch.bmm(q.reshape(B * nkv, nh // nkv, d) * d ** -0.5,
                       k.reshape(B * nkv, slots, d).transpose(1, 2))  # [B * nkv, nh / nkv, slots]
    if mask is not None:
        scores.view(B, nkv, nh // nkv, slots).masked_fill_(~mask, float("-inf"))
    probs = scores.float().softmax(-1).to(v.dtype)
    return torch.bmm(probs, v.reshape(B * nkv, slots, d)).view(B, nh, 1, d)


class PackedDecoder:
    """`decoder(tokens, positions, cache, mask, slot)` -> fp32 logits `[B, V]`.

    Same contract as `rlcore.rollout.engine.decode_one_token` (all rows write at cache slot
    `slot`; `cache` covers slots 0..slot), except that `mask` `[B, 1, 1, slots]` may be None when no
    row has padding. Build it from the model as it is for this rollout: it copies the weights,
    so later updates to the model do not reach it. `dtype` (default: the model's) is the dtype
    of those copies and of the whole step, e.g. bf16 for an fp32 model trained under bf16
    autocast, as vLLM serves such a model in TRL or verl.
    """

    def __init__(self, model: Transformer, batch: int, dtype: torch.dtype | None = None):
        cfg = model.config
        dtype = dtype or model.lm_head_weight.dtype

        def cast(w: torch.Tensor | None) -> torch.Tensor | None:
            return None if w is None else w.detach().to(dtype)

        def linear(weights, biases) -> tuple[torch.Tensor, torch.Tensor | None]:  # laid out by `repack`
            bias = None if biases[0] is None else torch.cat([cast(b) for b in biases])
            weight = cast(weights[0]) if len(weights) == 1 else torch.cat([cast(w) for w in weights])
            return weight, bias

        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.intermediate, self.eps, self.qk_norm = cfg.intermediate_size, cfg.rms_norm_eps, cfg.qk_norm
        self.inv_freq = model.inv_freq
        self.embed = cast(model.model.embed_tokens.weight)
        self.final_norm = cast(model.model.norm.weight)
        self.head_weight = linear([model.lm_head_weight], [None])
        self.layer_weights = []
        for block in model.model.layers:
            a, mlp = block.self_attn, block.mlp
            self.layer_weights.append(dict(
                norm1=cast(block.input_layernorm.weight),
                qkv=linear([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                           [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                q_norm=cast(a.q_norm.weight) if self.qk_norm else None,
                k_norm=cast(a.k_norm.weight) if self.qk_norm else None,
                o=linear([a.o_proj.weight], [a.o_proj.bias]),
                norm2=cast(block.post_attention_layernorm.weight),
                gate_up=linear([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias]),
                down=linear([mlp.down_proj.weight], [mlp.down_proj.bias]),
            ))
        self.mkl = dtype == torch.float32 and mkl_packing_available()  # else the layout ignores B
        self.batch = None
        self.repack(batch)

    def repack(self, batch: int) -> None:
        """Lay the matrices out for steps on `batch` rows (the engine calls it after dropping
        finished rows). Only MKL's packed layout depends on the row count."""
        if batch == self.batch or (self.batch is not None and not self.mkl):
            return
        self.batch = batch
        self.head = pack_linear(*self.head_weight, batch)
        self.layers = [{k: pack_linear(*v, batch) if k in LINEARS else v for k, v in w.items()}
                       for w in self.layer_weights]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None, slot: int) -> torch.Tensor:
        B, nh, nkv, d, eps = tokens.shape[0], self.n_heads, self.n_kv, self.head_dim, self.eps
        x = self.embed[tokens]                                   # [B, H]
        cos, sin = rope_cos_sin(self.inv_freq, positions[:, None], x.dtype)  # [B, 1, 1, d]
        for i, w in enumerate(self.layers):
            qkv = w["qkv"](rms_norm(x, w["norm1"], eps))
            q = qkv[:, :nh * d].view(B, nh, 1, d)
            k = qkv[:, nh * d:(nh + nkv) * d].view(B, nkv, 1, d)
            v = qkv[:, (nh + nkv) * d:].view(B, nkv, 1, d)
            if self.qk_norm:
                q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
            cache.k[i][:, :, slot:slot + 1] = apply_rope(k, cos, sin).to(cache.k.dtype)
            cache.v[i][:, :, slot:slot + 1] = v.to(cache.v.dtype)
            y = _one_query_attention(apply_rope(q, cos, sin), cache.k[i], cache.v[i], mask)
            x = x + w["o"](y.view(B, nh * d))
            gate_up = w["gate_up"](rms_norm(x, w["norm2"], eps))
            x = x + w["down"](F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:])
        return self.head(rms_norm(x, self.final_norm, eps)).float()
