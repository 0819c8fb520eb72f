"""Per-token policy losses (SPEC sections 3-4): closed forms, references, and gradients.

Convention in these tests: old = 0, so logp = log(ratio) and d l / d logp = r * d l / d r.
"""

import math
import pytest
import torch

from rlcore.losses.advantages import compute_advantages
from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.masks import entropy_mask
from rlcore.losses.policy import PolicyLossOptions, log_importance_weights, policy_loss

RATIOS = [0.5, 0.9, 1.1, 1.5]


def leaf(values):
    return torch.tensor(values, dtype=torch.float64).requires_grad_()


def logp_for(ratios):
    """[2, 4] log-ratios vs old = 0: row 0 has A = +1, row 1 has A = -1."""
    return leaf([[math.log(r) for r in ratios]] * 2)


def setup(ratios=RATIOS):
    logp = logp_for(ratios)
    return logp, torch.zeros_like(logp), torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones_like(logp)


def grad_of(per_token, logp):
    return torch.autograd.grad(per_token.sum(), logp)[0]


def assert_close(got, want, tol=1e-12):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), rtol=tol, atol=tol)


# PPO-style clipped loss (GRPO / DAPO) ------------------------------------------------------

def test_clipped_loss_values_with_decoupled_epsilons():
    logp, old, adv, mask = setup()
    loss, _ = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28))
    # clip(r) = [0.8, 0.9, 1.1, 1.28]; A=+1: -min(r, clip); A=-1: max(r, clip)
    assert_close(loss, [[-0.5, -0.9, -1.1, -1.28], [0.8, 0.9, 1.1, 1.5]])


def test_clipped_loss_gradient_vanishes_only_where_the_clip_binds():
    logp, old, adv, mask = setup()
    loss, _ = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28))
    # d l / d logp = -A r where the unclipped branch is taken, 0 where the clip binds
    assert_close(grad_of(loss, logp), [[-0.5, -0.9, -1.1, 0.0], [0.0, 0.9, 1.1, 1.5]])


def test_clip_fractions_count_tokens_whose_gradient_was_clipped():
    logp, old, adv, mask = setup()
    _, metrics = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28))
    assert metrics["clip_ratio/low"].item() == pytest.approx(1 / 8)  # r=0.5 with A<0
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 8)  # r=1.5 with A>0
    assert metrics["clip_ratio/region"].item() == pytest.approx(2 / 8)
    assert metrics["tokens"].item() == 8


def test_epsilon_high_defaults_to_epsilon():
    logp, old, adv, mask = setup()
    loss, _ = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(epsilon=0.2))
    assert_close(loss[0], [-0.5, -0.9, -1.1, -1.2])


def verl_dual_clip(ratio, adv, eps_low, eps_high, clip_ratio_c):
    """verl's compute_policy_loss with dual-clip (Ye et al. 2020), written out from its definition."""
    adv = adv[:, None]
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.minimum(-adv * clip_ratio_c, clip1)
    return torch.where(adv < 0, clip2, clip1)


def test_delta_equals_verl_dual_clip_in_value_and_gradient():
    gen = torch.Generator().manual_seed(0)
    log_r = (torch.rand(6, 20, generator=gen, dtype=torch.float64) * 3 - 1.5).requires_grad_()
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    ours, _ = policy_loss(log_r, torch.zeros_like(log_r), adv, torch.ones_like(log_r),
                          options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28, delta=3.0))
    verl = verl_dual_clip(log_r.exp(), adv, 0.2, 0.28, clip_ratio_c=3.0)
    assert_close(ours, verl.detach())
    assert_close(grad_of(ours, log_r), grad_of(verl, log_r))


