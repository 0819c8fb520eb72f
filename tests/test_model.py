"""Logits parity of rlcore's from-scratch model with transformers, per family, in fp32."""

import dataclasses
import json
import math

import pytest
import torch

from conftest import FAMILIES, LLAMA3_ROPE
from rlcore.models.hf_checkpoint import CheckpointError, load_model
from rlcore.models.transformer import KVCache, ModelConfig, mix_into, padded_causal_mask, rope_inv_freq

PADDED_TOL = 1e-6  # a left-padded batch runs attention with a mask, rounded otherwise (measured: 6e-8)


def hf_logits(hf, ids, attention_mask=None):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, hf_checkpoint):
    path, hf = hf_checkpoint(family)
    model = load_model(path, torch.float32)
    ids = torch.randint(0, 128, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.logits(model(ids))
    diff = (ours - hf_logits(hf, ids)).abs().max().item()
    print(f"\n{family}: max |logits - transformers| = {diff:.3e}")
    assert diff == 0.0  # bit-identical on CPU in fp32, as the README says


@pytest.mark.parametrize("family", ["llama3_rope", "qwen2", "qwen3"])
def test_left_padded_batch_matches_transformers(family, hf_checkpoint):
    path, hf = hf_checkpoint(family)
    model = load_model(path)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 20, dtype=torch.long)
    am[0, :6] = 0
    mask, pos = padded_causal_mask(am)
    with torch.no_grad():
        ours = model.logits(model(ids, pos, mask))
    ref = hf_logits(hf, ids, am)
    assert (ours - ref)[am.bool()].abs().max().item() <= PADDED_TOL


def test_llama3_rope_scaling_changes_logits(hf_checkpoint):
    """Guards the parity test above: the llama3 frequencies must differ from the same config's
    unscaled ones (not from another family's, whose rope_theta alone would differ)."""
    scaled = load_model(hf_checkpoint("llama3_rope")[0])
    assert scaled.config.rope_scaling is not None
    unscaled = rope_inv_freq(dataclasses.replace(scaled.config, rope_scaling=None))
    assert not torch.allclose(unscaled, scaled.inv_freq)
    # Some frequency falls in the smoothing band, so the parity tests compare the interpolated
    # branch with transformers too: strictly between the kept and the divided frequency.
    s = scaled.config.rope_scaling
    wavelen = 2 * math.pi / unscaled
    band = (wavelen > s["original_max_position_embeddings"] / s["high_freq_factor"]) & \
        (wavelen < s["original_max_position_embeddings"] / s["low_freq_factor"])
    assert band.any(), wavelen
    assert ((scaled.inv_freq[band] < unscaled[band]) & (scaled.inv_freq[band] > unscaled[band] / s["factor"])).all()


