"""Checkpoints in and out: HF layout, sharding, round trip through transformers, clear errors."""

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore.models.hf_checkpoint import CheckpointError, check_model_dir, load_model, save_model

from conftest import rewrite_config


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


@pytest.mark.parametrize("damage", ["wrong shard", "no entry"])
def test_an_index_that_misplaces_or_omits_a_tensor_loads_as_in_transformers(damage, hf_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, hf = hf_checkpoint("llama")
    out = tmp_path / "sh"
    hf.save_pretrained(out, max_shard_size="50KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = "model.norm.weight"
    if damage == "wrong shard":
        index["weight_map"][name] = next(f for f in shards if f != index["weight_map"][name])
    else:
        del index["weight_map"][name]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # loads it from the shard that has it
    with torch.no_grad():
        assert torch.equal(logits(load_model(out), IDS), ref(IDS).logits)  # was: a raw RuntimeError / "missing"


def test_a_tensor_in_two_shards_loads_from_the_one_the_index_names(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("llama")
    out = tmp_path / "sh"
    hf.save_pretrained(out, max_shard_size="50KB")
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.norm.weight"
    for other in sorted(set(weight_map.values()) - {weight_map[name]}):  # a zero copy in every other shard
        tensors = load_file(out / other)
        save_file({**tensors, name: torch.zeros_like(tensors.get(name, hf.model.norm.weight.detach()))}, out / other)
    model = load_model(out)
    assert torch.equal(model.model.norm.weight, hf.model.norm.weight.detach())
    assert torch.equal(logits(model, IDS), logits(load_model(path), IDS))


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


def test_bf16_checkpoint_loaded_in_fp32_saves_as_fp32_for_transformers(tmp_path):
    """A transformers-5 config says `dtype`; a saved copy that kept the source's "bfloat16" made
    transformers load the fp32 weights as bf16 and lose small updates."""
    transformers = pytest.importorskip("transformers")
    from conftest import make_hf_model

    make_hf_model("qwen2").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16")  # fp32 by default
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)  # below bf16's resolution around 0.1-1
    out = save_model(model, tmp_path / "saved")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # dtype from config.json
    assert hf.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, logits(model, IDS))


def rewrite_tensors(path, change):
    sd = load_file(path / "model.safetensors")
    save_file(change(sd), path / "model.safetensors", metadata={"format": "pt"})


def transformers_logits(path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(IDS).logits


@pytest.mark.parametrize("case", ["legacy_rotary_buffers", "no_model_prefix", "extra_tensor"])
def test_tensor_names_transformers_accepts_load_the_same(case, hf_checkpoint):
    """Names transformers loads past: the RoPE buffers older Llama exports saved (ignored), a
    base-model file without the `model.` prefix (tied, so complete), an unknown tensor (skipped)."""
    path, _ = hf_checkpoint("llama_tied")
    ref = logits(load_model(path), IDS)
    if case == "legacy_rotary_buffers":
        rewrite_tensors(path, lambda sd: {**sd, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                                   for i in range(2)}})
    elif case == "no_model_prefix":
        rewrite_tensors(path, lambda sd: {k.removeprefix("model."): v for k, v in sd.items()})
    else:
        rewrite_tensors(path, lambda sd: {**sd, "model.extra.weight": torch.zeros(3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(path)
    assert torch.equal(logits(model, IDS), ref)
    assert torch.equal(transformers_logits(path), ref)
    skipped = [str(w.message) for w in caught if "skipping" in str(w.message)]
    if case == "extra_tensor":
        assert len(skipped) == 1 and "model.extra.weight" in skipped[0]
    else:
        assert skipped == []


def test_tied_config_with_a_different_stored_lm_head_loads_untied_like_transformers(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen2_tied")
    head = torch.randn(128, 64, generator=torch.Generator().manual_seed(5))
    rewrite_tensors(path, lambda sd: {**sd, "lm_head.weight": head})
    with pytest.warns(UserWarning, match="different lm_head.weight; loading it untied"):
        model = load_model(path)
    assert torch.equal(model.lm_head_weight, head)
    assert torch.equal(logits(model, IDS), transformers_logits(path))
    out = save_model(model, tmp_path / "saved")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(transformers_logits(out), logits(model, IDS))


def test_tied_config_with_a_stored_copy_of_the_embedding_stays_tied(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2_tied")
    rewrite_tensors(path, lambda sd: {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_model(path)
    assert model.config.tie_word_embeddings and model.lm_head_weight is model.model.embed_tokens.weight


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


def test_a_config_without_model_type_says_so(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    rewrite_config(path, drop=["model_type"])
    with pytest.raises(CheckpointError, match=r"config\.json: no model_type key; add the family, \"model_type\": one of "
                                              r"'llama', 'qwen2', 'qwen3'"):
        load_model(path)


def test_a_tied_model_whose_config_does_not_say_so_names_tie_word_embeddings(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2_tied")
    rewrite_config(path, drop=["tie_word_embeddings"])  # False for every family by default
    with pytest.raises(CheckpointError, match=r"missing \['lm_head\.weight'\]; the output layer is stored only as "
                                              r"the embedding: .*\"tie_word_embeddings\": true"):
        load_model(path)


def test_unknown_model_type_lists_supported(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    rewrite_config(path, model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        load_model(path)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", "1"), ("hidden_size", 64.0), ("num_attention_heads", 0)])
def test_a_size_that_is_not_a_positive_integer_is_named(hf_checkpoint, key, value):
    path, _ = hf_checkpoint("qwen2")
    rewrite_config(path, **{key: value})
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
    rewrite_config(path, drop=["head_dim"], **changes)
    with pytest.raises(CheckpointError, match=r"config\.json: " + message):
        load_model(path)


def test_a_file_given_as_the_checkpoint_directory_is_named(tmp_path):
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(CheckpointError, match=r"ckpt: is a file, not a checkpoint directory"):
        load_model(tmp_path / "ckpt")


def test_missing_and_unexpected_tensor_names(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    renamed = {"model.layers.1.mlp.up_proj.weight": "model.layers.0.mlp.extra.weight"}
    rewrite_tensors(path, lambda sd: {renamed.get(k, k): v for k, v in sd.items()})
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\].*"
                                              r"unexpected \['model\.layers\.0\.mlp\.extra\.weight'\]"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    rewrite_tensors(path, lambda sd: {**sd, "model.norm.weight": torch.ones(63)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(63,\), config\.json implies \(64,\); "
                                              r"check that config\.json's sizes"):
        load_model(path)


def test_a_weight_that_is_not_finite_is_named_at_load(hf_checkpoint):
    """Not at the first rollout, as 'logits are not finite' with no tensor named."""
    path, _ = hf_checkpoint("qwen2")
    name = "model.layers.0.mlp.down_proj.weight"

    def with_values(values, dtype=torch.float32):
        def change(sd):
            w = sd[name].to(dtype)
            for (i, j), v in values.items():
                w[i, j] = v
            return {**sd, name: w}
        return change

    rewrite_tensors(path, with_values({(3, 5): math.inf, (0, 0): math.nan}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight "
                                              r"holds 2 NaN/inf value\(s\); the checkpoint is damaged"):
        load_model(path)
    rewrite_tensors(path, with_values({(3, 5): 0.0, (0, 0): 0.0, (1, 1): 1e300}, torch.float64))  # finite in the file
    with pytest.raises(CheckpointError, match=r"down_proj\.weight has values beyond torch\.float32's range"):
        load_model(path)


def test_directories_that_are_not_a_model_say_what_they_are(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen2")
    ck = tmp_path / "run" / "checkpoint-2"  # an rlcore checkpoint and its run directory
    save_model(load_model(path), ck / "model")
    (ck / "run_state.json").write_text("{}")
    (tmp_path / "run" / "latest").write_text("checkpoint-2")
    with pytest.raises(CheckpointError, match=rf"{ck} is an rlcore checkpoint; its model is {ck / 'model'}: give "
                                              rf"that directory \(or continue its run with --resume {ck.parent}\)"):
        load_model(ck)
    with pytest.raises(CheckpointError, match=rf"{ck.parent} is an rlcore run directory; its newest model is "
                                              rf"{ck / 'model'}"):
        load_model(ck.parent)
    adapter = tmp_path / "lora"  # what Unsloth and peft save
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"lora is a LoRA adapter \(adapter_config\.json\), not a model; "
                                              r"train from it with --set lora\.enabled=true --set lora\.adapter_path="):
        load_model(adapter)


def test_a_git_lfs_pointer_is_named(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\n"
                                            "size 1234567\n")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a Git LFS pointer, not the weights: fetch them"):
        load_model(path)
    (path / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4567\nsize 7654321\n")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is a Git LFS pointer, not the file"):
        check_model_dir(path)  # train() runs it before the tokenizer is read


def test_missing_shard_named(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("llama")
    out = tmp_path / "sh"
    hf.save_pretrained(out, max_shard_size="50KB")
    victim = sorted(out.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name + ": shard listed"):
        load_model(out)


def test_latest_naming_a_missing_checkpoint_says_missing_and_names_the_one_kept(tmp_path):
    from rlcore.run.checkpoints import latest_checkpoint

    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-12.tmp"):  # the last is no checkpoint name
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_state.json").write_text("{}")
    (tmp_path / "latest").write_text("checkpoint-14")
    with pytest.raises(FileNotFoundError, match=r"checkpoint-14: checkpoint named by .*latest is missing; the run "
                                                r"directory keeps checkpoint-10: write its name into"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoint-14").mkdir()
    with pytest.raises(FileNotFoundError, match=r"is incomplete \(no run_state\.json\); the run directory keeps "
                                                r"checkpoint-10"):
        latest_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(FileNotFoundError, match=r"latest is empty: it names no checkpoint; the run directory keeps "
                                                r"checkpoint-10"):
        latest_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("checkpoint-10")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def test_a_trainer_state_rlcore_did_not_write_is_named_with_the_keys_it_lacks(tmp_path):
    from rlcore.run.checkpoints import load_trainer_state
    from rlcore.run.state import write_state

    ck = tmp_path / "checkpoint-2"
    (ck / "model").mkdir(parents=True)
    write_state(ck, {"global_step": 2})  # another trainer's
    with pytest.raises(ValueError, match=rf"run_state\.json is not an rlcore trainer state: it lacks optimizer, "
                                         rf"scheduler, sampler_rng, .*--set model\.path={ck / 'model'}$"):
        load_trainer_state(ck)


def test_the_trainer_state_round_trips_through_json_and_safetensors_exactly(tmp_path):
    """An optimizer's state (integer keys, tuples, 0-dim tensors), RNG states, None and non-finite
    floats come back equal, of the same types, from files that hold no pickle."""
    from rlcore.run.state import read_state, write_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "sampler_rng": [torch.Generator().manual_seed(s).get_state() for s in (1, 2)],
             "step": 3, "before": None, "best": float("inf"), "name": "x", "keys": {"tensor": 1, 7: (2, 3)}}
    write_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_state.json", "run_state.safetensors"]
    got = read_state(tmp_path)

    def same(a, b):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(got, state)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(got["optimizer"])  # the parameter indices are integers again
    assert torch.equal(fresh.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
