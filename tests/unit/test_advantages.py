"""GRPO advantages against hand-computed numbers: centring, population std, leave-one-out,
zero-variance groups and the broadcast onto model tokens."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from buffer.batch import is_zero_variance
from trainer.train.advantages import broadcast_to_tokens, compute_grpo_advantages


def rewards(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_mean_centred_without_std():
    # mean 0.5 -> [0.5, -0.5, -0.5, 0.5]
    adv = compute_grpo_advantages(rewards(1, 0, 0, 1), std_norm=False, leave_one_out=False,
                                  eps=1e-6)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-12)


def test_std_norm_uses_population_std_plus_eps():
    # mean 0.5, population std 0.5 -> 0.5 / (0.5 + 1e-6) = 0.999998000004
    adv = compute_grpo_advantages(rewards(1, 0, 0, 1), std_norm=True, leave_one_out=False, eps=1e-6)
    assert adv.tolist() == pytest.approx([0.999998000004, -0.999998000004,
                                          -0.999998000004, 0.999998000004], abs=1e-12)
    adv = compute_grpo_advantages(rewards(1, 0, 0, 1), std_norm=True, leave_one_out=False, eps=0.0)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-12)


def test_std_norm_asymmetric_group_tells_population_from_sample_std():
    # [2, 0, 1]: mean 1, centred [1, -1, 0]; population var (1+1+0)/3 = 2/3,
    # std 0.816496580927726 -> 1/std = 1.224744871391589. (The sample std would be 1.)
    adv = compute_grpo_advantages(rewards(2, 0, 1), std_norm=True, leave_one_out=False, eps=0.0)
    assert adv.tolist() == pytest.approx([1.224744871391589, -1.224744871391589, 0.0], abs=1e-12)


def test_leave_one_out_baseline_is_mean_of_the_others():
    # [1, 0, 0, 1]: r0 - mean(0,0,1) = 1 - 1/3 = 2/3; r1 - mean(1,0,1) = 0 - 2/3 = -2/3
    adv = compute_grpo_advantages(rewards(1, 0, 0, 1), std_norm=False, leave_one_out=True, eps=0.0)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-12)
    # [2, 0, 1]: 2 - mean(0,1) = 1.5; 0 - mean(2,1) = -1.5; 1 - mean(2,0) = 0
    adv = compute_grpo_advantages(rewards(2, 0, 1), std_norm=False, leave_one_out=True, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0], abs=1e-12)


def test_leave_one_out_with_std_divides_by_the_group_population_std():
    # LOO-centred [2/3, -2/3, -2/3, 2/3] / (group std 0.5 + 0) = [4/3, -4/3, -4/3, 4/3]
    adv = compute_grpo_advantages(rewards(1, 0, 0, 1), std_norm=True, leave_one_out=True, eps=0.0)
    assert adv.tolist() == pytest.approx([4 / 3, -4 / 3, -4 / 3, 4 / 3], abs=1e-12)
    # [2, 0, 1]: [1.5, -1.5, 0] / 0.816496580927726 = [1.837117307087383, -1.837117307087383, 0]
    adv = compute_grpo_advantages(rewards(2, 0, 1), std_norm=True, leave_one_out=True, eps=0.0)
    assert adv.tolist() == pytest.approx([1.837117307087383, -1.837117307087383, 0.0], abs=1e-12)


def test_integer_rewards_give_float_advantages():
    adv = compute_grpo_advantages(torch.tensor([1, 0]), std_norm=False, leave_one_out=False,
                                  eps=0.0)
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -0.5]


def test_zero_variance_group_is_detected_and_gets_zero_advantages():
    assert is_zero_variance(rewards(0.7, 0.7, 0.7))
    assert is_zero_variance(np.array([1.0, 1.0 + 1e-9]))
    assert not is_zero_variance(rewards(1.0, 1.0 + 1e-6))
    assert not is_zero_variance(rewards(1, 0, 0, 1))
    adv = compute_grpo_advantages(rewards(0.7, 0.7, 0.7), std_norm=True, leave_one_out=True,
                                  eps=1e-6)
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([])])
def test_group_of_fewer_than_two_is_rejected(bad):
    with pytest.raises(ValueError, match="train.group_size"):
        compute_grpo_advantages(bad, std_norm=True, leave_one_out=False, eps=1e-6)


def test_non_1d_rewards_are_rejected():
    with pytest.raises(ValueError, match="1-D"):
        compute_grpo_advantages(torch.zeros(2, 2), std_norm=True, leave_one_out=False, eps=1e-6)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        is_zero_variance(torch.zeros(0))


def test_broadcast_puts_the_advantage_on_model_tokens_only():
    mask_BT = torch.tensor([[1, 1, 0, 1], [0, 1, 0, 0]], dtype=torch.int8)
    adv_BT = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask_BT)
    torch.testing.assert_close(adv_BT, torch.tensor([[2.0, 2.0, 0.0, 2.0], [0.0, -1.0, 0.0, 0.0]]),
                               rtol=0, atol=0)


def test_broadcast_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="one advantage per row"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 4))
    with pytest.raises(ValueError, match="2-D"):
        broadcast_to_tokens(torch.tensor([1.0]), torch.ones(4))