@pytest.mark.parametrize("delta, want", [
    # above 1 + eps_high: the A=+1 row is unchanged (the clip at 1.28 binds first);
    # A=-1: r=1.5 -> 1.4, r=3.0 -> 1.4
    (1.4, [[-0.5, -1.1, -1.28, -1.28], [0.8, 1.1, 1.4, 1.4]]),
    # below: the A=+1 row is capped at delta, and the A=-1 row still takes the clip bound 1.28
    # (SPEC 3: "clipped is still computed from the unclamped r")
    (1.2, [[-0.5, -1.1, -1.2, -1.2], [0.8, 1.1, 1.28, 1.28]]),
])
def test_delta_caps_the_unclipped_branch_only(delta, want):
    logp, old, adv, mask = setup([0.5, 1.1, 1.5, 3.0])
    loss, metrics = policy_loss(logp, old, adv, mask,
                                options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28, delta=delta))
    assert_close(loss, want)
    assert_close(grad_of(loss, logp), [[-0.5, -1.1, 0.0, 0.0], [0.0, 1.1, 0.0, 0.0]])
    assert metrics["delta_bound"].item() == pytest.approx(2 / 8)


def test_a_delta_at_or_below_one_plus_epsilon_high_is_a_smaller_epsilon_high_and_a_dual_clip_at_the_bound():
    # docs/losses.md, Pitfalls: positive advantages as PPO-clip with epsilon_high = delta - 1,
    # negative ones as verl's dual clip at c = 1 + epsilon_high; value and gradient, both written
    # out from their definitions, at ratios around every bound
    logp, old, adv, mask = setup([0.5, 0.9, 1.05, 1.15, 1.2, 1.5, 3.0])  # none on a bound
    for delta in (1.1, 1.28):
        loss, _ = policy_loss(logp, old, adv, mask,
                              options=PolicyLossOptions(epsilon=0.2, epsilon_high=0.28, delta=delta))
        r = logp.exp()
        pos = -torch.minimum(r, r.clamp(0.8, delta))  # A = +1
        neg = verl_dual_clip(r, adv, 0.2, 0.28, clip_ratio_c=1.28)
        want = torch.where(adv[:, None] > 0, pos, neg)
        assert_close(loss, want)
        assert_close(grad_of(loss, logp), grad_of(want, logp))


# GSPO ------------------------------------------------------------------------------------

def test_sequence_log_weight_is_masked_mean_of_token_log_ratios():
    logp = torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 1 fully masked: denominator 1
    w = log_importance_weights(logp, torch.zeros_like(logp), mask, level="sequence")
    assert_close(w, [[0.2], [0.0]], tol=1e-7)


