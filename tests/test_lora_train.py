"""The loop with LoRA (lora.enabled): only the adapters train, checkpoints hold them in PEFT's
format, the rollout samples from the adapted model, the KL reference is the run's starting point
without a second model, a killed run resumes exactly, and `rlcore export` merges the adapters into
a checkpoint transformers loads. tests/test_lora.py checks the adapters themselves against PEFT.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlcore.cli import main
from rlcore.train import train
from test_train import cli_args, config, rows, without_timing

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread

LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "train.learning_rate=1e-2"]


def test_only_the_adapters_train_and_the_checkpoint_holds_them_in_peft_format(tmp_path, embedded_dir):
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", *LORA))
    checkpoint = run / "checkpoint-2"
    assert not (checkpoint / "model").exists()
    adapter_config = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert adapter_config["base_model_name_or_path"] == str(embedded_dir)
    tensors = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert any(t.abs().max() > 0 for k, t in tensors.items() if ".lora_B." in k)  # B starts at 0: it trained
    assert (checkpoint / "adapter" / "tokenizer.json").is_file()


@pytest.mark.parametrize("packed", [True, False], ids=["packed-decoder", "model-forward"])
def test_rollout_logprobs_equal_the_trainers_with_adapters(packed, tmp_path, monkeypatch):
    """The engine samples from the merged weights W + s*B@A, the trainer runs base + adapter: the
    same policy to fp32 rounding (no dropout, so the update's passes are the policy itself). Both
    decoders: the CPU's packed one and the model's forward with merged copies (the GPU's)."""
    monkeypatch.setattr("rlcore.rollout.engine.use_packed_decoder", lambda device: packed)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=3", *LORA, "lora.dropout=0.0"))
    got = rows(run)
    assert all(r["mismatch/abs_max"] <= 1e-5 for r in got), [r["mismatch/abs_max"] for r in got]
    assert got[-1]["kl_old/k3"] == 0.0  # on-policy


def test_the_kl_reference_is_the_base_through_disabled_adapters_as_with_a_second_model(tmp_path, embedded_dir):
    """With LoRA and beta the reference is the policy's own model with its adapters off: the same KL
    as a reference loaded as a model of its own (model.ref_path = the base), step for step."""
    adapters, second = tmp_path / "adapters", tmp_path / "second"
    options = ["train.max_steps=3", *LORA, "lora.dropout=0.0", "loss.beta=0.1"]
    train(config(adapters, *options))
    train(config(second, *options, f"model.ref_path={embedded_dir}"))
    a, b = rows(adapters), rows(second)
    assert a[0]["kl_ref"] == 0.0  # B = 0: the policy starts as the base
    assert a[-1]["kl_ref"] > 0
    assert [without_timing(r) for r in a] == [without_timing(r) for r in b]


def test_a_lora_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    options = ["train.save_steps=2", "train.lr_scheduler_type=constant", "train.warmup_steps=0", "train.warmup_ratio=0",
               *LORA, "loss.beta=0.05"]  # dropout 0.05: its RNG resumes too
    train(config(whole, "train.max_steps=4", *options))
    train(config(resumed, "train.max_steps=2", *options))
    assert main(["train", "--resume", str(resumed), "--set", "train.max_steps=4"]) == 0
    assert [without_timing(r) for r in rows(resumed)] == [without_timing(r) for r in rows(whole)]
    got, want = (load_file(run / "checkpoint-4" / "adapter" / "adapter_model.safetensors") for run in (resumed, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_export_merges_the_adapters_into_a_checkpoint_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from rlcore.models.hf_checkpoint import load_model
    from rlcore.models.lora import load_adapter
    from rlcore.models.tokenizer import Tokenizer

    run, out = tmp_path / "run", tmp_path / "merged"
    train(config(run, "train.max_steps=2", *LORA))
    assert main(["export", str(run), str(out)]) == 0
    adapter = run / "checkpoint-2" / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = load_model(base)
    load_adapter(adapted, adapter)
    ids = torch.tensor([Tokenizer.from_dir(out).encode("12+34=")])
    want = adapted.eval().logits(adapted(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_a_run_starts_from_an_existing_adapter_and_keeps_it_as_the_kl_reference(tmp_path):
    """An SFT adapter, say: the policy starts as base + adapter, and the KL pulls it back to that
    starting point, not to the base (the problem TRL users report in trl#3194)."""
    first, second = tmp_path / "first", tmp_path / "second"
    train(config(first, "train.max_steps=2", *LORA))
    adapter = first / "checkpoint-2" / "adapter"
    train(config(second, "train.max_steps=2", *LORA, f"lora.adapter_path={adapter}", "loss.beta=0.1",
                 "lora.dropout=0.0"))
    got = rows(second)
    assert got[0]["kl_ref"] == 0.0 and got[-1]["kl_ref"] > 0  # the reference is the starting adapter


def test_cli_lora_options_take_trls_names(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=1", "use_peft=true", "lora_r=2", "lora_alpha=4",
                         "lora_target_modules=['q_proj', 'v_proj']")) == 0
    adapter_config = json.loads((run / "checkpoint-1" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 2 and adapter_config["lora_alpha"] == 4
    assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]
