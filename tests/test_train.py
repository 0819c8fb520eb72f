"""The training loop end to end on CPU: metrics, learning, mu > 1, resume, crash safety, errors.

Every run uses a tiny embedded model built once per session by a short SFT (a few seconds) and
small batches (16 completions = 4 prompts x 4), so each run takes well under a second per step.
Runs start from rlcore/config/default.toml, as the CLI does, with the overrides in `SMALL`; their reward is
`first_digit`, which varies within almost every group, so every step has a gradient.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlcore.rollout.completions
import rlcore.run.rundir
import rlcore.run.steplog
import rlcore.train
from rlcore import RlcoreWarning
from rlcore.cli import DEFAULT_CONFIG, main
from rlcore.config import load_config
from rlcore.data.datasets import DataError
from rlcore.models.embedded import build_embedded_model
from rlcore.run.state import read_state
from rlcore.models.tokenizer import Tokenizer
from rlcore.models.hf_checkpoint import load_model
from rlcore.run.checkpoints import latest_checkpoint
from rlcore.data.tasks import unique_problems
from rlcore.train import train

from conftest import EMBEDDED_NUM_EVAL as NUM_EVAL, EMBEDDED_SEED as SEED, exit_spawned_rank

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread
SMALL = ["train.device=cpu", f"data.seed={SEED}", f"data.num_eval={NUM_EVAL}", "data.num_train=256",
         "rollout.num_generations=4", "train.per_device_train_batch_size=16", "train.learning_rate=1e-3",
         "train.logging_steps=100", "train.eval_steps=0", "train.save_steps=0",
         f"loss.reward_funcs=['{__name__}:first_digit']"]
TIMING = ("time/", "tokens_per_s/", "memory/")  # measurements of the process, not of the run
# SPEC section 6 keys the loop writes on every step of an on-policy PPO run without beta or TIS.
SPEC_KEYS = {"reward/mean", "reward/std", f"reward/{__name__}:first_digit/mean", "frac_reward_zero_std",
             "advantage/mean", "advantage/abs_mean", "completion/len_mean", "completion/len_min", "completion/len_max",
             "completion/truncated_frac", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region",
             "kl_old/k1", "kl_old/k3", "entropy", "grad_norm", "lr", "tokens_per_s/rollout",
             "tokens_per_s/train", "time/rollout", "time/scoring", "time/old_logp", "time/update", "memory/peak_rss_gb",
             "mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3"}


# A sampling seed whose first rounds have completions of unequal lengths and unequal rewards in some
# group: on-policy, a round whose completions are all as long has a loss of exactly 0 (the
# advantages of a group sum to 0), and one whose groups all score alike does not move the weights.
UNEVEN = "rollout.seed=1"


def config(run, *overrides):
    return load_config(DEFAULT_CONFIG, [*SMALL, f"train.output_dir={run}", *overrides])


def cli_args(run, *overrides):
    return ["train", *(a for o in [*SMALL, f"train.output_dir={run}", *overrides] for a in ("--set", o))]


def rows(run) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def without_timing(row: dict) -> dict:
    """A metrics row without what measures the process rather than the run (TIMING)."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def assert_same_run(a: Path, b: Path, step: int) -> None:
    """Run b trained as run a did: the same weights at checkpoint-`step`, the same metrics rows."""
    wa, wb = (weights(run / f"checkpoint-{step}" / "model") for run in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [without_timing(r) for r in rows(b)] == [without_timing(r) for r in rows(a)]


def first_digit(prompts, completions, **columns):
    """A reward any policy over digits can learn in a few steps, whatever the prompt, and one that
    varies within almost every group: the first character's digit value / 9 (0 for a non-digit)."""
    return [int(c[0]) / 9 if c[:1].isdigit() else 0.0 for c in completions]


def explode(prompts, completions, **columns):
    raise ValueError("this reward always fails")


FUSSY_FAILURES = []


def fussy(prompts, completions, **columns):
    """`first_digit`, but raises on a completion starting with an odd digit (and records it)."""
    odd = [c for c in completions if c[:1].isdigit() and int(c[0]) % 2]
    if odd:
        FUSSY_FAILURES.extend(odd)
        raise ValueError(f"cannot score {odd[0]!r}")
    return first_digit(prompts, completions)


# ----------------------------------------------------------------------------- a short run

@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """Three on-policy steps with a final checkpoint."""
    run = tmp_path_factory.mktemp("short")
    train(config(run, "train.max_steps=3"))
    return run


def test_metrics_have_one_row_per_step_with_the_spec_keys(short_run):
    run = short_run
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert SPEC_KEYS <= set(r), SPEC_KEYS - set(r)


def test_every_step_has_a_finite_loss_and_grad_norm(short_run):
    for r in rows(short_run):
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and not r["skipped"]


def test_on_policy_ratio_is_exactly_one(short_run):
    # SPEC 1: with mu = 1 and S = GA, old = logp.detach(); no token is ever clipped.
    for r in rows(short_run):
        assert r["kl_old/k1"] == 0.0 and r["kl_old/k3"] == 0.0
        assert r["clip_ratio/low"] == r["clip_ratio/high"] == r["clip_ratio/region"] == 0.0


def test_training_changes_every_weight_and_the_checkpoint_holds_them(short_run, embedded_dir):
    run = short_run
    assert latest_checkpoint(run).name == "checkpoint-3"
    before, after = weights(embedded_dir), weights(run / "checkpoint-3" / "model")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == []


def test_checkpoint_loads_in_transformers_with_rlcore_logits(short_run):
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    path = short_run / "checkpoint-3" / "model"
    ids = transformers.AutoTokenizer.from_pretrained(path)(["12+34="], return_tensors="pt")["input_ids"]
    assert ids.tolist() == [Tokenizer.from_dir(path).encode("12+34=")]  # the tokenizer travelled along
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model = load_model(path)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(model(ids)), hf(ids).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- learning

def test_reward_rises_on_a_learnable_reward(tmp_path):
    run = tmp_path / "run"
    train(config(run, "train.max_steps=24", "train.learning_rate=3e-3"))
    reward = [r["reward/mean"] for r in rows(run)]
    first, last = sum(reward[:6]) / 6, sum(reward[-6:]) / 6
    assert last > first + 0.2, reward  # from about 0.67 to 0.97 of the maximum, 1


def test_second_epoch_sees_moved_ratios_and_clips(tmp_path):
    # mu = 2: epoch 1 replays the round after one optimizer step, so pi_old != pi_theta.
    run = tmp_path / "run"
    train(config(run, "train.max_steps=6", "loss.num_iterations=2", "train.learning_rate=3e-2", UNEVEN))
    got = rows(run)
    assert [r["epoch"] for r in got] == [0, 1] * 3
    second = [r for r in got if r["epoch"] == 1]
    assert all(r["kl_old/k3"] > 1e-4 and abs(r["kl_old/k1"]) > 1e-4 for r in second), second
    assert max(r["clip_ratio/region"] for r in second) > 0
    first = [r for r in got if r["epoch"] == 0]  # same weights as pi_old: equal up to batching rounding
    assert all(r["kl_old/k3"] < 1e-9 and r["clip_ratio/region"] == 0 for r in first), first


def test_time_and_tokens_per_s_are_per_step_when_a_round_has_several(tmp_path):
    # S = 2, GA = 1, mu = 2: one round of 32 completions, 4 optimizer steps of 16 each. The
    # round's rollout/scoring/old-logp times go on its first step only, and each step's training
    # rate covers its own completion tokens over its own update time, so over the round they
    # add up to every completion token trained mu times.
    run = tmp_path / "run"
    train(config(run, "train.max_steps=4", "train.gradient_accumulation_steps=1", "train.steps_per_generation=2",
                 "loss.num_iterations=2"))
    got = rows(run)
    assert [r["epoch"] for r in got] == [0, 0, 1, 1]
    for key in ("time/rollout", "time/scoring", "time/old_logp"):
        assert got[0][key] > 0 and all(r[key] == 0.0 for r in got[1:]), key
    trained = sum(r["tokens_per_s/train"] * r["time/update"] for r in got)
    assert trained == pytest.approx(got[0]["completion/len_mean"] * 32 * 2, rel=1e-9)


@pytest.mark.parametrize("correction", [False, True])
def test_beta_trains_against_the_initial_policy_and_logs_kl_ref(correction, tmp_path, monkeypatch):
    # The reference is the initial policy: the first step's KL to it is zero (up to the batch
    # shapes' float rounding), after one update it is not. use_bias_correction_kl reaches the loss.
    seen, real = [], rlcore.train.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["options"].use_bias_correction_kl)
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.train, "policy_loss", spy)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "loss.beta=0.04", f"loss.use_bias_correction_kl={str(correction).lower()}"))
    got = rows(run)
    assert abs(got[0]["kl_ref"]) < 1e-7 and got[1]["kl_ref"] > 1e-5, [r["kl_ref"] for r in got]
    assert seen and set(seen) == {correction}