def test_gspo_with_grpo_aggregation_is_the_papers_objective():
    # GSPO (2507.18071): J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i),
    # s_i = exp(mean_t log r_it). Rows of lengths 2 and 3.
    log_r = torch.tensor([[0.1, 0.3, 0.0], [-0.2, -0.4, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    per_token, _ = policy_loss(log_r, torch.zeros_like(log_r), adv, mask,
                               options=PolicyLossOptions(importance_sampling_level="sequence", epsilon=0.1))
    loss = aggregate_loss(per_token, mask, "grpo", gradient_accumulation_steps=1,
                          max_completion_length=3)
    s = [math.exp(0.2), math.exp(-0.3)]
    objective = (min(s[0] * 1, min(s[0], 1.1) * 1) + min(s[1] * -2, max(s[1], 0.9) * -2)) / 2
    assert loss.item() == pytest.approx(-objective, rel=1e-12)


def test_gspo_token_has_sequence_value_and_per_token_gradient():
    log_r = torch.tensor([[-0.2, -0.4, -0.3]], dtype=torch.float64)
    mask = torch.ones_like(log_r)
    adv = torch.tensor([-2.0], dtype=torch.float64)
    s = math.exp(-0.3)  # sequence ratio; epsilon=0.5 so nothing clips and l = -s A

    def loss_at(level):
        return lambda x: policy_loss(x, torch.zeros_like(x), adv, mask,
                                     options=PolicyLossOptions(epsilon=0.5, importance_sampling_level=level))[0][0]

    assert_close(loss_at("sequence_token")(log_r), [-s * -2.0] * 3)
    # d l_t / d logp_t': sequence_token is diagonal (each token its own gradient, -A s);
    # sequence spreads -A s / |y| over every token of the row
    jac_token = torch.autograd.functional.jacobian(loss_at("sequence_token"), log_r)[:, 0]
    jac_seq = torch.autograd.functional.jacobian(loss_at("sequence"), log_r)[:, 0]
    assert_close(jac_token, torch.eye(3, dtype=torch.float64) * 2.0 * s)
    assert_close(jac_seq, torch.full((3, 3), 2.0 * s / 3, dtype=torch.float64))


def test_gspo_clip_fractions_count_tokens_not_sequences():
    """docs/losses.md: with importance_sampling_level="sequence" the clip fractions are token means (a
    clipped sequence counts once per valid token; TRL's count sequences, empty ones included).
    Reference: each row's ratio exp(mean valid log-ratio) and its length, counted by hand."""
    L = math.log
    log_r = torch.tensor([[0.1, 0.1, 0.1, 4 * L(1.5) - 0.3],   # 4 tokens, r = 1.5 with A > 0: high
                          [L(0.5), L(0.4), L(0.625), 5.0],     # 3 tokens, r = 0.5 with A < 0: low
                          [L(1.5), 5.0, 5.0, 5.0],             # 1 token, r = 1.5 with A < 0: not clipped
                          [0.3, -0.3, 0.0, 5.0],               # 3 tokens, r = 1: not clipped
                          [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)  # empty: the 5s are padding
    lengths = [4, 3, 1, 3, 0]
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    _, metrics = policy_loss(log_r, torch.zeros_like(log_r), adv, mask,
                             options=PolicyLossOptions(importance_sampling_level="sequence"))
    rows = log_r.tolist()
    ratio = [math.exp(sum(rows[i][:n]) / n) if n else 1.0 for i, n in enumerate(lengths)]
    high = [r > 1.2 and a > 0 for r, a in zip(ratio, adv.tolist())]
    low = [r < 0.8 and a < 0 for r, a in zip(ratio, adv.tolist())]
    assert high == [True, False, False, False, False] and low == [False, True, False, False, False]
    assert all(0.8 < math.exp(x) < 1.2 for x in rows[0][:3])  # row 0's tokens alone would not clip
    by_tokens = {"clip_ratio/high": sum(n for n, c in zip(lengths, high) if c) / sum(lengths),
                 "clip_ratio/low": sum(n for n, c in zip(lengths, low) if c) / sum(lengths),
                 "clip_ratio/region": sum(n for n, h, lo in zip(lengths, high, low) if h or lo) / sum(lengths)}
    assert list(by_tokens.values()) == pytest.approx([4 / 11, 3 / 11, 7 / 11])
    assert {k: metrics[k].item() for k in by_tokens} == pytest.approx(by_tokens, rel=1e-6)  # fp32 fractions
    by_sequences = {"clip_ratio/high": 1 / 5, "clip_ratio/low": 1 / 5, "clip_ratio/region": 2 / 5}  # TRL's
    assert all(abs(by_tokens[k] - by_sequences[k]) > 0.05 for k in by_tokens)


# CISPO and SAPO -------------------------------------------------------------------------

def test_cispo_weights_logp_by_the_capped_detached_ratio():
    ratios = [0.5, 2.0, 6.0]
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    logp = leaf([[math.log(r) - 1.0 for r in ratios]])
    adv = torch.tensor([2.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones_like(logp),
                                options=PolicyLossOptions(policy_loss="cispo", epsilon_high=5.0))
    w = torch.tensor([[0.5, 2.0, 5.0]], dtype=torch.float64)
    assert_close(loss, (-w * 2.0 * logp).detach())
    assert_close(grad_of(loss, logp), -w * 2.0)  # no gradient through the ratio
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 3)


def test_cispo_clip_metric_counts_capped_tokens_of_either_advantage_sign():
    # docs/losses.md: for cispo clip_ratio/high is r > eps_high whatever the sign of A (TRL
    # counts A > 0 only); here the capped token has A < 0
    logp = leaf([[math.log(0.5), math.log(6.0)], [math.log(1.0), math.log(1.0)]])
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    _, metrics = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp),
                             options=PolicyLossOptions(policy_loss="cispo", epsilon_high=5.0))
    assert metrics["clip_ratio/high"].item() == pytest.approx(1 / 4)


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_soft_gate_value_and_gradient(tau_pos, tau_neg):
    logp, old, adv, mask = setup([0.5, 1.5])
    loss, _ = policy_loss(logp, old, adv, mask,
                          options=PolicyLossOptions(policy_loss="sapo", sapo_temperature_pos=tau_pos,
                                                    sapo_temperature_neg=tau_neg))
    sig = lambda x: 1 / (1 + math.exp(-x))
    want, want_grad = [], []
    for a, tau in ((1.0, tau_pos), (-1.0, tau_neg)):
        want.append([-sig(tau * (r - 1)) * 4 / tau * a for r in (0.5, 1.5)])
        # d/dlogp: -A (4/tau) sig'(tau (r-1)) tau r = -4 A sig (1 - sig) r
        want_grad.append([-4 * a * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r for r in (0.5, 1.5)])
    assert_close(loss, want)
    assert_close(grad_of(loss, logp), want_grad)


# On-policy, zero-signal and all-masked cases --------------------------------------------

@pytest.mark.parametrize("options", [
    PolicyLossOptions(policy_loss="ppo"),
    PolicyLossOptions(policy_loss="ppo", epsilon_high=0.28, delta=4.0),
    PolicyLossOptions(policy_loss="cispo", epsilon_high=5.0),
    PolicyLossOptions(policy_loss="cispo", epsilon_high=0.2),  # the cap binds at r = 1: 0.2 x REINFORCE
    PolicyLossOptions(policy_loss="sapo"),
    PolicyLossOptions(policy_loss="vespo"),
])
def test_on_policy_gradient_is_reinforce_with_baseline(options):
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    loss, metrics = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), options=options)
    # REINFORCE with the group baseline folded into A: grad of -A_i log pi(y_it)
    reinforce = torch.autograd.grad((-adv[:, None] * logp).sum(), logp)[0]
    scale = min(1.0, options.epsilon_high) if options.policy_loss == "cispo" else 1.0
    assert_close(grad_of(loss, logp), scale * reinforce)
    if scale == 1.0:  # a cispo cap below 1 caps every token: its clip fraction is 1
        assert all(metrics[k].item() == 0.0 for k in metrics if k.startswith("clip_ratio"))


def test_on_policy_ratio_is_exactly_one():
    logp = leaf([[-0.3, -2.0, -7.5]])
    w = log_importance_weights(logp, logp.detach(), torch.ones_like(logp))
    assert w.exp().tolist() == [[1.0, 1.0, 1.0]]


def test_zero_std_group_gives_zero_policy_gradient():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0]])  # group 0 all equal, group 1 not
    adv, _ = compute_advantages(rewards, num_generations=2)
    logp = leaf([[-0.5, -1.0]] * 4)
    old = logp.detach() + 0.1
    loss, _ = policy_loss(logp, old, adv.double(), torch.ones_like(logp), options=PolicyLossOptions(beta=0.0))
    grad = grad_of(loss, logp)
    assert grad[:2].abs().max().item() == 0.0
    assert grad[2:].abs().min().item() > 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_all_masked_batch_gives_finite_zero_loss(loss_type):
    logp = leaf([[-0.5, -1.0], [-2.0, -0.1]])
    mask = torch.zeros_like(logp)
    entropy = torch.ones_like(logp)
    per_token, metrics = policy_loss(logp, logp.detach() - 0.3, torch.tensor([1.0, -1.0]), mask,
                                     options=PolicyLossOptions(beta=0.1), ref=logp.detach() + 0.2, entropy=entropy,
                                     entropy_keep=entropy_mask(entropy, mask, 0.5), tis_weights=torch.ones_like(logp))
    loss = aggregate_loss(per_token, mask, loss_type, gradient_accumulation_steps=2,
                          max_completion_length=2, step_tokens=0)
    loss.backward()
    assert loss.item() == 0.0
    assert logp.grad.abs().max().item() == 0.0
    assert all(torch.isfinite(v).item() for v in metrics.values())


