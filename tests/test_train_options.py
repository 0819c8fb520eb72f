"""The loop with the TRL options beyond SPEC's core, end to end on CPU: the loss zoo's other
members (VESPO, LUSPO, SAPO's temperatures, GDPO advantages, the off-policy mask), the entropy
bonus and its adaptive control, a synced reference model, the repetition penalty, and the run
geometry TRL configs give (generation_batch_size, num_train_epochs). Each option's numbers are
tested against references in the unit tests (test_losses_*, test_rollout*, test_config); here it
must reach the loop, survive --resume, and run under two ranks.

Runs use the embedded model (conftest) and test_train.py's `SMALL` overrides and helpers.
"""

import json

import pytest
import torch

import rlcore.rollout.completions
import rlcore.train
from rlcore.run.checkpoints import latest_checkpoint
from rlcore.cli import main
from rlcore.train import train
from test_train import cli_args, config, rows, torchrun, weights, without_timing
from test_resume import run_and_crash

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread


@pytest.mark.parametrize("loss", [["loss.policy_loss=cispo", "loss.epsilon_high=5.0"], ["loss.policy_loss=sapo"],
                                  ["loss.policy_loss=vespo", "vespo_k_pos=1.5"],
                                  ["loss.loss_type=luspo", "loss.importance_sampling_level=sequence"]])
def test_every_policy_loss_runs_and_logs(loss, tmp_path, capsys, monkeypatch):
    seen, real = [], rlcore.train.policy_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.train, "policy_loss", spy)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "loss.num_iterations=2", *loss))
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert "step    1/2" in capsys.readouterr().out
    if "vespo" in loss[0]:
        options = [k["options"] for k in seen]
        assert {o.policy_loss for o in options} == {"vespo"} and {o.vespo_k_pos for o in options} == {1.5}
        phis = [r["vespo/phi_mean"] for r in rows(run)]
        assert phis[0] == pytest.approx(1.0, abs=1e-4) and 0 < phis[1] < 2, phis  # epoch 1: w = 1, phi(1) = 1


def test_generation_batch_size_runs_the_rounds_steps_per_generation_would(tmp_path):
    # b = 16: TRL's generation_batch_size = 32 is steps_per_generation = 2 (two steps per round).
    runs = {"gbs": "generation_batch_size=32", "spg": "train.steps_per_generation=2"}
    for name, option in runs.items():
        train(config(tmp_path / name, "train.max_steps=2", option))
    got = [[without_timing(r) for r in rows(tmp_path / name)] for name in runs]
    assert got[0] == got[1] and [r["kl_old/k1"] != 0 for r in got[0]] == [False, True]  # step 2 off-policy


def test_num_train_epochs_sets_the_run_length(tmp_path, capsys):
    # 256 prompts, rounds of 16 completions / G = 4 = 4 prompts, one step per round: 64 steps per
    # pass; 0.05 of a pass is ceil(3.2) = 4 steps (the default config's max_steps = 300 gives way).
    run = tmp_path / "run"
    train(config(run, "num_train_epochs=0.05"))
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]
    assert latest_checkpoint(run).name == "checkpoint-4"
    assert "num_train_epochs = 0.05: 256 prompts, 64 whole rounds of 4 per pass, 1 optimizer step(s) per round: " \
           "max_steps = 4" in capsys.readouterr().out


def test_multi_objective_aggregation_reaches_the_advantages(tmp_path, monkeypatch):
    seen, real = [], rlcore.train.compute_advantages

    def spy(*args, **kwargs):
        seen.append(kwargs["multi_objective_aggregation"])
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.train, "compute_advantages", spy)
    train(config(tmp_path / "run", "train.max_steps=1", "multi_objective_aggregation=normalize_then_sum",
                 "loss.reward_funcs=['test_train:first_digit', 'format']"))
    assert seen == ["normalize_then_sum"]