def test_tis_truncated_masks_and_reward_options_reach_the_loop_calls(tmp_path, monkeypatch):
    """The options the loop itself reads (not PolicyLossOptions'): loss.tis_mode's weights reach
    policy_loss, loss.mask_truncated_completions zeroes the loss mask of the truncated rows
    policy_loss sees, and loss.reward_weights / loss.scale_rewards reach compute_advantages. At
    temperature 2 some completions run past max_completion_length = 3 without EOS (6 and 7 of 16)."""
    seen = {"advantages": [], "truncated": [], "loss": []}
    calls = {name: getattr(rlcore.train, name) for name in ("compute_advantages", "mask_truncated", "policy_loss")}

    def compute_advantages(R, G, weights, scale, **kwargs):
        seen["advantages"].append((weights, scale))
        return calls["compute_advantages"](R, G, weights, scale, **kwargs)

    def mask_truncated(mask, truncated):
        seen["truncated"].append(int(truncated.sum()))
        return calls["mask_truncated"](mask, truncated)

    def policy_loss(logp, old, adv, mask, **kwargs):
        seen["loss"].append((int((mask.sum(-1) == 0).sum()), kwargs["tis_weights"]))
        return calls["policy_loss"](logp, old, adv, mask, **kwargs)

    for spy in (compute_advantages, mask_truncated, policy_loss):
        monkeypatch.setattr(rlcore.train, spy.__name__, spy)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "rollout.max_completion_length=3", "rollout.temperature=2.0",
                 "loss.tis_mode=token_truncate", "loss.mask_truncated_completions=true", "loss.scale_rewards=batch",
                 "loss.reward_weights=[1.0, 0.5]",
                 f"loss.reward_funcs=['{__name__}:first_digit', '{__name__}:extra_and_metric']"))
    assert seen["advantages"] == [([1.0, 0.5], "batch")] * 2
    assert 0 < sum(seen["truncated"]) < 32
    assert [masked for masked, _ in seen["loss"]] == seen["truncated"]  # one micro-batch per round: all 16 rows
    assert all(w is not None and w.shape[0] == 16 for _, w in seen["loss"])
    for r in rows(run):  # the round's TIS weights' mean (policy_loss) and the fraction truncate changed
        assert math.isfinite(r["tis/mean"]) and 0 < r["tis/mean"] <= 2.0 and math.isfinite(r["tis/frac_changed"])


def extra_and_metric(prompts, completions, log_extra, log_metric, **columns):
    """A TRL-style reward that logs a column at once, another one completion at a time (TRL
    appends), and a metric once per completion; it scores 0.5."""
    log_extra("starts_with", [c[:1] for c in completions])
    for c in completions:
        log_extra("length_chars", [len(c)])
    for score in first_digit(prompts, completions):
        log_metric("custom/first_digit", score)
    return [0.5] * len(completions)


def logs_loss(prompts, completions, log_metric, **columns):
    log_metric("loss", 123.0)  # a training metric (not a held-out one: the evaluation before training passes)
    return [0.5] * len(completions)


def test_a_log_metric_name_that_is_one_of_rlcores_metrics_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"log_metric name 'loss' is one of rlcore's own metrics; log it "
                                         r"under another name \(e\.g\. 'custom/loss'\)"):
        train(config(tmp_path / "run", "train.max_steps=1", f"loss.reward_funcs=['{__name__}:logs_loss']"))


def logged_metric_is_the_mean_over_the_round(run, per_round, steps_per_round=1):
    """custom/first_digit of each step is first_digit's mean over its round in completions.jsonl."""
    got = [json.loads(ln) for ln in (run / "completions.jsonl").read_text().splitlines()]
    want = [sum(r["rewards"][f"{__name__}:first_digit"] for r in got[k:k + per_round]) / per_round
            for k in range(0, len(got), per_round) for _ in range(steps_per_round)]
    return [m["custom/first_digit"] for m in rows(run)] == pytest.approx(want, rel=1e-6)


def test_log_completions_writes_every_completion_with_its_rewards_and_advantage(tmp_path, capsys, monkeypatch):
    lengths, real = [], rlcore.rollout.generate

    def generate(*args, **kwargs):  # records each rollout's lengths in tokens
        ro = real(*args, **kwargs)
        lengths.extend(ro.lengths.tolist() if kwargs["temperature"] > 0 else [])  # not the greedy evaluation
        return ro

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=4", "loss.num_iterations=2", "train.log_completions=true",
                 "train.num_completions_to_print=2",
                 f"loss.reward_funcs=['{__name__}:first_digit', '{__name__}:extra_and_metric']"))
    got = [json.loads(ln) for ln in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1] * 16 + [3] * 16  # a round's first step (mu = 2), 16 completions each
    assert [r["length"] for r in got] == lengths  # tokens, the stop token included (the engine's completion_mask)
    for r in got:  # the scores, recomputed from the logged text
        assert r["rewards"] == pytest.approx({f"{__name__}:first_digit": first_digit([r["prompt"]], [r["completion"]])[0],
                                              f"{__name__}:extra_and_metric": 0.5}, rel=1e-6)  # fp32
        assert r["starts_with"] == r["completion"][:1] and r["length_chars"] == len(r["completion"])
    for k in range(0, 32, 4):  # advantages: (r - group mean) / (group std + 1e-4), weights 1
        total = torch.tensor([sum(r["rewards"].values()) for r in got[k:k + 4]], dtype=torch.float64)
        want = (total - total.mean()) / (total.std() + 1e-4)
        assert [r["advantage"] for r in got[k:k + 4]] == pytest.approx(want.tolist(), abs=1e-5)
    out = capsys.readouterr().out
    assert "completion 1/16:" in out and "completion 9/16:" in out and out.count("  completion ") == 2 * 2
    assert logged_metric_is_the_mean_over_the_round(run, 16, steps_per_round=2)


