"""The entropy bonus (loss.entropy_coef, TRL's entropy_coef) and its adaptive control: closed forms,
and the bonus's gradient through the chunked log-prob function against an fp64 full-softmax one."""

import math

import pytest
import torch

from rlcore.losses.entropy import EntropyBonus, mean_entropy
from rlcore.losses.logprobs import token_logprobs

H_ROWS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])  # 100s are padding
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_mean_entropy_is_the_token_mean_over_the_mask_divided_by_ga():
    assert mean_entropy(H_ROWS, MASK, 2).item() == pytest.approx((1 + 2 + 3 + 4) / 4 / 2)
    assert mean_entropy(H_ROWS, torch.zeros_like(MASK), 2).item() == 0.0  # no tokens: 0, not NaN


@pytest.mark.parametrize("recompute", [True, False])
def test_bonus_gradient_through_chunked_logprobs_equals_fp64_full_softmax(recompute):
    """loss = policy term - coef * mean entropy: the gradient w.r.t. hidden states and the output
    weight equals autograd through a full [B, T, V] softmax in fp64."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 4, 8, 19
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    targets = torch.randint(V, (B, T), generator=g)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64)
    coef, temperature = 0.3, 0.9

    logp, entropy = token_logprobs(hidden, weight, targets, temperature, chunk_size=3, recompute=recompute)
    loss = -(adv * logp * MASK).sum() / MASK.sum() - coef * mean_entropy(entropy, MASK, 2)
    got = torch.autograd.grad(loss, [hidden, weight])

    logq = torch.log_softmax(hidden @ weight.T / temperature, -1)
    ref_logp = logq.gather(-1, targets[..., None])[..., 0]
    ref_entropy = -(logq.exp() * logq).sum(-1)
    ref_loss = -(adv * ref_logp * MASK).sum() / MASK.sum() - coef * (ref_entropy * MASK).sum() / MASK.sum() / 2
    want = torch.autograd.grad(ref_loss, [hidden, weight], retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got[0], torch.autograd.grad(-(adv * ref_logp * MASK).sum() / MASK.sum(), hidden)[0])


def test_a_static_coefficient_applies_from_the_first_step_and_never_moves():
    bonus = EntropyBonus(0.05)
    for _ in range(3):
        assert bonus.applied() == 0.05
        assert bonus.term(H_ROWS, MASK, 2).item() == pytest.approx(0.05 * 10 / 4 / 2)
        bonus.end_step()
    assert EntropyBonus(0.0).enabled is False and EntropyBonus(0.0, adaptive=True).enabled is True


def test_adaptive_control_follows_the_token_mean_entropy_of_each_step():
    """Skywork-OR1 / TRL: applied only while the last step's entropy <= target (never at step 1);
    after each step coef += delta if that step's entropy <= target, else -= delta, within [lo, hi]."""
    bonus = EntropyBonus(0.01, adaptive=True, target=2.0, delta=0.02, coef_min=0.0, coef_max=0.04)
    low = torch.tensor([[1.0, 1.5]])    # mean 1.25 <= target
    high = torch.tensor([[3.0, 3.0]])   # mean 3 > target
    on = torch.ones(1, 2)
    applied, coefs = [], []
    # step entropies, token-weighted over two micro-batches: step 1 = (1+1.5+3+3)/4 = 2.125 (> 2),
    # then low, low, low, high
    for micro in ([low, high], [low, low], [low, low], [low, low], [high, high]):
        applied.append(bonus.applied())
        for h in micro:
            bonus.term(h, on, 2)
        bonus.end_step()
        coefs.append(bonus.coef)
    assert applied == pytest.approx([0.0, 0.0, 0.02, 0.04, 0.04])
    assert coefs == pytest.approx([0.0, 0.02, 0.04, 0.04, 0.02])  # clamped at lo, then at hi
    assert bonus.last_entropy == pytest.approx(3.0)
    assert bonus.term(low, on, 2) == 0.0  # gated off: nothing to differentiate

    saved = bonus.state_dict()
    again = EntropyBonus(0.5, adaptive=True, target=2.0, delta=0.02, coef_min=0.0, coef_max=0.04)
    assert again.last_entropy == math.inf and again.applied() == 0.0
    again.load_state_dict(saved)
    assert (again.coef, again.last_entropy) == (bonus.coef, bonus.last_entropy)


def test_adaptive_control_measures_the_entropy_over_the_kept_tokens_not_every_valid_token():
    """docs/losses.md: with an entropy mask the controller's entropy is the token mean over the bonus's
    tokens m' = mask * entropy_mask (not the logged `entropy`, over every valid token). Reference: the
    kept tokens picked by hand (the top half of each micro-batch's distinct valid entropies) and
    their mean in plain Python."""
    from rlcore.losses.masks import entropy_mask
    from rlcore.losses.policy import policy_loss

    micro = [  # (entropy, mask): 6 then 4 valid tokens; the 9s are padding
        (torch.tensor([[0.1, 0.5, 2.0, 9.0], [0.3, 1.5, 2.5, 9.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 2)),
        (torch.tensor([[0.2, 3.0, 0.4, 4.0]]), torch.tensor([[1.0, 1.0, 1.0, 1.0]])),
    ]
    by_hand = [[[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]], [[0.0, 1.0, 0.0, 1.0]]]  # top 3 of 6, top 2 of 4
    kept_values = [2.0, 1.5, 2.5, 3.0, 4.0]
    all_values = [0.1, 0.5, 2.0, 0.3, 1.5, 2.5, 0.2, 3.0, 0.4, 4.0]
    kept_mean, all_mean = sum(kept_values) / 5, sum(all_values) / 10  # 2.6 and 1.45
    target = 2.0  # between them: the kept tokens' entropy is above it, every valid token's below
    bonus = EntropyBonus(0.1, adaptive=True, target=target, delta=0.02)
    logged = []
    for (entropy, mask), keep in zip(micro, by_hand):
        on = entropy_mask(entropy, mask, 0.5)  # as the loop builds m'
        assert on.tolist() == keep
        bonus.term(entropy, on, 2)
        zero = torch.zeros_like(entropy)
        logged.append(policy_loss(zero, zero, torch.zeros(len(zero)), mask, entropy=entropy)[1])
    bonus.end_step()
    assert bonus.last_entropy == pytest.approx(kept_mean, rel=1e-6)
    logged_mean = sum(m["entropy"] * m["tokens"] for m in logged) / sum(m["tokens"] for m in logged)
    assert logged_mean.item() == pytest.approx(all_mean, rel=1e-6)  # the logged `entropy`: every valid token
    assert abs(bonus.last_entropy - all_mean) > 1.0
    assert bonus.coef == pytest.approx(0.1 - 0.02)  # kept mean > target: down (all tokens' would go up)