def test_sapo_temperatures_reach_the_loss(tmp_path, monkeypatch):
    seen, real = set(), rlcore.train.policy_loss

    def spy(*args, **kwargs):
        options = kwargs["options"]
        seen.add((options.policy_loss, options.sapo_temperature_pos, options.sapo_temperature_neg))
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.train, "policy_loss", spy)
    train(config(tmp_path / "run", "train.max_steps=1", "loss.policy_loss=sapo", "sapo_temperature_pos=2.0",
                 "sapo_temperature_neg=0.5"))
    assert seen == {("sapo", 2.0, 0.5)}


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, embedded_dir):
    # alpha = 1, every step: the reference becomes the policy after each step, so each round's
    # KL to it starts at zero again (the test above: without a sync it does not).
    run = tmp_path / "every"
    train(config(run, "train.max_steps=3", "loss.beta=0.04", "loss.sync_ref_model=true",
                 "loss.ref_model_sync_steps=1", "loss.ref_model_mixup_alpha=1.0"))
    assert all(abs(r["kl_ref"]) < 1e-7 for r in rows(run)), [r["kl_ref"] for r in rows(run)]
    # alpha = 0.5 at step 2 only: the checkpoint's reference is 0.5 policy_2 + 0.5 initial policy.
    run = tmp_path / "half"
    train(config(run, "train.max_steps=2", "loss.beta=0.04", "loss.sync_ref_model=true",
                 "loss.ref_model_sync_steps=2", "loss.ref_model_mixup_alpha=0.5"))
    ck = latest_checkpoint(run)
    initial, policy, ref = (weights(p) for p in (embedded_dir, ck / "model", ck / "ref_model"))
    for name, w in ref.items():
        want = initial[name].clone().mul_(0.5).add_(policy[name], alpha=0.5)
        torch.testing.assert_close(w, want, rtol=0, atol=0)
    assert any(not torch.equal(initial[n], policy[n]) for n in initial)