def test_a_fresh_run_does_not_append_to_a_crashed_attempts_completions(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "completions.jsonl").write_text('{"step": 1, "prompt": "from the attempt that crashed"}\n')
    train(config(run, "train.max_steps=1", "train.log_completions=true", "train.num_completions_to_print=0"))
    got = [json.loads(ln) for ln in (run / "completions.jsonl").read_text().splitlines()]
    assert len(got) == 16 and all(r["prompt"] != "from the attempt that crashed" for r in got)


def test_max_grad_norm_zero_means_no_clipping(tmp_path, embedded_dir):
    # 0.0 is documented as "no clipping"; clip_grad_norm_(.., 0.0) would zero every gradient.
    for name, value in (("zero", "0.0"), ("huge", "1e9")):
        train(config(tmp_path / name, "train.max_steps=2", f"train.max_grad_norm={value}"))
    a, b = weights(tmp_path / "zero" / "checkpoint-2" / "model"), weights(tmp_path / "huge" / "checkpoint-2" / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    before = weights(embedded_dir)
    assert not any(torch.equal(a[k], before[k]) for k in a)


def record_step_gradients(monkeypatch) -> list[torch.Tensor]:
    """Make the loop's optimizer record, at each step, the gradient it steps with (after the
    averaging over ranks and the clipping), as one flat fp64 vector."""
    seen, real = [], rlcore.run.setup.adamw

    def adamw(model, tc):
        opt = real(model, tc)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(torch.cat(
            [p.grad.reshape(-1).double() for g in o.param_groups for p in g["params"] if p.grad is not None])))
        return opt

    monkeypatch.setattr(rlcore.run.setup, "adamw", adamw)
    return seen


def test_max_grad_norm_clips_the_gradient_the_optimizer_steps_with(tmp_path, monkeypatch):
    # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6): the optimizer gets a gradient of
    # norm 1e-3 (up to that 1e-6); grad_norm logs the norm before clipping, far above it.
    grads = record_step_gradients(monkeypatch)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "train.max_grad_norm=1e-3"))
    assert len(grads) == 2
    for g, r in zip(grads, rows(run)):
        assert r["grad_norm"] > 0.1
        assert g.norm().item() == pytest.approx(1e-3, rel=1e-5)


def test_dapo_divides_by_the_tokens_of_the_whole_step_under_gradient_accumulation(tmp_path, monkeypatch):
    """SPEC 5's dapo: sum over the step's tokens of l / (active tokens of the whole step). GA = 2
    micro-batches of 8 must give the step the loss and gradient of GA = 1 with all 16: the round is
    the same (S = GA, so b * S = 16 completions sampled in one call either way, and one shuffle of
    the 16 rows, cut in two), and each micro-batch divides by the 16 rows' tokens, not its own.
    Clipping is off so the gradients are compared at their own scale."""
    grads = record_step_gradients(monkeypatch)
    for name, geometry in (("ga1", ["train.per_device_train_batch_size=16"]),
                           ("ga2", ["train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=2"])):
        train(config(tmp_path / name, "train.max_steps=1", "train.max_grad_norm=0.0", "train.log_completions=true",
                     "train.num_completions_to_print=0", UNEVEN, *geometry))
    texts = [(tmp_path / name / "completions.jsonl").read_text() for name in ("ga1", "ga2")]
    assert texts[0] == texts[1]  # the same completions, rewards and advantages
    (one,), (two,) = rows(tmp_path / "ga1"), rows(tmp_path / "ga2")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5) and abs(one["loss"]) > 1e-4
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7 * grads[0].abs().max().item())


def test_gradient_checkpointing_trains_to_the_same_weights(tmp_path, monkeypatch):
    # The model's recomputation is checked against per-row passes in test_shared_prompt.py; here
    # the loop turns it on (layers run twice: forward, and again in backward) and, on CPU in fp32
    # where the rerun gives the same numbers, ends at the same weights and metrics as without it.
    from rlcore.models.transformer import Block

    calls, forward = {"n": 0}, Block.forward

    def counting(self, *args):
        calls["n"] += torch.is_grad_enabled()
        return forward(self, *args)

    monkeypatch.setattr(Block, "forward", counting)
    counts = {}
    for name, on in (("plain", "false"), ("recompute", "true")):
        calls["n"] = 0
        train(config(tmp_path / name, "train.max_steps=2", f"train.gradient_checkpointing={on}"))
        counts[name] = calls["n"]
    assert counts["recompute"] > counts["plain"] > 0
    assert_same_run(tmp_path / "recompute", tmp_path / "plain", 2)


@pytest.mark.parametrize("limit, kept", [("1", [3]), ("2", [2, 3]), ("4", [1, 2, 3]), ("none", [1, 2, 3])])
def test_save_total_limit_keeps_the_newest_checkpoints(limit, kept, tmp_path):
    run = tmp_path / "run"
    train(config(run, "train.max_steps=3", "train.save_steps=1", f"train.save_total_limit={limit}"))
    assert sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*")) == kept
    assert latest_checkpoint(run).name == "checkpoint-3"


def test_logged_lr_is_the_rate_the_step_used(tmp_path):
    # rlcore's warmup: step s (0-based) runs at lr * (s + 1) / (warmup + 1).
    run = tmp_path / "run"
    train(config(run, "train.max_steps=4", "train.lr_scheduler_type=constant_with_warmup",
                 "train.warmup_steps=2"))
    assert [r["lr"] for r in rows(run)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], rel=1e-12)


@pytest.mark.parametrize("mu", [1, 2])  # on-policy the trainer's side is logp.detach()
def test_mismatch_metrics_compare_engine_and_trainer_logprobs(tmp_path, monkeypatch, mu):
    # Shift the engine's sampling log-probs by c: then old - samp = c (+ fp32 noise) on every
    # valid token, and the k3 estimate of KL(samp || old) is e^c - 1 - c (samples come from samp).
    import dataclasses

    c, real = 0.5, rlcore.rollout.generate

    def generate_shifted(*args, **kwargs):
        ro = real(*args, **kwargs)
        return dataclasses.replace(ro, sampling_logprobs=ro.sampling_logprobs - c)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate_shifted)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", f"loss.num_iterations={mu}"))
    for r in rows(run):
        assert r["mismatch/abs_mean"] == pytest.approx(c, abs=1e-4)
        assert r["mismatch/k3"] == pytest.approx(math.exp(c) - 1 - c, abs=1e-4)