# KL to the reference and the remaining metrics -------------------------------------------

def test_k3_kl_term_value_and_gradient():
    logp = leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)  # isolate the KL term
    loss, metrics = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), options=PolicyLossOptions(beta=0.1),
                                ref=ref)
    d = [-0.5, 1.0]  # ref - logp
    assert_close(loss, [[0.1 * (math.exp(x) - x - 1) for x in d]])
    assert_close(grad_of(loss, logp), [[0.1 * (1 - math.exp(x)) for x in d]])
    assert metrics["kl_ref"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 2)


@pytest.mark.parametrize("shift", [0.0, 0.3], ids=["on_policy", "off_policy"])
def test_bias_corrected_kl_term_is_k3_times_the_ratio_value_and_gradient(shift):
    """TRL's use_bias_correction_kl: l = beta * k3 * r with r = exp(logp - old). Closed forms:
    d(k3)/d logp = 1 - e^d (d = ref - logp) and dr/d logp = r, so the gradient is
    beta * r * (1 - e^d + k3). On-policy r = 1: the value is plain k3's, the gradient is not."""
    logp = leaf([[-1.0, -2.0]])
    old = logp.detach() - shift
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(logp),
                          options=PolicyLossOptions(beta=0.1, use_bias_correction_kl=True), ref=ref)
    d, r = [-0.5, 1.0], math.exp(shift)
    k3 = [math.exp(x) - x - 1 for x in d]
    assert_close(loss, [[0.1 * k * r for k in k3]])
    assert_close(grad_of(loss, logp), [[0.1 * r * (1 - math.exp(x) + k) for x, k in zip(d, k3)]])


