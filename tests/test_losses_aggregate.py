"""loss_type aggregation (SPEC section 5): closed forms and micro-batch split (in)variance."""

import warnings

import pytest
import torch

from rlcore.losses.aggregate import aggregate_loss
from rlcore.losses.policy import check_loss_options

# row 0: 3 valid tokens summing to 6; row 1: 1 valid token = 4; 100s are padding
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def agg(loss_type, per_token=PER_TOKEN, mask=MASK, **kwargs):
    kwargs = dict(gradient_accumulation_steps=2, max_completion_length=8, **kwargs)
    return aggregate_loss(per_token, mask, loss_type, **kwargs)


def test_grpo_is_mean_of_per_sequence_token_means_over_ga():
    assert agg("grpo").item() == pytest.approx((6 / 3 + 4 / 1) / 2 / 2)


def test_grpo_counts_a_fully_masked_row_in_the_mean_over_rows():
    # SPEC 5 and 8: the mean is over all B rows; the masked row contributes 0 (not left out)
    mask = torch.cat([MASK, torch.zeros(1, 4)])
    per_token = torch.cat([PER_TOKEN, torch.full((1, 4), 7.0)])
    assert agg("grpo", per_token, mask).item() == pytest.approx((6 / 3 + 4 / 1 + 0) / 3 / 2)


def test_bnpo_is_micro_batch_token_mean_over_ga():
    assert agg("bnpo").item() == pytest.approx(10 / 4 / 2)


def test_dr_grpo_divides_by_rows_times_max_completion_length_over_ga():
    assert agg("dr_grpo").item() == pytest.approx(10 / (2 * 8) / 2)


def test_luspo_is_mean_of_per_sequence_token_sums_over_ga():
    # TRL's luspo: (l * m).sum(-1).mean() / GA; a row's loss grows with its length
    assert agg("luspo").item() == pytest.approx((6 + 4) / 2 / 2)


def test_dapo_divides_by_step_tokens_per_rank():
    assert agg("dapo", step_tokens=20, world_size=2).item() == pytest.approx(10 / 10)


def test_dapo_accepts_step_tokens_as_a_tensor():
    assert agg("dapo", step_tokens=torch.tensor(20.0), world_size=2).item() == pytest.approx(1.0)


def test_dapo_without_step_tokens_raises():
    with pytest.raises(ValueError, match="step_tokens"):
        agg("dapo")


def test_unknown_loss_type_lists_valid_ones():
    with pytest.raises(ValueError, match="'gspo'; valid: grpo, bnpo, dr_grpo, dapo"):
        agg("gspo")


# Split (in)variance ------------------------------------------------------------------------

LENGTHS = [1, 3, 4, 2]  # active tokens per row: 10 in the step


def step_gradient(loss_type, micro_batches, world_size=1):
    """Gradient of one optimizer step whose rows are split as `micro_batches` (lists of row ids).
    With world_size > 1 the micro-batches are dealt round-robin to ranks and the ranks'
    gradients averaged, as DDP does."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=gen)
    mask = (torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    theta = torch.zeros(4, requires_grad=True)
    ga = len(micro_batches) // world_size
    rank_grads = []
    for rank in range(world_size):
        theta.grad = None
        for rows in micro_batches[rank::world_size]:
            per_token = (x[rows] - theta) ** 2  # any differentiable per-token loss
            aggregate_loss(per_token, mask[rows], loss_type, gradient_accumulation_steps=ga,
                           max_completion_length=4, step_tokens=mask.sum(),
                           world_size=world_size).backward()
        rank_grads.append(theta.grad.clone())
    return torch.stack(rank_grads).mean(0)


def test_dapo_step_gradient_does_not_depend_on_the_split():
    whole = step_gradient("dapo", [[0, 1, 2, 3]])
    for split in ([[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0], [1], [2], [3]]):
        torch.testing.assert_close(step_gradient("dapo", split), whole, rtol=1e-6, atol=1e-7)


def test_dapo_step_gradient_does_not_depend_on_the_number_of_ranks():
    whole = step_gradient("dapo", [[0, 1, 2, 3]])
    torch.testing.assert_close(step_gradient("dapo", [[0], [1, 2, 3]], world_size=2), whole,
                               rtol=1e-6, atol=1e-7)


def test_bnpo_step_gradient_depends_on_the_split():
    # [0, 1] has 4 tokens and [2, 3] has 6: per-micro-batch means weight tokens unequally
    whole = step_gradient("bnpo", [[0, 1, 2, 3]])
    split = step_gradient("bnpo", [[0, 1], [2, 3]])
    assert (split - whole).abs().max().item() > 1e-3


# Option checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo"])
def test_gspo_with_a_token_summing_loss_type_warns(loss_type):
    with pytest.warns(UserWarning, match="weighted by its length"):
        check_loss_options(loss_type, importance_sampling_level="sequence")


def test_gspo_with_grpo_aggregation_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_loss_options("grpo", importance_sampling_level="sequence")


def test_cispo_with_default_epsilon_high_warns():
    with pytest.warns(UserWarning, match="cispo"):
        check_loss_options("dapo", policy_loss="cispo")


def test_cispo_with_explicit_epsilon_high_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_loss_options("dapo", policy_loss="cispo", epsilon_high=5.0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(loss_type="drgrpo"), "loss_type"),
    (dict(loss_type="dapo", policy_loss="reinforce"), "policy_loss"),
    (dict(loss_type="dapo", importance_sampling_level="seq"), "importance_sampling_level"),
])
def test_check_loss_options_rejects_unknown_names(kwargs, name):
    with pytest.raises(ValueError, match=f"unknown {name} "):
        check_loss_options(**kwargs)