def test_tis_weights_the_loss_by_the_trainer_to_engine_ratio_clamped_at_tis_max(tmp_path, monkeypatch):
    # The engine's log-probs shifted by -c make exp(old - samp) = e^c on every valid token (the shift
    # changes no draw: the same completions and advantages). On-policy the per-token loss is linear
    # in its weight, so token_truncate with tis_max above e^c scales the step's loss by e^c, and with
    # tis_max below it by tis_max, every weight changed. Swapping old and samp would give e^-c.
    import dataclasses

    c, real = 0.5, rlcore.rollout.generate

    def generate_shifted(*args, **kwargs):
        ro = real(*args, **kwargs)
        return dataclasses.replace(ro, sampling_logprobs=ro.sampling_logprobs - c)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate_shifted)
    train(config(tmp_path / "plain", "train.max_steps=1", UNEVEN))
    (plain,) = rows(tmp_path / "plain")
    assert abs(plain["loss"]) > 1e-4
    for tis_max, weight, changed in ((3.0, math.exp(c), 0.0), (1.2, 1.2, 1.0)):
        run = tmp_path / f"tis{tis_max}"
        train(config(run, "train.max_steps=1", "loss.tis_mode=token_truncate", f"loss.tis_max={tis_max}", UNEVEN))
        (r,) = rows(run)
        assert r["tis/mean"] == pytest.approx(weight, rel=1e-4) and r["tis/frac_changed"] == changed
        assert r["loss"] == pytest.approx(weight * plain["loss"], rel=1e-4)


@pytest.mark.parametrize("mu", [1, 2])  # the training forward's log-probs (mu = 1), the old pass's (mu = 2)
def test_trainer_logprobs_use_the_rollout_temperature(tmp_path, mu):
    # The engine samples from softmax(z / 0.7) and reports those log-probs; the trainer's must
    # divide by the same temperature, and then agree with them to fp32 rounding (~1e-6; the test
    # above). At temperature 1 they would differ by far more than 1e-4.
    run = tmp_path / "run"
    train(config(run, "train.max_steps=1", "rollout.temperature=0.7", f"loss.num_iterations={mu}"))
    (r,) = rows(run)
    assert r["mismatch/abs_mean"] < 1e-4 and r["mismatch/abs_max"] < 1e-4, r


