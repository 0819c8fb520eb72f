"""A decoder-only transformer for the Llama, Qwen2/Qwen2.5 and Qwen3 families, from scratch.

One module covers all three; they differ only in a few switches read from `config.json`:

| family | q/k/v bias | o bias | q/k RMSNorm | head_dim |
|--------|------------|--------|-------------|----------|
| llama  | attention_bias | attention_bias | no | hidden/heads unless given |
| qwen2  | yes        | no     | no          | hidden/heads unless given |
| qwen3  | attention_bias | attention_bias | yes (per head) | explicit (default 128) |

Parameter names match Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...) so a
checkpoint's state dict loads with no renaming and saves back the same way.

The forward pass returns final hidden states `[B, T, H]`; logits are a separate matmul
(`model.logits(h)`) because the loss computes log-probs from `h` and `lm_head_weight` in chunks
and never materialises `[B, T, V]`. Attention takes explicit positions, an optional boolean mask
and an optional static KV cache, which is all the rollout engine needs. Training can share a
prompt's forward pass across its G completions with `PrefixKV` (see
`rlcore.forward.completion_hidden`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """The architecture, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # transformers builds the embedding with padding_idx = pad_token_id: that row gets no gradient
    # from its input occurrences (it matters where pad is a real token, SmolLM2's EOS = pad)
    pad_token_id: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """Build from the parsed `config.json` dict; `source` names the file in errors."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise ValueError(f"{source}: no model_type key; add the family, \"model_type\": one of "
                             f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; rlcore supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}; every {model_type} config.json "
                             f"transformers writes has them: check that the file is complete")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim"):
            value = hf.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{source}: {key} = {value!r} must be a positive integer")
        heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads = {heads} is not a multiple of "
                             f"num_key_value_heads = {kv_heads}")
        if not hf.get("head_dim") and hf["hidden_size"] % heads:
            raise ValueError(f"{source}: hidden_size = {hf['hidden_size']} is not divisible by "
                             f"num_attention_heads = {heads}, and there is no head_dim")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported; set it to false")
        theta, scaling = read_rope(hf, source)
        attention_bias = bool(hf.get("attention_bias", False))
        pad = hf.get("pad_token_id")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or not -hf["vocab_size"] <= pad < hf["vocab_size"]):
            raise ValueError(f"{source}: pad_token_id = {pad!r} is not a token id of the vocabulary "
                             f"(vocab_size = {hf['vocab_size']}); set it to the tokenizer's pad token id, or null")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # transformers' Qwen3Config defaults head_dim to 128; Llama and Qwen2 derive it
            head_dim=hf.get("head_dim") or (128 if model_type == "qwen3" else hf["hidden_size"] // heads),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            pad_token_id=None if pad is None else pad % hf["vocab_size"],
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            raw=dict(hf),
        )


def positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def read_rope(hf: dict, source: str = "config.json") -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a parsed `config.json`, as transformers reads it.

    transformers >= 5 writes `rope_parameters` (theta inside); older files have `rope_theta` and
    `rope_scaling`. When a file has both (say a v5 config with `rope_scaling` added by hand),
    transformers takes `rope_scaling`, with the theta from outside `rope_parameters`. So does
    rlcore, but when `rope_parameters` holds another theta or another scaling the file is
    ambiguous, and it is rejected rather than read one way here and another way there.
    """
    def settings(x: dict) -> dict:
        out = {("rope_type" if k == "type" else k): v for k, v in x.items() if k != "rope_theta"}
        out.setdefault("rope_type", "default")
        return out

    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{source}: {key} = {value!r} must be an object (or null)")
    outside = hf.get("rope_theta", 10000.0)  # transformers' default theta for all three families
    if legacy:
        theta, scaling = legacy.get("rope_theta", outside), settings(legacy)
        if params and (params.get("rope_theta", outside) != theta
                       or settings(params) not in (scaling, {"rope_type": "default"})):
            raise ValueError(
                f"{source}: rope_parameters = {params} and rope_scaling = {legacy} disagree (transformers "
                f"reads rope_scaling and rope_theta = {theta}); keep only one of the two keys")
    else:
        theta, scaling = (params or {}).get("rope_theta", outside), settings(params or {})
    if not positive_number(theta):
        raise ValueError(f"{source}: rope_theta = {theta!r} must be a positive number")
    kind = scaling["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None
    required = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    if kind == "llama3":  # transformers falls back to max_position_embeddings, so does rlcore
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
        required += ("original_max_position_embeddings",)
    for key in required:
        if not positive_number(scaling.get(key)):
            raise ValueError(f"{source}: {kind} rope scaling needs a positive number {key}, got "
                             f"{scaling.get(key)!r} in {scaling}")
    return float(theta), scaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32 (as HF does), scale in the input dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies `[head_dim/2]` in fp32, with Llama 3 or linear scaling applied."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
    """cos, sin `[B, 1, T, head_dim]` for positions `[B, T]`, computed in fp32."""
    freqs = pos.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class KVCache:
    """A static cache: plain preallocated tensors `[L, B, H_kv, slots, D]` for keys and values.

    Rows write at explicit slots, so rows of different lengths share one buffer. The owner
    (the rollout engine) decides slots and masks; the model only reads and writes.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "KVCache":
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class PrefixKV:
    """Keys/values `[P, H_kv, Lp, D]` of P shared prefixes (prompts), one per layer, with grad.

    A forward pass over the prefixes with `prefix=PrefixKV()` appends each layer's keys and
    values; a second pass over continuations with `prefix=` that object and `prefix_rows` `[B]`
    (the prefix each row continues) attends over `prefix.k[layer][prefix_rows]` followed by its
    own tokens. Gradients flow back into the prefix pass, summed over the rows sharing it, so
    the result equals running each row's full sequence, at the cost of one prefix pass.
    """

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, slots: torch.Tensor | None,
                prefix: PrefixKV | None = None, prefix_rows: torch.Tensor | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            # Write this step's keys/values into the cache at `slots` [B, T], then attend over
            # the whole buffer; `mask` hides slots that are empty or belong to the future.
            idx = slots[:, None, :, None].expand(B, self.n_kv, T, self.head_dim)
            cache.k[layer].scatter_(2, idx, k.to(cache.k.dtype))
            cache.v[layer].scatter_(2, idx, v.to(cache.v.dtype))
            k, v = cache.k[layer], cache.v[layer]
        if prefix is not None and prefix_rows is None:  # a prefix pass: keep this layer's k, v
            if len(prefix.k) == layer:  # (not again when gradient checkpointing reruns the layer)
                prefix.k.append(k)
                prefix.v.append(v)
        elif prefix is not None:  # a continuation: the prefix's keys/values come first
            k = torch.cat((prefix.k[layer].index_select(0, prefix_rows), k), dim=2)
            v = torch.cat((prefix.v[layer].index_select(0, prefix_rows), v), dim=2)
        cpu_amp = torch.is_autocast_enabled("cpu") and q.device.type == "cpu"
        if cpu_amp:
            # CPU autocast would run attention in bf16, whose CPU kernels are slower than fp32's
            # (backward most); the matmuls around it keep their bf16 speed-up.
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast("cpu", enabled=False) if cpu_amp else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, slots, prefix, prefix_rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, slots, prefix, prefix_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, blocks and final norm; named `model` inside `Transformer` as in HF."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gradient_checkpointing = False
        """Keep only each layer's input for backward and run the layer again there (TRL's and
        transformers' gradient_checkpointing): activation memory of one layer instead of all,
        for a third more forward compute. Only where autograd records, never with a KV cache."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection `[V, H]` (the embedding matrix when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        prefix: PrefixKV | None = None,
        prefix_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[B, T, H]` (after the last norm), no logits.

        input_ids `[B, T]`; positions `[B, T]` RoPE positions (default 0..T-1);
        mask: bool, broadcastable to `[B, 1, T, T_kv]`, True = may attend (default causal over the
        T tokens; T_kv = T without a cache, the cache's slots with one);
        cache/slots: write keys/values of the T tokens at cache slots `[B, T]` (default =
        positions) and attend over the whole cache, which then requires `mask`.
        prefix: without `prefix_rows`, record every layer's keys/values into it; with
        `prefix_rows` `[B]`, attend over prefix `prefix_rows[b]` before the T tokens, which then
        requires `mask` `[B, 1, T, Lp + T]` and positions that continue the prefix's.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if cache is not None:
            if mask is None:
                raise ValueError("a KV cache needs an explicit attention mask over its slots")
            if slots is None:
                slots = positions
        if prefix_rows is not None and mask is None:
            raise ValueError("attending over a prefix needs an explicit attention mask over prefix + tokens")
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        recompute = self.gradient_checkpointing and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            if recompute:
                x = checkpoint(layer, x, cos, sin, mask, cache, i, slots, prefix, prefix_rows, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, i, slots, prefix, prefix_rows)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., V]` logits from hidden states; materialises the vocabulary dimension."""
        return hidden @ self.lm_head_weight.T


def weight_layout_difference(a: Transformer, b: Transformer) -> str | None:
    """None when `a` and `b` have the same parameter names and shapes (what mix_into needs), else
    the first difference, in words."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in sorted(pa.keys() | pb.keys()):
        if name not in pa or name not in pb:
            return f"{name} is in only one of them"
        if pa[name].shape != pb[name].shape:
            return f"{name} is {tuple(pa[name].shape)} in one and {tuple(pb[name].shape)} in the other"
    return None


@torch.no_grad()
def mix_into(target: Transformer, source: Transformer, alpha: float) -> None:
    """target = alpha * source + (1 - alpha) * target, parameter by parameter, in target's dtype
    (TR-DPO's reference update, loss.sync_ref_model). Both must have the same architecture."""
    weights = dict(source.named_parameters())
    for name, p in target.named_parameters():
        p.mul_(1.0 - alpha).add_(weights[name].to(p.dtype), alpha=alpha)


def padded_causal_mask(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask `[B, 1, T, T]` and positions `[B, T]` for a batch with padding anywhere.

    attention_mask `[B, T]` is 1 on real tokens and 0 on pads (left, right or both).
    Positions count real tokens only, so a left-padded prompt gets the same RoPE positions as
    the unpadded one. Pad queries attend to themselves so no row is all-masked (no NaN).
    """
    am = attention_mask.bool()
    T = am.shape[1]
    positions = (am.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(T, T, dtype=torch.bool, device=am.device).tril()
    mask = causal[None] & am[:, None, :]
    mask = mask | torch.eye(T, dtype=torch.bool, device=am.device)[None]
    return mask[:, None], positions
