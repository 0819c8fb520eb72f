"""Entropy mask, TIS, truncated-completion mask and mismatch metrics (SPEC sections 4 and 6)."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcore.parallel import collectives
from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.masks import entropy_mask, mask_truncated, tis_weights
from rlcore.losses.metrics import rollout_mismatch
from rlcore.losses.policy import PolicyLossOptions, policy_loss

NAN = float("nan")


def assert_close(got, want, tol=1e-12):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), rtol=tol, atol=tol)


def bnpo(per_token, mask):
    return aggregate_loss(per_token, mask, "bnpo", gradient_accumulation_steps=1, max_completion_length=4)


# Entropy mask ----------------------------------------------------------------------------

ENTROPY = torch.tensor([[0.1, 0.5, 0.9, 0.3, 0.7, 9.0]], dtype=torch.float64)
VALID = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)  # 9.0 is padding


def test_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    # valid entropies sorted [0.1, 0.3, 0.5, 0.7, 0.9]; rho = 0.4 -> tau = quantile 0.6 = 0.58
    assert_close(entropy_mask(ENTROPY, VALID, 0.4), [[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]])


def test_entropy_mask_with_rho_one_keeps_every_valid_token():
    assert_close(entropy_mask(ENTROPY, VALID, 1.0), VALID)


def test_entropy_mask_scales_only_the_policy_term_and_keeps_denominators():
    logp = torch.log(torch.tensor([[1.1, 1.2, 0.9, 1.0, 1.05, 1.0]], dtype=torch.float64))
    adv = torch.tensor([1.0], dtype=torch.float64)
    ref = logp + 0.5
    per_token, metrics = policy_loss(logp, torch.zeros_like(logp), adv, VALID, options=PolicyLossOptions(beta=0.1),
                                     ref=ref, entropy=ENTROPY, entropy_keep=entropy_mask(ENTROPY, VALID, 0.4))
    kl = 0.1 * (math.exp(0.5) - 0.5 - 1)
    # kept tokens 2 and 4: l = -r A + kl; the other valid tokens carry only the KL term
    want = [kl, kl, -0.9 + kl, kl, -1.05 + kl]
    assert_close(per_token[0, :5], want)
    assert bnpo(per_token, VALID).item() == pytest.approx(sum(want) / 5)  # 5 valid tokens, not 2
    assert metrics["entropy_mask/kept"].item() == pytest.approx(2 / 5)
    # the same mask written out (the loop computes it once, for the loss and the entropy bonus)
    keep = torch.tensor([[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    given, _ = policy_loss(logp, torch.zeros_like(logp), adv, VALID, options=PolicyLossOptions(beta=0.1), ref=ref,
                           entropy_keep=keep)
    assert_close(given[0, :5], want)


def _entropy_mask_on_rank(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    entropy = [torch.tensor([[0.1, 0.2, 0.3]]), torch.tensor([[0.4, 0.5, 0.6, 0.7, 0.8]])][rank]
    kept = entropy_mask(entropy, torch.ones_like(entropy), top_entropy_quantile=0.5,
                        gather=lambda x: collectives.gather_uneven(x, 2))
    torch.save(kept, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_entropy_mask_threshold_is_a_quantile_over_all_ranks(tmp_path):
    # 8 tokens over both ranks: median 0.45, so rank 0 keeps nothing, rank 1 keeps 4 of 5
    mp.spawn(_entropy_mask_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    assert torch.load(tmp_path / "0.pt").tolist() == [[0.0, 0.0, 0.0]]
    assert torch.load(tmp_path / "1.pt").tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0]]


# TIS -------------------------------------------------------------------------------------

# old - samp: row 0 = log [0.5, 1.5, 3.0] (product 2.25), row 1 = log [1.2, 1.25] + padding (1.5)
OLD = torch.log(torch.tensor([[0.5, 1.5, 3.0], [1.2, 1.25, 1.0]], dtype=torch.float64))
SAMP = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_token_truncate_clamps_each_token_ratio():
    assert_close(tis_weights(OLD, SAMP, MASK, "token_truncate", max=2.0)[0], [0.5, 1.5, 2.0])
    assert_close(tis_weights(OLD, SAMP, MASK, "token_truncate", min=0.6, max=2.0)[0], [0.6, 1.5, 2.0])


def test_token_mask_zeroes_ratios_outside_the_bounds():
    assert_close(tis_weights(OLD, SAMP, MASK, "token_mask", min=0.6, max=2.0)[0], [0.0, 1.5, 0.0])


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_tis_mask_keeps_ratios_on_the_bounds(mode):
    # SPEC 4: "set to 0 outside [min, max]", a closed interval; ratio exactly 1 = both bounds
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    assert tis_weights(zeros, zeros, torch.ones_like(zeros), mode, min=1.0, max=1.0).unique().tolist() == [1.0]


def test_sequence_truncate_clamps_the_product_of_valid_token_ratios():
    assert_close(tis_weights(OLD, SAMP, MASK, "sequence_truncate", max=2.0), [[2.0], [1.5]])


def test_sequence_mask_zeroes_whole_sequences_outside_the_bounds():
    assert_close(tis_weights(OLD, SAMP, MASK, "sequence_mask", max=2.0), [[0.0], [1.5]])


def test_tis_bounds_of_none_are_no_bounds():
    assert_close(tis_weights(OLD, SAMP, MASK, "token_truncate", max=None)[0], [0.5, 1.5, 3.0])
    assert_close(tis_weights(OLD, SAMP, MASK, "sequence_mask", max=None), [[2.25], [1.5]])


def test_tis_weights_carry_no_grad():
    old = OLD.clone().requires_grad_()
    assert not tis_weights(old, SAMP, MASK).requires_grad


def test_unknown_tis_mode_raises():
    with pytest.raises(ValueError, match="token_truncate, token_mask"):
        tis_weights(OLD, SAMP, MASK, "token_clip")


def test_tis_multiplies_the_policy_term_and_zeroed_tokens_stay_in_denominators():
    logp = torch.log(torch.tensor([[1.1, 0.9, 1.0]], dtype=torch.float64))
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones_like(logp)
    weights = torch.tensor([[0.0, 1.5, 2.0]], dtype=torch.float64)  # token 0 masked by TIS
    ref = logp - 0.2
    per_token, metrics = policy_loss(logp, torch.zeros_like(logp), adv, mask, options=PolicyLossOptions(beta=0.1),
                                     tis_weights=weights, ref=ref)
    kl = 0.1 * (math.exp(-0.2) + 0.2 - 1)  # the KL term is not reweighted
    want = [kl, -0.9 * 1.5 + kl, -1.0 * 2.0 + kl]
    assert_close(per_token[0], want)
    assert bnpo(per_token, mask).item() == pytest.approx(sum(want) / 3)
    assert metrics["tis/mean"].item() == pytest.approx(3.5 / 3)


# Truncated completions and mismatch metrics ----------------------------------------------

def test_mask_truncated_zeroes_rows_that_hit_the_length_limit():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert_close(mask_truncated(mask, torch.tensor([False, True])), [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_rollout_mismatch_reports_abs_diff_k3_and_changed_tis_weights():
    metrics = rollout_mismatch(OLD, SAMP, MASK, tis=tis_weights(OLD, SAMP, MASK, max=2.0))
    logs = [math.log(x) for x in (0.5, 1.5, 3.0, 1.2, 1.25)]
    assert metrics["mismatch/abs_mean"].item() == pytest.approx(sum(map(abs, logs)) / 5)
    assert metrics["mismatch/abs_max"].item() == pytest.approx(math.log(3.0))
    assert metrics["mismatch/k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 5)
    assert metrics["tis/frac_changed"].item() == pytest.approx(1 / 5)  # only 3.0 was truncated


def test_rollout_mismatch_counts_whole_sequences_for_sequence_modes():
    tis = tis_weights(OLD, SAMP, MASK, "sequence_mask", max=2.0)
    metrics = rollout_mismatch(OLD, SAMP, MASK, tis=tis)
    assert metrics["tis/frac_changed"].item() == pytest.approx(3 / 5)  # row 0's three tokens


def test_k3_metrics_are_never_negative_for_tiny_log_ratios():
    """k3 = exp(x) - 1 - x >= 0; computed as exp(x) - 1 - x in fp32 it is -x < 0 once exp(x) rounds to 1."""
    old = torch.zeros(2, 3)
    samp = -torch.tensor([[1e-8, 2e-8, 3e-9], [2e-8, 5e-9, 1e-8]])  # log-ratios old - samp > 0, exp rounds to 1
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert rollout_mismatch(old, samp, mask)["mismatch/k3"] >= 0
    _, metrics = policy_loss(old.clone(), samp, torch.tensor([1.0, -1.0]), mask)
    assert metrics["kl_old/k3"] >= 0
    # the KL term: with A = 0 the per-token loss is beta * k3(ref - logp), each >= 0
    loss, _ = policy_loss(old.clone(), old, torch.zeros(2), mask, options=PolicyLossOptions(beta=0.1), ref=-samp)
    assert (loss >= 0).all(), loss