def test_bf16_on_cpu_trains_with_a_bf16_rollout(tmp_path, monkeypatch):
    # train.bf16: rollout in bf16, trainer forwards under bf16 autocast (log-probs in fp32). The
    # loop measures engine vs trainer log-probs (with mu = 2 from the old pass): in fp32 they
    # agree to ~1e-6 (the test above), in bf16 they differ by bf16 rounding. Which half ran in
    # bf16 is checked at the calls (each half's numbers are tested in test_rollout.py and
    # test_shared_prompt.py).
    calls = {"rollout": [], "forward": []}
    real_generate, real_logprobs = rlcore.rollout.generate, rlcore.train.completion_logprobs

    def generate(*args, **kwargs):
        if kwargs["temperature"] > 0:  # the training rollouts (greedy eval runs in the model's dtype)
            calls["rollout"].append(kwargs.get("dtype"))
        return real_generate(*args, **kwargs)

    def completion_logprobs(model, ids, attn, Lp, cids, temperature, amp, *rest):
        calls["forward"].append(amp)
        return real_logprobs(model, ids, attn, Lp, cids, temperature, amp, *rest)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    monkeypatch.setattr(rlcore.train, "completion_logprobs", completion_logprobs)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "loss.num_iterations=2", "train.bf16=true"))
    assert calls["rollout"] and set(calls["rollout"]) == {torch.bfloat16}
    assert calls["forward"] and set(calls["forward"]) == {torch.bfloat16}  # old pass and training forwards
    got = rows(run)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and not r["skipped"] for r in got)
    assert all(1e-4 < r["mismatch/abs_mean"] < 0.1 for r in got), [r["mismatch/abs_mean"] for r in got]
    fp32 = tmp_path / "fp32"
    train(config(fp32, "train.max_steps=2", "loss.num_iterations=2"))
    assert all(r["mismatch/abs_mean"] < 1e-4 for r in rows(fp32))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_freed_memory_keeps_large_tensors_on_the_heap(reuse):
    # A fresh process holds and frees a 256 MiB tensor. glibc's own counters (mallinfo2) show
    # where it lived: by default in its own mmap (returned to the kernel on free); after
    # reuse_freed_memory() in the heap, which keeps it after the free.
    code = f"""
import ctypes, torch
from rlcore.run.setup import reuse_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
assert reuse_freed_memory() if {reuse} else True
x = torch.ones(64 * 2**20)
held = libc.mallinfo2()
del x
print(held.hblkhd >> 20, libc.mallinfo2().arena >> 20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mmapped_mib, heap_after_free_mib = map(int, out.stdout.split())
    if reuse:
        assert mmapped_mib < 64 and heap_after_free_mib >= 256, out.stdout
    else:
        assert mmapped_mib >= 256 and heap_after_free_mib < 256, out.stdout


# ----------------------------------------------------------------------------- dynamic sampling

def first_digit_if_odd_sum(prompts, completions, answer, **columns):
    """`first_digit` for the prompts whose answer is odd, 0.5 for the others: only about half the
    groups can have rewards that differ."""
    return [first_digit([p], [c])[0] if int(a) % 2 else 0.5 for p, c, a in zip(prompts, completions, answer)]


def completions_by_step(run) -> dict[int, list[dict]]:
    out = {}
    for line in (run / "completions.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], []).append(record)
    return out


def judged(record, name="first_digit_if_odd_sum") -> float:
    return record["rewards"][f"{__name__}:{name}"]


FILTERED = ["rollout.filter_groups=true", "train.log_completions=true", "train.num_completions_to_print=0"]


def test_dynamic_sampling_trains_on_groups_whose_judged_rewards_differ_with_their_own_advantages(tmp_path):
    """With rollout.filter_groups_metric naming one of two reward functions, every group a round
    trains on has scores of that function that differ (the other function varies in every group);
    its advantages are those of its own group, as without the filter. A round samples generation
    batches of N/G = 4 prompts until 4 groups are kept, and the data position moves by every
    prompt sampled: the rounds' prompts are the stream's, in order, with the dropped ones skipped."""
    run = tmp_path / "run"
    train(config(run, "train.max_steps=4", *FILTERED, "rollout.filter_groups_metric="
                 f"{__name__}:first_digit_if_odd_sum",
                 f"loss.reward_funcs=['{__name__}:first_digit_if_odd_sum', '{__name__}:first_digit']"))
    metrics, logged = rows(run), completions_by_step(run)
    assert [len(logged[step]) for step in (1, 2, 3, 4)] == [16] * 4
    for step, records in logged.items():
        for k in range(0, 16, 4):
            group = records[k:k + 4]
            assert len({judged(r) for r in group}) > 1 and len({r["prompt"] for r in group}) == 1
            total = torch.tensor([sum(r["rewards"].values()) for r in group], dtype=torch.float64)
            want = (total - total.mean()) / (total.std() + 1e-4)
            assert [r["advantage"] for r in group] == pytest.approx(want.tolist(), abs=1e-5)
    batches = [m["dynamic_sampling/gen_batches"] for m in metrics]
    assert max(batches) > 1  # some round needed more prompts than one batch holds
    assert [m["dynamic_sampling/groups_sampled"] for m in metrics] == [4 * b for b in batches]
    assert all(4 <= m["dynamic_sampling/groups_kept"] <= m["dynamic_sampling/groups_sampled"] for m in metrics)
    consumed = [m["dynamic_sampling/prompts_consumed"] for m in metrics]
    assert consumed == [4 * sum(batches[:i + 1]) for i in range(4)]
    assert all(m["frac_reward_zero_std"] == 0.0 for m in metrics)  # the total varies in every group anyway
    stream = rlcore.train.next_prompts(load_examples_of(run), 0, consumed[-1], 42)
    trained = [r["prompt"] for step in (1, 2, 3, 4) for r in logged[step][::4]]
    positions = [next(i for i in range(len(stream)) if stream[i]["prompt"] == p) for p in trained]
    assert positions == sorted(positions) and all(int(stream[i]["answer"]) % 2 for i in positions)


def load_examples_of(run) -> list[dict]:
    from rlcore.data.datasets import load_examples

    return load_examples(load_config(str(run / "config.toml")).data)[0]


def test_dynamic_sampling_at_its_cap_fills_the_round_with_dropped_groups_and_warns(tmp_path):
    """docs/loop.md's rule: a round that reaches rollout.max_num_gen_batches with fewer than N/G
    kept groups trains on them first, then on groups the filter dropped, first sampled first, to
    make N/G: every rank holds its n rows, and those groups train as without the filter (the
    judged rewards are the only ones here, so their advantages are all 0)."""
    run = tmp_path / "run"
    with pytest.warns(RlcoreWarning, match=r"dynamic sampling kept \d of 4 groups in 1 generation batches "
                                           r"\(rollout\.max_num_gen_batches = 1\); the round trains on them and on "
                                           r"\d more that the filter dropped"):
        train(config(run, "train.max_steps=6", *FILTERED, "rollout.max_num_gen_batches=1",
                     f"loss.reward_funcs=['{__name__}:first_digit_if_odd_sum']"))
    metrics, logged = rows(run), completions_by_step(run)
    assert all(m["dynamic_sampling/gen_batches"] == 1 for m in metrics)
    short = [m["step"] for m in metrics if m["dynamic_sampling/groups_kept"] < 4]
    assert short  # with 4 prompts a batch and about half of them odd
    for m in metrics:
        records, kept = logged[m["step"]], m["dynamic_sampling/groups_kept"]
        assert len(records) == 16 and m["frac_reward_zero_std"] == (4 - kept) / 4
        for k in range(0, 16, 4):
            group = records[k:k + 4]
            assert (len({judged(r) for r in group}) > 1) == (k < 4 * kept)  # the kept ones first
            if k >= 4 * kept:
                assert all(r["advantage"] == 0.0 for r in group)


def test_dynamic_sampling_that_keeps_no_group_at_its_cap_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"dynamic sampling kept no group in 2 generation batches of 4 prompts "
                                         r"\(rollout\.max_num_gen_batches = 2\).*raise "
                                         r"rollout\.max_num_gen_batches \(0 = no cap\)"):
        train(config(tmp_path / "run", "train.max_steps=2", "rollout.filter_groups=true",
                     "rollout.max_num_gen_batches=2", f"loss.reward_funcs=['{__name__}:constant']"))


def constant(prompts, completions, **columns):
    return [1.0] * len(completions)


@pytest.mark.filterwarnings("ignore:step .* dynamic sampling kept")  # the test model seldom varies: the cap
def test_the_dapo_recipe_trains_with_its_four_techniques_and_a_sampled_evaluation(tmp_path):
    """configs/dapo.toml, shortened to two rounds: clip-higher (off-policy, two steps a round), the
    token-level loss, dynamic sampling judged on accuracy alone, the overlong penalty beside it, no
    KL; every group it trains on differs in accuracy, and the evaluation reports mean@8, pass@k, maj@8."""
    run = tmp_path / "run"
    cfg = load_config(str(Path(__file__).parent.parent / "configs" / "dapo.toml"),
                      [f"data.seed={SEED}", f"data.num_eval={NUM_EVAL}", "data.num_train=256", "train.max_steps=4",
                       "train.per_device_train_batch_size=32", "train.eval_steps=0", "train.save_steps=0",
                       "train.log_completions=true", "train.num_completions_to_print=0", f"train.output_dir={run}"])
    assert (cfg.loss.epsilon, cfg.loss.epsilon_high, cfg.loss.loss_type, cfg.loss.beta) == (0.2, 0.28, "dapo", 0.0)
    train(cfg)
    metrics, logged = rows(run), completions_by_step(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all("kl_old/k3" in m for m in metrics)  # off-policy
    assert sorted(logged) == [1, 3]  # a round of 32 prompts (S = 2), 8 completions each, two steps
    for m in metrics[::2]:
        records, kept = logged[m["step"]], min(m["dynamic_sampling/groups_kept"], 8)
        assert len(records) == 64 and m["frac_reward_zero_std"] == (8 - kept) / 8
        for k in range(0, 64, 8):  # the kept groups first, then (at the cap) dropped ones
            assert (len({r["rewards"]["accuracy"] for r in records[k:k + 8]}) == 2) == (k < 8 * kept)
            assert {r["rewards"]["soft_overlong_punishment"] for r in records[k:k + 8]} <= {0.0, -1.0}
    final = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert {"eval/accuracy", "eval/mean@8", "eval/pass@1", "eval/pass@8", "eval/maj@8"} <= set(final)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("override, named", [
    ("train.learnig_rate=1e-3", ["unknown config key train.learnig_rate", "did you mean train.learning_rate?"]),
    ("train.max_steps=many", ["train.max_steps = 'many' has type str, expected an int"]),
    ("train.per_device_train_batch_size=6", ["6 * 1 * 1 = 6 completions is not divisible by "
                                             "rollout.num_generations = 8"]),
])
def test_cli_config_error_exits_2_naming_the_key(override, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: config error:")
    for text in named:
        assert text in err
    assert list(tmp_path.iterdir()) == []  # no run directory for a config that cannot run


def aggregate_nan_on(monkeypatch, bad_steps, gradient_too=True):
    """Make the loss of the listed 1-based optimizer steps NaN (one micro-batch per step here),
    and its gradient too, or (gradient_too=False) the loss alone: a NaN constant added."""
    import rlcore.train

    real, calls = rlcore.train.aggregate_loss, []

    def aggregate(*args, **kwargs):
        calls.append(None)
        loss = real(*args, **kwargs)
        if len(calls) not in bad_steps:
            return loss
        return loss * math.nan if gradient_too else loss + torch.tensor(math.nan)

    monkeypatch.setattr(rlcore.train, "aggregate_loss", aggregate)


@pytest.mark.parametrize("gradient_too", [True, False])
def test_nonfinite_loss_skips_the_step_and_is_counted(gradient_too, tmp_path, monkeypatch):
    import rlcore.run.rundir

    snapshots, real = {}, rlcore.run.rundir.save_checkpoint

    def save_and_snapshot(run, step, model, *args, **kwargs):
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return real(run, step, model, *args, **kwargs)

    monkeypatch.setattr(rlcore.run.rundir, "save_checkpoint", save_and_snapshot)
    aggregate_nan_on(monkeypatch, {2}, gradient_too)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=3", "train.save_steps=1"))
    got = rows(run)
    assert [r["skipped"] for r in got] == [False, True, False]
    assert [r["nonfinite_total"] for r in got] == [0, 1, 1]
    assert got[1]["loss"] is None  # NaN is written as null (strict JSON)
    assert all(torch.equal(snapshots[1][k], snapshots[2][k]) for k in snapshots[1])  # step 2 did nothing
    assert not all(torch.equal(snapshots[2][k], snapshots[3][k]) for k in snapshots[2])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no step ever ran
def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    aggregate_nan_on(monkeypatch, set(range(1, 100)))
    run = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"2 non-finite steps in a row \(train.max_nonfinite_steps=2\)"):
        train(config(run, "train.max_steps=5", "train.max_nonfinite_steps=2"))
    got = rows(run)  # the step that stopped the run has its row
    assert [(r["step"], r["skipped"], r["nonfinite_total"]) for r in got] == [(1, True, 1), (2, True, 2)]


STATES = []


def record_trainer_state(prompts, completions, trainer_state, **columns):
    STATES.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch,
                   trainer_state.num_train_epochs))
    return first_digit(prompts, completions)


def test_reward_functions_see_the_step_and_the_passes_over_the_prompts_done_before_the_round(tmp_path):
    """TRL's trainer_state: global_step and epoch as of the round's scoring. SMALL's rounds are 16
    completions of 4 prompts out of 256 training prompts: epoch = 4 * round / 256. The held-out
    evaluations before and after training call the function too, as of their step."""
    STATES.clear()
    train(config(tmp_path / "run", "train.max_steps=3", f"loss.reward_funcs=['{__name__}:record_trainer_state']"))
    rounds = [(0, 3, 0.0, 3.0), (1, 3, 4 / 256, 3.0), (2, 3, 8 / 256, 3.0)]  # 3.0: TRL's default
    assert STATES == [(0, 3, 0.0, 3.0), *rounds, (3, 3, 12 / 256, 3.0)]


def test_reward_function_that_raises_stops_the_run_naming_it_and_the_sample(tmp_path):
    with pytest.raises(RuntimeError, match=r"reward function explode raised ValueError: this reward always "
                                           r"fails on sample 0: prompt='\d+\+\d+=', completion='") as err:
        train(config(tmp_path / "run", "train.max_steps=2", f"loss.reward_funcs=['{__name__}:explode']"))
    assert "--set loss.reward_on_error=none" in str(err.value)  # the fix, as a config option


BAD_RETURN_CALLS = []


def held_out(prompts) -> bool:
    """Held-out prompts are distinct; a round's repeat each one G = 4 times."""
    return len(set(prompts)) == len(prompts)