def test_kl_ref_metric_is_a_masked_mean():
    logp = leaf([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, 5.0]], dtype=torch.float64)  # the third token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    _, metrics = policy_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), mask,
                             options=PolicyLossOptions(beta=0.1), ref=ref)
    assert metrics["kl_ref"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in (-0.5, 1.0)) / 2)


def test_approx_kl_to_old_uses_k1_and_k3():
    logp = leaf([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.2, -1.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    _, metrics = policy_loss(logp, old, torch.ones(1, dtype=torch.float64), mask)
    x = [0.2, -0.5]  # log r = logp - old on valid tokens
    assert metrics["kl_old/k1"].item() == pytest.approx(-sum(x) / 2)
    assert metrics["kl_old/k3"].item() == pytest.approx(sum(math.exp(v) - 1 - v for v in x) / 2)


def test_entropy_metric_is_masked_mean():
    logp, old, adv, _ = setup()
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 2, dtype=torch.float64)
    entropy = torch.tensor([[1.0, 2.0, 50.0, 50.0], [3.0, 4.0, 50.0, 50.0]], dtype=torch.float64)
    _, metrics = policy_loss(logp, old, adv, mask, entropy=entropy)
    assert metrics["entropy"].item() == pytest.approx(2.5)


# cispo and sequence_token stop gradients on purpose (their gradient is not the derivative of
# their value), so finite differences cannot check them; their gradients are closed-form above.
@pytest.mark.parametrize("loss", ["ppo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_fp64(loss, level):
    gen = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 4, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]],
                        dtype=torch.float64)
    tis = torch.rand(3, 4, generator=gen, dtype=torch.float64) + 0.5

    def fn(logp):
        return policy_loss(logp, old, adv, mask,
                           options=PolicyLossOptions(policy_loss=loss, importance_sampling_level=level,
                                                     epsilon_high=0.28, delta=2.0, beta=0.05),
                           ref=ref, tis_weights=tis)[0]

    assert torch.autograd.gradcheck(fn, (logp,))


def test_unknown_loss_raises():
    logp, old, adv, mask = setup()
    with pytest.raises(ValueError, match="valid: ppo, cispo, sapo"):
        policy_loss(logp, old, adv, mask, options=PolicyLossOptions(policy_loss="grpo"))


