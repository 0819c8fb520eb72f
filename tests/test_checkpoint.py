"""Checkpoints in and out: HF layout, sharding, round trip through transformers, clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore.checkpoint import CheckpointError, load_model, save_model


def logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids))


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["llama", "qwen2_tied", "qwen3"])
def test_saved_checkpoint_loads_in_transformers_with_identical_logits(family, hf_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, _ = hf_checkpoint(family)
    model = load_model(path)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # a change transformers can only see through our file
    out = save_model(model, tmp_path / "saved")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(IDS).logits
    assert torch.equal(ref, logits(model, IDS))


def test_sharded_save_loads_identically_to_single_file(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen2")
    model = load_model(path)
    out = save_model(model, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 2
    assert torch.equal(logits(load_model(out), IDS), logits(model, IDS))


def test_transformers_sharded_checkpoint_loads(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("llama")
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="50KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(load_model(tmp_path / "hf_sharded"), IDS), logits(load_model(path), IDS))


def test_load_in_bfloat16_converts_every_parameter(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen3")[0], "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters())


def test_resave_replaces_existing_directory_atomically(hf_checkpoint, tmp_path):
    model = load_model(hf_checkpoint("qwen2")[0])
    out = tmp_path / "runs"
    save_model(model, out / "ck")
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    save_model(model, out / "ck")
    assert sorted(p.name for p in out.iterdir()) == ["ck"]
    assert torch.equal(load_model(out / "ck").model.norm.weight, model.model.norm.weight)


# --- bad input: each error names the file and the problem ---

def test_missing_config_json(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*missing config\.json"):
        load_model(path)


def test_missing_safetensors(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


def test_truncated_safetensors(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable.*truncated"):
        load_model(path)


def test_unknown_model_type_lists_supported(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        load_model(path)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", "1"), ("hidden_size", 64.0), ("num_attention_heads", 0)])
def test_a_size_that_is_not_a_positive_integer_is_named(hf_checkpoint, key, value):
    path, _ = hf_checkpoint("qwen2")
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"config\.json: {key} = {value!r} must be a positive integer"):
        load_model(path)


@pytest.mark.parametrize("changes, message", [
    ({"num_attention_heads": 3, "num_key_value_heads": 3},
     r"hidden_size = 64 is not divisible by num_attention_heads = 3, and there is no head_dim"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3},
     r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
])
def test_head_counts_that_do_not_divide_are_named(hf_checkpoint, changes, message):
    path, _ = hf_checkpoint("qwen2")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("head_dim", None)
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(CheckpointError, match=r"config\.json: " + message):
        load_model(path)


def test_a_file_given_as_the_checkpoint_directory_is_named(tmp_path):
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(CheckpointError, match=r"ckpt: is a file, not a checkpoint directory"):
        load_model(tmp_path / "ckpt")


def test_missing_and_unexpected_tensor_names(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.mlp.extra.weight"] = sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\].*"
                                              r"unexpected \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    sd = load_file(path / "model.safetensors")
    sd["model.norm.weight"] = torch.ones(63)
    save_file(sd, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(63,\), config\.json implies \(64,\)"):
        load_model(path)


def test_missing_shard_named(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("llama")
    out = tmp_path / "sh"
    hf.save_pretrained(out, max_shard_size="50KB")
    victim = sorted(out.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name + ": shard listed"):
        load_model(out)