def bad_on_held_out(prompts, completions, **columns):
    """first_digit on a round's completions; one score too few on the held-out prompts."""
    BAD_RETURN_CALLS.append(len(completions))
    scores = first_digit(prompts, completions)
    return scores[1:] if held_out(prompts) else scores


def test_a_reward_function_returning_bad_values_stops_the_run_at_the_baseline_evaluation(tmp_path):
    """The held-out evaluation before training is a reward function's first call: a function that
    returns the wrong number of scores stops the run there, before the first rollout."""
    BAD_RETURN_CALLS.clear()
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"reward function bad_on_held_out returned {NUM_EVAL - 1} "
                                         rf"scores for {NUM_EVAL} completions"):
        train(config(run, "train.max_steps=2", f"loss.reward_funcs=['{__name__}:bad_on_held_out']"))
    assert BAD_RETURN_CALLS == [NUM_EVAL]  # one call, on the held-out completions
    assert not (run / "metrics.jsonl").exists() and not (run / "eval.jsonl").exists()


HELD_OUT_JUDGE = {"down_from_step": None}  # set by a test: the step from which `held_out_judge` fails


def held_out_judge(prompts, completions, trainer_state, **columns):
    """first_digit, from a judge that may be down for held-out prompts from a step on (HELD_OUT_JUDGE)."""
    down = HELD_OUT_JUDGE["down_from_step"]
    if down is not None and trainer_state.global_step >= down and held_out(prompts):
        raise TimeoutError("the judge timed out")
    return first_digit(prompts, completions)


def test_a_reward_function_failing_in_a_held_out_evaluation_keeps_the_steps_before_it(tmp_path, capsys, monkeypatch):
    """No checkpoint is due before the end (save_steps = 0), and the evaluation after step 2 fails:
    the run keeps checkpoint-2, and --resume from it trains as a run that never failed (the
    failed evaluation's row is not redone)."""
    steps = ["train.max_steps=3", "train.eval_steps=2", f"loss.reward_funcs=['{__name__}:held_out_judge']"]
    assert main(cli_args(tmp_path / "a", *steps)) == 0
    monkeypatch.setitem(HELD_OUT_JUDGE, "down_from_step", 2)
    assert main(cli_args(tmp_path / "b", *steps)) == 1
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-2"
    assert "keeps checkpoint-2, the run as it was when the function failed" in capsys.readouterr().err
    assert [r["step"] for r in rows(tmp_path / "b")] == [1, 2]
    monkeypatch.setitem(HELD_OUT_JUDGE, "down_from_step", None)
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    assert_same_run(tmp_path / "a", tmp_path / "b", 3)
    evals = [[json.loads(ln)["step"] for ln in (run / "eval.jsonl").read_text().splitlines()] for run in
             (tmp_path / "a", tmp_path / "b")]
    assert evals == [[0, 2, 3], [0, 3]]


def logs_accuracy(prompts, completions, log_metric, **columns):
    log_metric("accuracy", 1.0)  # would overwrite the held-out accuracy, eval/accuracy
    return first_digit(prompts, completions)


def test_a_log_metric_name_clashing_with_a_held_out_metric_stops_the_run_at_the_baseline(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"log_metric name 'accuracy' is logged as eval/accuracy in the held-out "
                                         r"evaluation, one of rlcore's own held-out metrics; .* 'custom/accuracy'"):
        train(config(run, "train.max_steps=2", f"loss.reward_funcs=['{__name__}:logs_accuracy']"))
    assert not (run / "metrics.jsonl").exists()  # before the first rollout


def test_reward_on_error_none_scores_failures_as_none_and_continues(tmp_path):
    run = tmp_path / "run"
    FUSSY_FAILURES.clear()
    train(config(run, "train.max_steps=3", f"loss.reward_funcs=['{__name__}:fussy']", "loss.reward_on_error=none"))
    got = rows(run)
    assert FUSSY_FAILURES  # the function did raise
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward/mean"]) for r in got)