def test_beta_without_ref_raises():
    logp, old, adv, mask = setup()
    with pytest.raises(ValueError, match="needs ref"):
        policy_loss(logp, old, adv, mask, options=PolicyLossOptions(beta=0.04))


# Off-policy sequence mask (DeepSeek-V3.2, TRL's off_policy_mask_threshold) ---------------------

def test_off_policy_mask_drops_only_negative_advantage_sequences_beyond_the_kl_threshold():
    """Rows: (A, mean over valid tokens of samp - logp): keep unless A < 0 and the mean > delta."""
    logp = torch.zeros(5, 3, dtype=torch.float64)
    samp = torch.tensor([[0.9, 0.9, 0.0],      # A < 0, KL 0.6 (last token padding) > 0.5: dropped
                         [0.6, 0.3, 0.6],      # A < 0, KL 0.5: kept (<= threshold)
                         [2.0, 2.0, 2.0],      # A = 0, KL 2: kept (A >= 0)
                         [3.0, 3.0, 3.0],      # A > 0: kept
                         [0.0, 0.0, 0.0]], dtype=torch.float64)  # A < 0, all padding: KL 0, kept
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 0.0, 2.0, -1.0], dtype=torch.float64)
    from rlcore.losses.masks import off_policy_mask

    got = off_policy_mask(adv, logp, samp, mask, 0.5)
    assert got.shape == (5, 1) and got[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("loss", ["ppo", "cispo", "sapo"])
def test_off_policy_mask_zeroes_the_policy_term_of_dropped_rows_but_not_the_kl(loss):
    logp, old, adv, mask = setup()
    samp = torch.tensor([[2.0] * 4, [2.0] * 4], dtype=torch.float64)  # KL ~ 2 - mean logp > 0.5 in both rows
    ref = torch.full_like(logp, -0.3)
    options = dict(policy_loss=loss, epsilon_high=5.0 if loss == "cispo" else None, beta=0.1)
    plain, _ = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(**options), ref=ref)
    masked, m = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(**options, off_policy_mask_threshold=0.5),
                            ref=ref, samp=samp)
    kl = 0.1 * (torch.exp(ref - logp) - (ref - logp) - 1)
    assert_close(masked[0], plain[0])           # A = +1: kept
    assert_close(masked[1], kl[1].detach())     # A = -1: only the KL term is left
    assert_close(grad_of(masked, logp)[1], grad_of(kl, logp)[1])
    assert m["off_policy_mask/kept"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="off_policy_mask_threshold=0.5 needs samp"):
        policy_loss(logp, old, adv, mask, options=PolicyLossOptions(off_policy_mask_threshold=0.5))


# VESPO (TRL's loss_type='vespo') -----------------------------------------------------------

def phi(log_w, k, lam):
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_is_reinforce_weighted_by_a_gamma_function_of_the_sequence_ratio():
    """Row 0 (A = +1, k 2, lambda 3): log w = sum of the token log-ratios; row 1 (A = -1, k 3,
    lambda 2). l = -phi A logp per token, and the gradient -phi A (phi is detached)."""
    logp, old, adv, mask = setup([0.5, 0.9, 1.1, 1.5])
    log_w = sum(math.log(r) for r in [0.5, 0.9, 1.1, 1.5])
    loss, m = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(policy_loss="vespo"))
    phis = [phi(log_w, 2.0, 3.0), phi(log_w, 3.0, 2.0)]
    assert_close(loss, [[-p_ * a * math.log(r) for r in [0.5, 0.9, 1.1, 1.5]] for p_, a in zip(phis, [1, -1])])
    assert_close(grad_of(loss, logp), [[-phis[0]] * 4, [phis[1]] * 4])
    assert m["vespo/phi_mean"].item() == pytest.approx(sum(phis) / 2)
    on_policy, _ = policy_loss(logp, logp.detach(), adv, mask,
                               options=PolicyLossOptions(policy_loss="vespo", vespo_k_pos=5.0, vespo_lambda_pos=0.5))
    assert_close(grad_of(on_policy, logp), [[-1.0] * 4, [1.0] * 4])  # phi(1) = 1 for every (k, lambda)


