"""The loop against TRL's GRPOTrainer on the real model, SmolLM2-135M-Instruct: the same prompts
(chat-templated, so real `<|im_end|>` tokens, this model's EOS and pad, sit inside them) and the same
fixed completions (test_train_trl.py's harness) give the same gradient, tensor by tensor, before
clipping.

Step 1 starts both sides from the checkpoint: every loss_type, gradient accumulation 1, 2 and 4,
beta > 0. For later steps the comparison must not be thrown off by Adam's first step, which moves
each weight by about lr * sign(grad), so rounding in a near-zero gradient entry becomes an update of
full size and the two runs' weights part after one step: the multi-step case trains at
learning_rate 0, so both sides compute every step's gradient from the same state, through rounds
of several optimizer steps, mu = 2 replays and the reference model.

Tolerance: the two sides compute in fp32 and differ only in rounding (the same computation in
fp64 agrees to 1e-12); the step's whole gradient agrees to GRAD_RTOL, its largest tensors each to
TENSOR_RTOL.
"""

import pytest

import test_train_trl as harness
from test_train_hf import write_gsm8k

trl = pytest.importorskip("trl", reason="TRL is the reference")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

GRAD_RTOL = 1e-5  # |g_rlcore - g_trl| / |g_trl| over every parameter of the step
TENSOR_RTOL = 1e-4  # the same, per tensor holding at least 1% of the gradient's norm

# TRL GRPOConfig keys, given to both; every loss_type once, gradient accumulation 1, 2 and 4 among them.
FIRST_STEP = {
    "dapo (TRL's default), GA 4": dict(gradient_accumulation_steps=4),
    "grpo, GA 1, beta": dict(loss_type="grpo", gradient_accumulation_steps=1, beta=0.04),
    "bnpo, GA 4": dict(loss_type="bnpo", gradient_accumulation_steps=4),
    "dr_grpo, GA 2, beta": dict(loss_type="dr_grpo", gradient_accumulation_steps=2, beta=0.04),
    "luspo (sequence ratios), GA 1": dict(loss_type="luspo", importance_sampling_level="sequence",
                                          gradient_accumulation_steps=1),
    "cispo, GA 2": dict(loss_type="cispo", gradient_accumulation_steps=2),
    "sapo, GA 4, beta": dict(loss_type="sapo", gradient_accumulation_steps=4, beta=0.04),
    "vespo, GA 2": dict(loss_type="vespo", gradient_accumulation_steps=2),
}
FROM_THE_SAME_STATE = {  # learning_rate 0: four steps, two rounds of two, each replayed twice
    "grpo, beta, mu = 2, steps_per_generation 4 over GA 2": dict(
        loss_type="grpo", beta=0.04, num_iterations=2, steps_per_generation=4, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=0.0),
}


def spy_gradients(monkeypatch) -> tuple[list, list]:
    """Lists that fill with each optimizer step's gradients {name: tensor}, before clipping: rlcore's
    (at its optimizer_step) and TRL's (at the Trainer's clip_grad_norm_)."""
    import rlcore.train

    ours, theirs = [], []
    real_step, real_init = rlcore.train.optimizer_step, trl.GRPOTrainer.__init__

    def optimizer_step(run, state, bad_losses):
        ours.append({n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None})
        return real_step(run, state, bad_losses)

    def init(trainer, *args, **kwargs):
        real_init(trainer, *args, **kwargs)
        real_clip = trainer.accelerator.clip_grad_norm_

        def clip(parameters, max_norm, *a, **k):
            theirs.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                           if p.grad is not None})
            return real_clip(parameters, max_norm, *a, **k)

        trainer.accelerator.clip_grad_norm_ = clip

    monkeypatch.setattr(rlcore.train, "optimizer_step", optimizer_step)
    monkeypatch.setattr(trl.GRPOTrainer, "__init__", init)
    return ours, theirs


def relative_difference(ours: dict, theirs: dict, names=None) -> float:
    names = list(theirs) if names is None else names
    diff = sum((ours[n] - theirs[n]).double().norm() ** 2 for n in names) ** 0.5
    return (diff / sum(theirs[n].double().norm() ** 2 for n in names) ** 0.5).item()


def check_gradients(options, smollm2, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(harness.COMMON, "max_steps", 1)
    monkeypatch.setitem(harness.COMMON, "learning_rate", 1e-5)
    monkeypatch.setitem(harness.COMMON, "lr_scheduler_type", "constant")
    data = write_gsm8k(tmp_path / "prompts.jsonl", range(8))
    ours, theirs = spy_gradients(monkeypatch)
    rounds, rows, _ = harness.run_rlcore(options, smollm2, data, tmp_path, monkeypatch)
    logs, _ = harness.run_trl(options, smollm2, rounds, tmp_path, monkeypatch)

    steps = {**harness.COMMON, **options}["max_steps"]
    assert len(ours) == len(theirs) == len(rows) == len(logs) == steps
    for step, (mine, want) in enumerate(zip(ours, theirs), start=1):
        assert mine.keys() == want.keys()
        total = relative_difference(mine, want)
        assert total <= GRAD_RTOL, f"step {step}: the gradient differs by {total:.1e} (relative)"
        norm = sum(g.double().norm() ** 2 for g in want.values()) ** 0.5
        for name in (n for n in want if want[n].double().norm() >= 0.01 * norm):
            assert relative_difference(mine, want, [name]) <= TENSOR_RTOL, (step, name)
    assert [r["grad_norm"] for r in rows] == pytest.approx([h["grad_norm"] for h in logs], rel=GRAD_RTOL)


@pytest.mark.parametrize("case", FIRST_STEP)
def test_first_step_gradient_equals_trls(case, smollm2, tmp_path, monkeypatch):
    check_gradients(FIRST_STEP[case], smollm2, tmp_path, monkeypatch)


@pytest.mark.parametrize("case", FROM_THE_SAME_STATE)
def test_each_steps_gradient_from_the_same_state_equals_trls(case, smollm2, tmp_path, monkeypatch):
    check_gradients(FROM_THE_SAME_STATE[case], smollm2, tmp_path, monkeypatch)
