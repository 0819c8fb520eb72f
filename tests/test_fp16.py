"""train.fp16 (TRL's fp16): float16 autocast over fp32 master weights with dynamic loss scaling, for
GPUs without bf16. On the same checkpoint and fixed completions as tests/test_train_trl.py, fp16
steps track fp32 steps; an overflow skips the step, halves the scale and is not a non-finite step."""

import functools

import pytest
import torch

from test_train_hf import write_gsm8k
from test_train_trl import STEPS, run_rlcore

OPTIONS = dict(loss_type="grpo", gradient_accumulation_steps=2, num_iterations=2, lr_scheduler_type="constant")


def test_fp16_steps_track_fp32_steps(qwen_dir, tmp_path, monkeypatch):
    """fp16 activations carry about 3 significant digits: each step's gradient norm within 2% of
    fp32's, and each tensor's update within 10% of fp32's (the weights and AdamW stay fp32)."""
    transformers = pytest.importorskip("transformers")
    init = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir).state_dict()
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    for name in ("fp32", "fp16"):
        (tmp_path / name).mkdir()
    _, want_rows, want = run_rlcore(OPTIONS, qwen_dir, data, tmp_path / "fp32", monkeypatch)
    _, got_rows, got = run_rlcore({**OPTIONS, "fp16": True}, qwen_dir, data, tmp_path / "fp16", monkeypatch)
    assert [r["grad_norm"] for r in got_rows] == pytest.approx([r["grad_norm"] for r in want_rows], rel=2e-2)
    assert [r["loss_scale"] for r in got_rows] == [2.0 ** 16] * STEPS and got_rows[-1]["overflow_skips"] == 0
    assert "loss_scale" not in want_rows[0]
    for name in want:
        moved = want[name] - init[name]
        assert got[name].dtype == torch.float32
        assert (got[name] - init[name] - moved).norm() <= 0.1 * moved.norm(), name


def test_an_fp16_overflow_skips_the_step_halves_the_scale_and_is_not_a_nonfinite_step(qwen_dir, tmp_path,
                                                                                      monkeypatch):
    import rlcore.run.state

    monkeypatch.setattr(rlcore.run.state, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 100))
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    _, rows, _ = run_rlcore({**OPTIONS, "fp16": True}, qwen_dir, data, tmp_path, monkeypatch)
    assert len(rows) == STEPS  # max_nonfinite_steps (3) does not stop the run: overflows are calibration
    assert [r["skipped"] for r in rows] == [True] * STEPS
    assert [r["loss_scale"] for r in rows] == [2.0 ** (100 - k) for k in range(STEPS)]
    assert [r["overflow_skips"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["nonfinite_total"] for r in rows] == [0] * STEPS
