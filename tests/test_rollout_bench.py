"""bench/rollout.py's roofline: the bytes it says the decoding steps must read, against a count
taken from rlcore's own model and KV cache."""

import pytest
import torch

from rlcore.models.transformer import KVCache, ModelConfig, Transformer
from test_bench import bench_module


@pytest.mark.parametrize("shape", ["bench", "qwen2.5-0.5b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_bytes_are_the_matmul_weights_and_the_filled_cache_of_every_step(shape, dtype):
    rollout = bench_module("rollout")
    cfg = ModelConfig.from_hf(dict(rollout.SHAPES[shape], model_type="qwen2"))
    with torch.device("meta"):
        model = Transformer(cfg)
    matmul = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    weights = (matmul + model.lm_head_weight.numel()) * dtype.itemsize
    rows, prompt_len, new = 6, 10, 5
    cache = KVCache.empty(cfg, rows, prompt_len + new - 1, dtype, "meta")
    per_slot = 2 * cache.k.numel() * dtype.itemsize / cache.k.shape[3]  # keys and values of one slot, every row
    # step t (t = 1 .. new - 1) feeds token t - 1 at slot prompt_len + t - 1: prompt_len + t slots filled
    want = sum(weights + per_slot * (prompt_len + t) for t in range(1, new))
    assert rollout.decode_bytes(cfg, rows, prompt_len, new, dtype.itemsize) == want
