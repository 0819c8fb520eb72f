"""LoRA adapters (rlcore.models.lora) against PEFT, the format's reference: adapters rlcore writes load in
PEFT with rlcore's logits and PEFT's load in rlcore with PEFT's; what trains, the KL reference,
the merged export and the errors. Tiny random checkpoints, built at test time."""

import json
import math
import re

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from rlcore.models.hf_checkpoint import CheckpointError, load_model, save_model
from rlcore.models.lora import TARGETS, adapter_state_dict, apply_lora, keep_as_reference, load_adapter, lora_parameters, merge_lora, reference_adapters, save_adapter

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
FP32 = dict(atol=1e-5, rtol=0)  # fp32 logits of O(1): the same sums in another order stay well inside
FAMILIES = ["qwen2", "llama"]
SUBSET = ["q_proj", "v_proj", "down_proj"]


def logits(model, grad: bool = False):
    with torch.set_grad_enabled(grad):
        out = model(IDS)
        return out.logits if hasattr(out, "logits") else model.logits(out)


@torch.no_grad()
def randomise_adapters(params, seed: int = 1):
    """Non-zero A and B, so that the adapters change the logits (B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def lora_model(hf_checkpoint, family="qwen2", seed=1, **lora):
    """(checkpoint path, rlcore model with random adapters, transformers model of the base)."""
    path, hf = hf_checkpoint(family)
    model = load_model(path)
    apply_lora(model, **{"r": 4, "alpha": 8, **lora})
    randomise_adapters(lora_parameters(model), seed)
    return path, model, hf


def edit_config(adapter_dir, **changes):
    file = adapter_dir / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


# ---- interoperability with PEFT


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_at_init_equals_the_base_model(family, hf_checkpoint):
    path, _ = hf_checkpoint(family)
    model = load_model(path)
    base = logits(model)
    apply_lora(model, r=8, alpha=16)
    assert torch.equal(logits(model), base)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("targets", ["all-linear", SUBSET], ids=["all-linear", "subset"])
def test_rlcore_adapter_loaded_by_peft_gives_rlcore_logits(family, use_rslora, targets, hf_checkpoint, tmp_path):
    path, model, hf = lora_model(hf_checkpoint, family, target_modules=targets, use_rslora=use_rslora)
    base = logits(hf)
    save_adapter(model, tmp_path / "adapter", str(path))
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert not torch.allclose(logits(model), base, atol=1e-2)  # the adapters matter
    torch.testing.assert_close(logits(model), logits(peft_model), **FP32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("targets", ["all-linear", ["k_proj", "up_proj"]], ids=["all-linear", "subset"])
def test_peft_adapter_loaded_by_rlcore_gives_peft_logits(family, use_rslora, targets, hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint(family)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=targets, use_rslora=use_rslora,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf, config).eval()
    randomise_adapters(p for name, p in peft_model.named_parameters() if "lora_" in name)
    peft_model.save_pretrained(tmp_path / "adapter")
    model = load_model(path).eval()  # eval: no dropout (0.05), as in PEFT's model
    load_adapter(model, tmp_path / "adapter")
    torch.testing.assert_close(logits(model), logits(peft_model), **FP32)


def test_peft_adapter_on_some_layers_round_trips_through_rlcore(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("qwen2")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.1\.self_attn\.(q|v)_proj", task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf, config).eval()
    randomise_adapters(p for name, p in peft_model.named_parameters() if "lora_" in name)
    peft_model.save_pretrained(tmp_path / "peft")
    model = load_model(path)
    load_adapter(model, tmp_path / "peft")
    save_adapter(model, tmp_path / "rlcore", str(path))
    assert json.loads((tmp_path / "rlcore" / "adapter_config.json").read_text())["target_modules"] == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]  # full names: layer 1 only
    _, again = hf_checkpoint("qwen2")
    reloaded = PeftModel.from_pretrained(again, tmp_path / "rlcore").eval()
    torch.testing.assert_close(logits(reloaded), logits(peft_model), **FP32)


def test_bf16_base_with_fp32_adapters_gives_peft_logits(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("qwen2")
    model = load_model(path, dtype=torch.bfloat16)
    apply_lora(model, r=4, alpha=8)
    randomise_adapters(lora_parameters(model))
    save_adapter(model, tmp_path / "adapter", str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()  # PEFT upcasts adapters to fp32
    assert torch.equal(logits(model), logits(peft_model))  # the same ops in the same order, bf16 rounding too


# ---- what trains


def test_backward_leaves_no_gradient_on_base_parameters(hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint)
    logits(model, grad=True).square().mean().backward()
    adapters = {id(p) for p in lora_parameters(model)}
    base = [name for name, p in model.named_parameters() if id(p) not in adapters]
    assert base and all(model.get_parameter(name).grad is None for name in base)
    assert all(not model.get_parameter(name).requires_grad for name in base)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model))


def test_lora_parameters_are_exactly_the_adapter_matrices(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = load_model(path)
    names = apply_lora(model, r=4, alpha=8, target_modules=["q_proj", "up_proj"])
    assert names == [f"model.layers.{i}.{proj}" for i in range(2) for proj in ("self_attn.q_proj", "mlp.up_proj")]
    expected = [getattr(model.get_submodule(name), f"lora_{half}") for name in names for half in "AB"]
    assert [id(p) for p in lora_parameters(model)] == [id(p) for p in expected]
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in expected}


# ---- the KL reference


def test_reference_adapters_give_the_base_logits_when_no_starting_adapter_was_kept(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    model = load_model(path)
    base = logits(model)
    apply_lora(model, r=4, alpha=8)
    randomise_adapters(lora_parameters(model))
    assert not torch.allclose(logits(model), base, atol=1e-2)
    with reference_adapters(model):
        assert torch.equal(logits(model), base)


def test_reference_adapters_give_the_kept_starting_adapters_logits_after_training(hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint)
    start = logits(model)
    keep_as_reference(model)
    randomise_adapters(lora_parameters(model), seed=2)  # what training does to them
    assert not torch.allclose(logits(model), start, atol=1e-2)
    with reference_adapters(model):
        assert torch.equal(logits(model), start)


def test_reference_adapters_run_without_dropout(hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint, dropout=0.5)
    start = logits(model.eval())
    keep_as_reference(model)
    model.train()
    assert not torch.equal(logits(model), start)  # dropout is on for the trained adapters
    with reference_adapters(model):
        assert torch.equal(logits(model), start)


def test_leaving_reference_adapters_restores_the_trained_adapters_even_after_an_error(hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint)
    adapted = logits(model)
    with pytest.raises(RuntimeError), reference_adapters(model):
        raise RuntimeError("a failing reference pass")
    assert torch.equal(logits(model), adapted)


# ---- merging for export


def test_merge_lora_gives_the_adapted_logits(hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint)
    adapted = logits(model)
    merge_lora(model)
    torch.testing.assert_close(logits(model), adapted, **FP32)


def test_merged_model_has_the_base_models_state_dict_keys(hf_checkpoint):
    path, model, _ = lora_model(hf_checkpoint, target_modules=SUBSET)
    merge_lora(model)
    assert list(model.state_dict()) == list(load_model(path).state_dict())


def test_merged_model_saves_a_checkpoint_transformers_loads_with_the_adapted_logits(hf_checkpoint, tmp_path):
    _, model, _ = lora_model(hf_checkpoint, family="llama")
    adapted = logits(model)
    merge_lora(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(save_model(model, tmp_path / "merged")).eval()
    torch.testing.assert_close(logits(hf), adapted, **FP32)


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_weight_is_the_base_weight_plus_the_scaled_low_rank_update(use_rslora, hf_checkpoint):
    _, model, _ = lora_model(hf_checkpoint, r=4, alpha=8, use_rslora=use_rslora)
    layer = model.model.layers[1].mlp.down_proj
    scaling = 8 / math.sqrt(4) if use_rslora else 8 / 4
    W, A, B = (t.detach().double() for t in (layer.base.weight, layer.lora_A, layer.lora_B))
    torch.testing.assert_close(layer.weight.double(), W + scaling * B @ A, atol=1e-6, rtol=0)
    assert layer.bias is layer.base.bias


def test_bf16_base_keeps_fp32_adapters(hf_checkpoint):
    path, _ = hf_checkpoint("qwen2")
    model = load_model(path, dtype=torch.bfloat16)
    apply_lora(model, r=4, alpha=8)
    adapters = {id(p) for p in lora_parameters(model)}
    assert {p.dtype for p in lora_parameters(model)} == {torch.float32}
    assert {p.dtype for p in model.parameters() if id(p) not in adapters} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # what the rollout copies
    assert logits(model).dtype == torch.bfloat16


# ---- saving and loading


def test_load_adapter_into_a_model_with_lora_restores_the_saved_adapters(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint, use_rslora=True)
    save_adapter(model, tmp_path / "adapter", str(path))
    resumed = load_model(path)
    apply_lora(resumed, r=4, alpha=8, use_rslora=True)
    load_adapter(resumed, tmp_path / "adapter")
    saved, loaded = adapter_state_dict(model), adapter_state_dict(resumed)
    assert list(loaded) == list(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_save_adapter_replaces_an_existing_adapter_and_leaves_no_temporary_directory(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint)
    save_adapter(model, tmp_path / "adapter", str(path))
    randomise_adapters(lora_parameters(model), seed=2)
    save_adapter(model, tmp_path / "adapter", str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "qwen2-0"]
    fresh = load_model(path)
    load_adapter(fresh, tmp_path / "adapter")
    assert torch.equal(logits(fresh), logits(model))


# ---- errors name the file and the problem


@pytest.mark.parametrize("key, value", [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                        ("rank_pattern", {"q_proj": 8})])
def test_an_adapter_config_asking_for_more_than_plain_lora_is_refused(key, value, hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint)
    adapter = save_adapter(model, tmp_path / "adapter", str(path))
    edit_config(adapter, **{key: value})
    with pytest.raises(CheckpointError, match=re.escape(f"{key} = {json.dumps(value)}")) as error:
        load_adapter(load_model(path), adapter)
    assert str(adapter / "adapter_config.json") in str(error.value)


def test_an_unknown_target_module_is_refused_naming_it_and_the_valid_ones(hf_checkpoint):
    model = load_model(hf_checkpoint("qwen2")[0])
    with pytest.raises(ValueError, match="unknown \\['qproj'\\]") as error:
        apply_lora(model, r=4, alpha=8, target_modules=["q_proj", "qproj"])
    assert all(name in str(error.value) for name in TARGETS)


def test_a_peft_adapter_on_the_output_layer_is_refused(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("qwen2")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    get_peft_model(hf, config).save_pretrained(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=r"unexpected \[.*'base_model\.model\.lm_head\.lora_A\.weight'") as error:
        load_adapter(load_model(path), tmp_path / "adapter")
    assert str(tmp_path / "adapter" / "adapter_model.safetensors") in str(error.value)
    assert "rlcore applies LoRA to q_proj, k_proj" in str(error.value)


def test_an_adapter_config_selecting_no_projection_is_refused(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint)
    adapter = save_adapter(model, tmp_path / "adapter", str(path))
    edit_config(adapter, target_modules=["lm_head"])
    with pytest.raises(CheckpointError, match="target_modules = \\['lm_head'\\] selects none") as error:
        load_adapter(load_model(path), adapter)
    assert str(adapter / "adapter_config.json") in str(error.value)


def test_an_adapter_tensor_of_the_wrong_shape_is_refused_naming_file_tensor_and_shapes(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint, r=4)
    adapter = save_adapter(model, tmp_path / "adapter", str(path))
    edit_config(adapter, r=8)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(CheckpointError, match=f"{key} has shape \\(4, 64\\), the model's LoRA layer needs "
                                              f"\\(8, 64\\)") as error:
        load_adapter(load_model(path), adapter)
    assert str(adapter / "adapter_model.safetensors") in str(error.value)


def test_adapter_tensors_missing_for_a_targeted_module_are_refused(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint, target_modules=["q_proj"])
    adapter = save_adapter(model, tmp_path / "adapter", str(path))
    edit_config(adapter, target_modules=["q_proj", "v_proj"])
    with pytest.raises(CheckpointError, match="missing \\['base_model.model.model.layers.0.self_attn.v_proj"):
        load_adapter(load_model(path), adapter)


def test_an_adapter_whose_scaling_differs_from_the_models_lora_is_refused(hf_checkpoint, tmp_path):
    path, model, _ = lora_model(hf_checkpoint, use_rslora=True)
    adapter = save_adapter(model, tmp_path / "adapter", str(path))
    other = load_model(path)
    apply_lora(other, r=4, alpha=8, use_rslora=False)
    with pytest.raises(CheckpointError, match="scaling 4.0 .* differs from the model's LoRA scaling 2.0"):
        load_adapter(other, adapter)