def test_bad_jsonl_row_names_the_file_and_line(tmp_path, embedded_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=",\n')
    with pytest.raises(DataError, match=re.escape(f"{data}:3: not valid JSON")):
        train(config(tmp_path / "run", "data.task=jsonl", f"data.path={data}", f"model.path={embedded_dir}",
                     "data.num_eval=1"))
    assert not (tmp_path / "run").exists()  # a failed start leaves no run directory behind


@pytest.mark.parametrize("num_eval", [0, 2])
def test_no_held_out_answers_means_no_accuracy_rather_than_zero(tmp_path, embedded_dir, capsys, num_eval):
    data = tmp_path / "train.jsonl"  # prompts only: a custom reward scores them, the task's accuracy cannot
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(12)))
    run = tmp_path / "run"
    assert main(cli_args(run, "data.task=jsonl", f"data.path={data}", "data.answer_column=",
                         f"model.path={embedded_dir}", f"data.num_eval={num_eval}", "train.max_steps=2",
                         "train.eval_steps=1", "train.logging_steps=1")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "held-out accuracy: none (no held-out prompt with an answer: data.num_eval, data.answer_column)"
    why = "data.num_eval = 0" if num_eval == 0 else \
        "none of the 2 held-out prompts has an answer to check (data.answer_column = '')"
    assert f"no held-out accuracy: {why}" in out and not [ln for ln in out if "held-out accuracy 0" in ln]
    # the reward function scores the held-out completions (before, after step 1, after), accuracy absent
    evals = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], "eval/accuracy" in e, "eval/reward/mean" in e) for e in evals] == \
        ([(0, False, True), (1, False, True), (2, False, True)] if num_eval else [])
    assert [r["reward/accuracy"] for r in rows(run)] == [None, None]  # null, not 0
    assert [m.group(1) for ln in out if (m := re.match(r"step +\d+/2 .*  acc (\S+)  ", ln))] == ["-", "-"]
    assert all(r["reward/mean"] is not None for r in rows(run))  # the reward function did score them


# ----------------------------------------------------------------------------- warm start, progress, seeds