def test_cached_forward_equals_full_forward(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen3")[0])
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.empty(model.config, 2, 16, torch.float32)
        slots = torch.arange(16)
        out = []
        for t in range(12):
            mask = (slots <= t)[None, None, None, :].expand(2, 1, 1, 16)
            pos = torch.full((2, 1), t)
            out.append(model(ids[:, t:t + 1], pos, mask, cache))
    assert torch.allclose(torch.cat(out, 1), full, atol=1e-5)


def test_hidden_states_skip_logits(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen2")[0])
    h = model(torch.zeros(1, 5, dtype=torch.long))
    assert h.shape == (1, 5, model.config.hidden_size)


def test_config_reads_pre_v5_rope_keys():
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
         "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.head_dim == 4 and cfg.num_key_value_heads == 2


# --- config.json variants read as transformers reads them ---

def edit_config(path, **changes):
    """Rewrite path/config.json with `changes` (None deletes a key)."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def transformers_logits(path, ids):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_logits(hf, ids)


IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("family, changes", [
    # a transformers-5 config (default rope_parameters) with the legacy key added by hand:
    # transformers applies rope_scaling
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # llama3 scaling without original_max_position_embeddings: max_position_embeddings stands in
    ("llama3_rope", {"rope_parameters": {k: v for k, v in {**LLAMA3_ROPE, "rope_theta": 5e5}.items()
                                         if k != "original_max_position_embeddings"}}),
    # Qwen3 without head_dim: transformers' Qwen3Config default (128), not hidden / heads
    ("qwen3", {"head_dim": None}),
])
def test_config_variants_match_transformers(family, changes, hf_checkpoint):
    overrides = {"head_dim": 128} if family == "qwen3" else {}
    path, _ = hf_checkpoint(family, **overrides)
    edit_config(path, **changes)
    model = load_model(path)
    with torch.no_grad():
        ours = model.logits(model(IDS))
    assert torch.equal(ours, transformers_logits(path, IDS))  # bit-identical, as in the parity test


def test_rope_keys_that_disagree_are_rejected(hf_checkpoint):
    path, _ = hf_checkpoint("llama3_rope")  # rope_parameters: llama3
    edit_config(path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(CheckpointError, match=r"rope_parameters = .*llama3.* and rope_scaling = .*linear.* "
                                              r"disagree.*keep only one"):
        load_model(path)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "needs a positive number low_freq_factor"),
    ({"rope_type": "linear"}, "needs a positive number factor"),
    ({"rope_type": "linear", "factor": "4"}, "needs a positive number factor, got '4'"),
])
def test_incomplete_rope_scaling_is_named(scaling, message):
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=r"config\.json: .*" + message):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_rope_types_rlcore_does_not_compute_are_rejected_by_name(kind):
    """docs/verified.md: never approximated by another type, as a default rope would (transformers computes them)."""
    d = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_scaling": {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 32}}
    with pytest.raises(ValueError, match=rf"config\.json: rope type '{kind}' is not supported; supported: "
                                         r"default, linear, llama3"):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_mix_into_is_the_tr_dpo_update_of_every_weight(family, hf_checkpoint):
    """ref = alpha * policy + (1 - alpha) * ref, checked in fp64 against the two state dicts; a
    tied embedding is one parameter, mixed once."""
    path, _ = hf_checkpoint(family)
    ref, policy = load_model(path), load_model(path)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    before = {k: v.double() for k, v in ref.state_dict().items()}
    mix_into(ref, policy, 0.6)
    for name, w in ref.state_dict().items():
        want = 0.6 * policy.state_dict()[name].double() + 0.4 * before[name]
        torch.testing.assert_close(w.double(), want, rtol=1e-6, atol=1e-6)
    assert ref.lm_head_weight.data_ptr() != policy.lm_head_weight.data_ptr()


@pytest.mark.parametrize("family", ["llama_tied", "qwen2", "qwen3_tied"])
def test_gradients_match_transformers_where_the_pad_token_is_also_content(family, hf_checkpoint):
    """transformers builds the embedding with padding_idx = pad_token_id: the pad row gets no gradient
    from the positions where it is an input (SmolLM2's pad is its EOS, inside every chat prompt); tied,
    it still gets the output layer's. Token 5 is pad here and occurs in the input."""
    path, hf = hf_checkpoint(family, pad_token_id=5)
    model = load_model(path, torch.float32)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    ids[:, ::4] = 5
    weights = torch.linspace(-1, 1, 2 * 23).view(2, 23)

    def loss(logits):
        return (logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * weights).sum()

    loss(model.logits(model(ids))).backward()
    loss(hf(input_ids=ids).logits).backward()
    theirs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad - theirs[name].grad).norm() <= 1e-5 * theirs[name].grad.norm(), name
    embed = model.model.embed_tokens.weight.grad[5]
    model.zero_grad()
    model.model.embed_tokens.padding_idx = None  # the gradient without it
    loss(model.logits(model(ids))).backward()
    assert (model.model.embed_tokens.weight.grad[5] - embed).norm() > 0.1 * embed.norm()  # the rule mattered