def test_vespo_folds_tis_weights_into_its_sequence_weight_and_applies_them_nowhere_else():
    logp, old, adv, mask = setup([1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    tis = torch.tensor([[2.0, 0.5, 1.5, 9.0], [1.2, 1.2, 1.0, 1.0]], dtype=torch.float64)  # 9.0 sits on padding
    loss, m = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(policy_loss="vespo"), tis_weights=tis)
    want = [phi(math.log(2.0 * 0.5 * 1.5), 2.0, 3.0), phi(math.log(1.2 * 1.2), 3.0, 2.0)]
    assert_close(grad_of(loss * mask, logp), [[-want[0]] * 3 + [0.0], [want[1]] * 4])
    seq = torch.tensor([[1.5], [1.44]], dtype=torch.float64)  # a sequence-level TIS weight enters once
    loss_seq, _ = policy_loss(logp, old, adv, mask, options=PolicyLossOptions(policy_loss="vespo"), tis_weights=seq)
    assert_close(grad_of(loss_seq * mask, logp), [[-want[0]] * 3 + [0.0], [want[1]] * 4])


def test_masks_carry_no_grad_even_from_a_differentiable_entropy():
    from rlcore.losses.masks import off_policy_mask

    entropy = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.float64)
    assert not entropy_mask(entropy, mask, 0.5).requires_grad
    logp = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    assert not off_policy_mask(torch.tensor([1.0, -1.0, 0.0]), logp, logp.detach() + 1, mask, 0.5).requires_grad


def test_a_loss_name_without_its_branch_is_an_error_not_another_loss(monkeypatch):
    """A fork that adds a name to LOSSES but no branch must not train with SAPO (the last branch)."""
    import rlcore.losses.policy as policy

    monkeypatch.setattr(policy, "LOSSES", (*policy.LOSSES, "sym_clip"))
    logp, old, adv, mask = setup()
    with pytest.raises(NotImplementedError, match="no branch for loss 'sym_clip'"):
        policy.policy_loss(logp, old, adv, mask, options=PolicyLossOptions(policy_loss="sym_clip"))



@pytest.mark.parametrize("tokens, log_w, k, lam", [
    ([15.0, 15.0], 20.0, 2961.5, 2**-13),  # log w = 30 is clamped to 20 (this (k, lambda) peaks near w = e^17.0)
    ([-15.0, -15.0], math.log(1e-8), 0.125, 3.0),  # log w = -30 is clamped to log 1e-8
    ([25.0, -10.0], 10.0, 0.5, 2**-13),  # each token's log-ratio first: 25 -> 20, so log w = 10, not 15
])
def test_vespo_clamps_the_log_ratios_as_documented(tokens, log_w, k, lam):
    """docs/losses.md: log w = sum_t clamp(logp - old, -20, 20), clamped to [log 1e-8, 20]; phi in
    closed form at the clamped log w. The (k, lambda) make phi there of order 1 and far from the phi
    of the unclamped sum (0 for 30 and 15, 0.47 against 2.0 for -30). A = +1, so the _pos pair;
    k and lambda are exact in fp32 (vespo_weights rounds them to fp32: 0.1 would be off by 3e-8)."""
    logp = leaf([tokens])
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones_like(logp)
    loss, _ = policy_loss(logp, torch.zeros_like(logp), adv, mask,
                          options=PolicyLossOptions(policy_loss="vespo", vespo_k_pos=k, vespo_lambda_pos=lam))
    want = phi(log_w, k, lam)
    assert 1.0 < want < 1e3
    # rtol 1e-9: at log w = 20 phi's exponent is a difference of two numbers near 6e4
    torch.testing.assert_close(grad_of(loss, logp), torch.full_like(logp, -want), rtol=1e-9, atol=0)