def test_the_embedded_warm_start_trains_on_a_fixed_thread_count(tmp_path, monkeypatch):
    """Whatever the process's count (torchrun sets OMP_NUM_THREADS=1), the SFT runs on 2 threads,
    so every first run builds the same model; the process's count is restored after."""
    import rlcore.models.embedded

    seen = []
    monkeypatch.setattr(rlcore.models.embedded, "sft", lambda *a, **k: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_embedded_model(tmp_path / "m", unique_problems("arithmetic", 20, 0), steps=1)
        assert seen == [2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_progress_lines_cover_the_first_and_last_step_whatever_logging_steps_is(tmp_path, capsys):
    train(config(tmp_path / "run", "train.max_steps=3", "train.logging_steps=100"))
    steps = re.findall(r"^step +(\d+)/3 ", capsys.readouterr().out, re.M)
    assert steps == ["1", "3"]


def test_rollout_seed_alone_changes_the_samples(tmp_path):
    """rollout.seed drives sampling, train.seed the micro-batch order: they are separate."""
    a, b, c = (tmp_path / n for n in "abc")
    for run, seed in ((a, 1), (b, 1), (c, 2)):
        train(config(run, "train.max_steps=1", f"rollout.seed={seed}", "train.seed=5"))
    assert rows(a)[0]["reward/mean"] == rows(b)[0]["reward/mean"]
    assert rows(a)[0]["reward/mean"] != rows(c)[0]["reward/mean"]


# ----------------------------------------------------------------------------- data parallel

def torchrun(tmp_path, *args, script=None):
    """2 ranks of `rlcore` with `args`, or of the Python file `script` with them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}  # first_digit
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *(["-m", "rlcore.cli"] if script is None else [str(script)]), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def doubling_examples(tok: Tokenizer) -> list[dict]:
    """Eleven held-out examples, "0+0=" .. "10+10=", six of which end in an even digit."""
    return [{"prompt": f"{i}+{i}=", "prompt_ids": tok.encode(f"{i}+{i}=")} for i in range(11)]


def ends_even(prompts, completions, **columns):
    """An accuracy function that scores by prompt: 1 when the prompt's last digit is even."""
    return [1.0 if int(p.rstrip("=")[-1]) % 2 == 0 else 0.0 for p in prompts]


def by_prompt_rewards():
    """EvalRewards whose scores are known from the prompts "i+i=" alone: the first function scores
    i, None when i is a multiple of 3; the second scores nothing; weights 2 and 1. So the first's
    held-out mean is (1+2+4+5+7+8+10) / 7 = 37/7, the weighted reward's 74/7 (the rows the first
    scored), the second's None; log_metric("custom/batch") records each call's prompt count."""
    from rlcore.evaluation import EvalRewards

    def score(prompts, completions, columns, completion_ids, logged, tool_kwargs):
        assert len(completion_ids) == len(completions) and tool_kwargs == {}  # no tools
        logged["custom/batch"].append(float(len(prompts)))
        i = [int(p.split("+")[0]) for p in prompts]
        return torch.tensor([[math.nan if k % 3 == 0 else float(k), math.nan] for k in i])

    return EvalRewards(["first", "second"], [2.0, 1.0], score)


BY_PROMPT = {"eval/reward/mean": 74 / 7, "eval/reward/first/mean": 37 / 7, "eval/reward/second/mean": None}


def _evaluate_on_rank(rank, init_file, out_dir, model_dir):
    """`evaluate` on one of 2 gloo ranks, in batches of 4, with an accuracy function that scores
    by prompt (the prompts ending in an even number) and records the prompts it was given; the
    progress lines (every batch, as if each took long) go to printed{rank}.txt."""
    import contextlib
    import io

    import torch.distributed as dist

    from rlcore.evaluation import evaluate

    seen = []

    def accuracy(prompts, completions, **columns):
        seen.extend(prompts)
        return ends_even(prompts, completions)

    tok = Tokenizer.from_dir(model_dir)
    examples = doubling_examples(tok)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rlcore.run.steplog.PROGRESS_AFTER_S = -1.0
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        got = evaluate(load_model(model_dir), tok, examples, accuracy, 4, batch_size=4, rank=rank, world=2,
                       rewards=by_prompt_rewards())
    (Path(out_dir) / f"seen{rank}.json").write_text(json.dumps(seen))
    (Path(out_dir) / f"printed{rank}.txt").write_text(printed.getvalue())
    (Path(out_dir) / f"accuracy{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
    exit_spawned_rank()  # conftest: without it, 1 run in ~30 aborted as the process exited


def test_a_long_evaluation_reports_each_batch(embedded_dir, monkeypatch, capsys):
    from rlcore.evaluation import evaluate

    tok = Tokenizer.from_dir(embedded_dir)
    examples, model = doubling_examples(tok), load_model(embedded_dir)
    assert evaluate(model, tok, examples, ends_even, 4, batch_size=4) == {"eval/accuracy": 6 / 11}
    assert capsys.readouterr().out == ""  # a second's evaluation says nothing
    monkeypatch.setattr(rlcore.run.steplog, "PROGRESS_AFTER_S", -1.0)  # as if each batch took long
    got = evaluate(model, tok, examples, ends_even, 4, batch_size=4, rewards=by_prompt_rewards())
    assert got == pytest.approx({"eval/accuracy": 6 / 11, **BY_PROMPT, "eval/custom/batch": 11 / 3})  # 4, 4, 3
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r", \d+s$", "", ln) for ln in lines] == ["  held-out eval: 4/11 prompts",
                                                             "  held-out eval: 8/11 prompts"]


def test_a_long_step_reports_its_rollout_log_prob_passes_and_micro_batches(tmp_path, monkeypatch, capsys):
    two_steps = ["train.max_steps=2", "train.gradient_accumulation_steps=2", "loss.num_iterations=2",
                 "loss.beta=0.04", "rollout.max_completion_length=20"]  # with old and ref log-prob passes
    monkeypatch.setattr(rlcore.run.steplog, "PROGRESS_AFTER_S", -1.0)  # as if every phase took long
    train(config(tmp_path / "run", *two_steps))
    steps = [re.sub(r", \d+s$", "", ln) for ln in capsys.readouterr().out.splitlines()
             if ln.startswith(("step ", "  step"))]
    assert re.fullmatch(r"  step 1 rollout: 8/20 tokens, \d+/32 completions done", steps[1])  # a check every 8 tokens
    heads = [re.match(r"step +\d+(/\d+|: held-out accuracy)|  .*", ln).group() for ln in steps]  # the lines' heads
    assert heads[:1] + heads[2:] == [
        "step 0: held-out accuracy", "  step 1 old log-probs: 16/32 completions",
        "  step 1 ref log-probs: 16/32 completions", "  step 1 update: micro-batch 1/2", "step    1/2",
        "  step 2 update: micro-batch 1/2", "step    2/2", "step 2: held-out accuracy"]
    monkeypatch.undo()  # rlcore's own threshold: these steps are quick
    train(config(tmp_path / "quick", *two_steps))
    assert not [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]


def test_two_ranks_evaluate_half_the_prompts_each_and_report_the_whole(tmp_path, embedded_dir):
    import torch.multiprocessing as mp

    mp.spawn(_evaluate_on_rank, args=(str(tmp_path / "init"), str(tmp_path), str(embedded_dir)), nprocs=2)
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(seen[0] + seen[1]) == sorted(f"{i}+{i}=" for i in range(11)) and len(seen[0]) == 6
    # every rank has the whole's metrics; log_metric's values are rank 0's batches (4, 2) and rank 1's (4, 1)
    whole = {"eval/accuracy": 6 / 11, **BY_PROMPT, "eval/custom/batch": 11 / 4}
    got = [json.loads((tmp_path / f"accuracy{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [pytest.approx(whole)] * 2
    printed = [(tmp_path / f"printed{rank}.txt").read_text() for rank in (0, 1)]
    assert re.fullmatch(r"  held-out eval: 4/6 prompts \(rank 0's share of 11\), \d+s\n", printed[0])
    assert printed[1] == ""


RECORD_AGGREGATE_LOSS = """
import atexit, json, os, sys
import rlcore.train
from rlcore.cli import main

real = rlcore.train.aggregate_loss

def aggregate_loss(per_token, mask, loss_type, **kwargs):
    loss = real(per_token, mask, loss_type, **kwargs)
    with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".jsonl"), "a") as f:
        f.write(json.dumps({"sum": float((per_token * mask).sum()), "tokens": float(mask.sum()),
                            "loss": loss.item()}) + "\\n")
    return loss

rlcore.train.aggregate_loss = aggregate_loss
# a torchrun rank leaves without the interpreter's teardown (distributed.leave), but after the atexit handlers
atexit.register(lambda: open(os.path.join(sys.argv[1], "atexit" + os.environ["RANK"]), "w").close())
sys.exit(main(sys.argv[2:]))
"""


def test_two_ranks_train_one_run_in_sync_and_resume(tmp_path):
    """torchrun with 2 gloo ranks: 6 completions per rank (2 accumulated micro-batches of 3), so a
    group of 4 straddles the ranks. Replica checksums are compared at every checkpoint (a mismatch
    raises); rank 0 alone writes. Stopped at step 2 and resumed to step 3, the run ends where an
    uninterrupted 3-step run does (a constant schedule: a resume takes the new length's), with each
    rank's sampler state its own. The uninterrupted run records each rank's micro-batch losses:
    dapo's, each micro-batch's sum of l over the active tokens of the whole step (both ranks, both
    micro-batches) / 2 (the average over ranks halves it again), so the step's is their token mean."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    options = ["train.per_device_train_batch_size=3", "train.gradient_accumulation_steps=2", "train.save_steps=1",
               "train.lr_scheduler_type=constant", "train.log_completions=true", "train.num_completions_to_print=0",
               f"loss.reward_funcs=['{__name__}:first_digit', '{__name__}:extra_and_metric']"]
    out = torchrun(tmp_path, *cli_args(run, "train.max_steps=2", *options))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("held-out accuracy: before=") == 1  # rank 0 reports
    assert [r["step"] for r in rows(run)] == [1, 2]
    # both ranks' completions, log_extra columns and log_metric values reach rank 0's files
    got = [json.loads(ln) for ln in (run / "completions.jsonl").read_text().splitlines()]
    assert len(got) == 2 * 12 and all(r["starts_with"] == r["completion"][:1] for r in got)
    assert logged_metric_is_the_mean_over_the_round(run, 12)
    state = read_state(run / "checkpoint-2")
    assert len(state["sampler_rng"]) == 2 and not torch.equal(*state["sampler_rng"])  # one stream per rank
    out = torchrun(tmp_path, "train", "--resume", str(run), "--set", "train.max_steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in rows(run)] == [1, 2, 3]

    (tmp_path / "record.py").write_text(RECORD_AGGREGATE_LOSS)
    (tmp_path / "calls").mkdir()
    out = torchrun(tmp_path, str(tmp_path / "calls"), *cli_args(whole, "train.max_steps=3", *options),
                   script=tmp_path / "record.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(whole, run, 3)
    assert (run / "completions.jsonl").read_text() == (whole / "completions.jsonl").read_text()
    calls = [[json.loads(ln) for ln in (tmp_path / "calls" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)]
    assert [len(c) for c in calls] == [3 * 2, 3 * 2]  # 3 steps of GA = 2 micro-batches on each rank
    assert (tmp_path / "calls" / "atexit0").exists() and (tmp_path / "calls" / "atexit1").exists()
    for step, row in enumerate(rows(whole)):
        parts = [c for rank in calls for c in rank[2 * step:2 * step + 2]]
        step_tokens = sum(c["tokens"] for c in parts)
        assert [c["loss"] for c in parts] == pytest.approx([c["sum"] / (step_tokens / 2) for c in parts], rel=1e-6)
        assert max(abs(c["loss"]) for c in parts) > 1e-3  # (the step's own loss is near 0: A sums to 0 in a group)
        assert row["loss"] == pytest.approx(sum(c["sum"] for c in parts) / step_tokens, abs=1e-7)