def test_sync_ref_model_with_a_reference_of_another_architecture_is_an_error_at_start(tmp_path, embedded_dir):
    import shutil
    from safetensors.torch import save_file

    other = tmp_path / "one_layer"
    shutil.copytree(embedded_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (other / "config.json").write_text(json.dumps(cfg))
    first_layer = {k: v for k, v in weights(other).items() if ".layers." not in k or ".layers.0." in k}
    save_file(first_layer, other / "model.safetensors")
    with pytest.raises(ValueError, match=rf"model\.ref_path = {other} is another architecture \(model\.layers\.1\."):
        train(config(tmp_path / "run", "train.max_steps=1", "loss.beta=0.04", "loss.sync_ref_model=true",
                     f"model.ref_path={other}"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or rows(tmp_path / "run") == []


def test_a_missing_reference_checkpoint_is_named_as_model_ref_path(tmp_path):
    from rlcore.models.hf_checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=rf"^model\.ref_path: {tmp_path / 'nope'}"):
        train(config(tmp_path / "run", "train.max_steps=1", "loss.beta=0.04", f"model.ref_path={tmp_path / 'nope'}"))


def test_a_synced_reference_resumes_from_its_checkpoint(tmp_path):
    steps = ["train.max_steps=4", "train.save_steps=2", "loss.beta=0.04", "loss.sync_ref_model=true",
             "loss.ref_model_sync_steps=1", "loss.ref_model_mixup_alpha=0.6"]
    run_and_crash(tmp_path, steps)
    assert (tmp_path / "b" / "checkpoint-2" / "ref_model").is_dir()
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    for part in ("model", "ref_model"):
        a, b = (weights(tmp_path / r / "checkpoint-4" / part) for r in "ab")
        assert all(torch.equal(a[k], b[k]) for k in a), part
    assert [r["kl_ref"] for r in rows(tmp_path / "b")] == [r["kl_ref"] for r in rows(tmp_path / "a")]


def test_repetition_penalty_reaches_the_rollouts_and_the_trainer_compares_unpenalised_logprobs(tmp_path, monkeypatch):
    # The penalty changes what is sampled, not the policy: the engine's full_logprobs (without it)
    # are what the mismatch metrics and TIS compare with the trainer's, so they agree as in fp32.
    # The held-out evaluation is plain greedy, without it (docs/rollout.md).
    penalties, real = [], rlcore.rollout.generate

    def generate(*args, **kwargs):
        penalties.append((kwargs["temperature"], kwargs.get("repetition_penalty", 1.0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=1", "rollout.repetition_penalty=2.0"))
    assert penalties == [(0.0, 1.0), (1.0, 2.0), (0.0, 1.0)]  # evaluation, the round, evaluation
    assert all(r["mismatch/abs_mean"] < 1e-4 for r in rows(run))


def test_entropy_bonus_raises_the_policy_entropy_and_a_penalty_lowers_it(tmp_path):
    # Same start, same samples at step 1; the sign of loss.entropy_coef is the only difference.
    # Without the bonus in the gradient the two runs would be bit-identical.
    ent = {}
    for sign in (1, -1):
        run = tmp_path / f"coef{sign}"
        train(config(run, "train.max_steps=3", f"loss.entropy_coef={sign * 2.0}"))
        ent[sign] = [r["entropy"] for r in rows(run)]
        assert [r["entropy_coef"] for r in rows(run)] == [sign * 2.0] * 3
    assert ent[1][0] == ent[-1][0]  # step 1 is measured before any update
    assert ent[1][-1] > ent[1][0] + 0.02 and ent[-1][-1] < ent[-1][0] - 0.02, ent


def test_adaptive_entropy_control_steps_its_coefficient_and_resumes_it(tmp_path):
    # entropy_target far above any entropy: every step's entropy is below it, so the coefficient
    # grows by delta per step; it applies from step 2 (step 1 has no measurement yet).
    steps = ["train.max_steps=4", "train.save_steps=2", "loss.use_adaptive_entropy=true", "loss.entropy_coef=0.01",
             "loss.entropy_coef_delta=0.02", "loss.entropy_target=100.0"]
    run_and_crash(tmp_path, steps)
    got = rows(tmp_path / "a")
    assert [r["entropy_coef/applied"] for r in got] == pytest.approx([0.0, 0.03, 0.05, 0.07])
    assert [r["entropy_coef"] for r in got] == pytest.approx([0.03, 0.05, 0.07, 0.09])  # TRL's: after adapting
    # what the controller measured: without an entropy mask, the step's token-mean entropy
    assert [r["entropy_coef/entropy"] for r in got] == pytest.approx([r["entropy"] for r in got], rel=1e-5)
    assert main(["train", "--resume", str(tmp_path / "b")]) == 0
    a, b = weights(tmp_path / "a" / "checkpoint-4" / "model"), weights(tmp_path / "b" / "checkpoint-4" / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["entropy_coef"] for r in rows(tmp_path / "b")] == [r["entropy_coef"] for r in rows(tmp_path / "a")]


def test_a_resume_takes_a_new_static_entropy_coef_from_the_command_line(tmp_path):
    # Only adaptive control has state to restore; a fixed coefficient comes from the config.
    run = tmp_path / "run"
    assert main(cli_args(run, "train.max_steps=2")) == 0
    assert main(["train", "--resume", str(run), "--set", "train.max_steps=3", "--set", "loss.entropy_coef=0.5"]) == 0
    got = rows(run)
    assert "entropy_coef" not in got[1] and got[2]["entropy_coef/applied"] == 0.5


def test_the_entropy_bonus_covers_only_the_tokens_the_entropy_mask_keeps(tmp_path, monkeypatch):
    from rlcore.losses.entropy import EntropyBonus

    seen, real = [], EntropyBonus.term

    def spy(self, entropy, on, ga):
        seen.append((on.clone(), entropy.detach()))
        return real(self, entropy, on, ga)

    monkeypatch.setattr(EntropyBonus, "term", spy)
    train(config(tmp_path / "run", "train.max_steps=1", "loss.entropy_coef=0.1", "loss.top_entropy_quantile=0.5"))
    for on, entropy in seen:
        kept, dropped = entropy[on == 1], entropy[on == 0]
        assert 0 < len(kept) < on.numel() and set(on.unique().tolist()) <= {0.0, 1.0}
        assert kept.min() >= dropped[dropped > 0].max() if (dropped > 0).any() else True  # the high-entropy ones


def test_off_policy_mask_drops_negative_advantage_rows_the_engine_sampled_far_off_policy(tmp_path, monkeypatch):
    # Engine log-probs shifted up by 1: every sequence's KL(engine || policy) estimate is ~1 > 0.5,
    # so exactly the rows with a negative advantage lose their policy term.
    import dataclasses

    real_generate, real_loss, seen = rlcore.rollout.generate, rlcore.train.policy_loss, []

    def generate_shifted(*args, **kwargs):
        ro = real_generate(*args, **kwargs)
        return dataclasses.replace(ro, sampling_logprobs=ro.sampling_logprobs + 1.0)

    def spy(logp, old, adv, mask, **kwargs):
        per_token, m = real_loss(logp, old, adv, mask, **kwargs)
        seen.append((adv, per_token.detach(), mask))
        return per_token, m

    monkeypatch.setattr(rlcore.rollout.completions, "generate", generate_shifted)
    monkeypatch.setattr(rlcore.train, "policy_loss", spy)
    run = tmp_path / "run"
    train(config(run, "train.max_steps=2", "off_policy_mask_threshold=0.5"))
    for adv, per_token, mask in seen:
        assert (per_token[adv < 0] == 0).all()
        assert ((per_token[adv > 0] * mask[adv > 0]).abs().sum(-1) > 0).all()
    assert any((adv < 0).any() for adv, _, _ in seen)
    assert all(0 < r["off_policy_mask/kept"] < 1 for r in rows(run))


def test_two_ranks_run_the_trl_options_that_keep_state_or_reduce_over_ranks(tmp_path):
    """Adaptive entropy control (all-reduced window, saved), the entropy mask's quantile over ranks,
    a synced reference, generation_batch_size and num_train_epochs resolved for 2 ranks, the
    off-policy mask, the repetition penalty and GDPO advantages, under torchrun: the replicas are
    compared at every checkpoint (a mismatch raises)."""
    run = tmp_path / "run"
    args = cli_args(run, "train.per_device_train_batch_size=6", "generation_batch_size=24", "num_train_epochs=0.03",
                    "train.save_steps=1", "loss.use_adaptive_entropy=true", "loss.entropy_target=100.0",
                    "loss.top_entropy_quantile=0.5", "loss.beta=0.04", "loss.sync_ref_model=true",
                    "loss.ref_model_sync_steps=1", "off_policy_mask_threshold=0.5", "rollout.repetition_penalty=1.2",
                    "multi_objective_aggregation=normalize_then_sum",
                    "loss.reward_funcs=['test_train:first_digit', 'format']")
    out = torchrun(tmp_path, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max_steps = 3" in out.stdout  # 256 prompts // 6 per round = 42 rounds x 2 steps x 0.03 -> 3
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["entropy_coef/applied"] for r in got] == pytest.approx([0.0, 0.005, 0.01])
    assert (run / "checkpoint-3" / "ref_model").is_dir()


def test_every_option_of_policy_loss_comes_from_the_configs_loss_section():
    """An option of policy_loss outside PolicyLossOptions, or a field of it the config does not fill,
    would silently keep its default in every run: policy_loss takes tensors and the options object
    only, each field of which from_config reads from the [loss] field of its name, with the same
    default."""
    import dataclasses
    import inspect

    from rlcore.losses.policy import PolicyLossOptions, policy_loss
    from rlcore.config.options import LossArgs

    tensors = {"logp", "old", "advantages", "mask", "ref", "tis_weights", "entropy", "entropy_keep", "samp"}
    assert set(inspect.signature(policy_loss).parameters) - tensors == {"options"}
    fields = [field.name for field in dataclasses.fields(PolicyLossOptions)]
    distinct = {name: f"value of {name}" for name in fields}  # a swap of two fields shows
    got = PolicyLossOptions.from_config(dataclasses.replace(LossArgs(), **distinct))
    assert dataclasses.asdict(got) == distinct
    assert PolicyLossOptions.from_config(LossArgs()) == PolicyLossOptions()
