"""The decoupled PPO loss against hand-computed numbers, an independent standard PPO-clip
GRPO reference on-policy, and the masking guarantees (no NaN leaks, zero gradients)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from trainer.train.config import LossConfig
from trainer.train.loss import compute_policy_loss, compute_token_aggregate

LN2 = math.log(2.0)


def make_cfg(**over) -> LossConfig:
    # eps_low 0.2, eps_high 0.28 -> the ratio is clipped to [0.8, 1.28]
    base = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=None, is_mode="mask", is_min=0.0,
                is_max=5.0, aggregation="token_mean", kl_coef=0.0, entropy_coef=0.0)
    base.update(over)
    return dataclasses.replace(LossConfig(), **base)


def hand_batch():
    """Two sequences, T = 3, proximal logprob -1 on every model token; cur = -1 + ln(ratio),
    behav = -1 - ln(w).

    seq 0, A = +1, mask [1 1 1]:
      t0 ratio 1.5 w 1: -min(1.5, 1.28)       = -1.28   clipped
      t1 ratio 0.5 w 1: -min(0.5, 0.8)        = -0.5    (positive A below the range: no clip)
      t2 ratio 1.0 w 2: -min(1.0, 1.0) * 2    = -2.0
      sum -3.78, mean -1.26
    seq 1, A = -0.5, mask [1 1 0]:
      t0 ratio 0.5 w 1: -min(-0.25, -0.4)     =  0.4    clipped
      t1 ratio 1.5 w 1: -min(-0.75, -0.64)    =  0.75
      t2 masked: garbage values that must not matter
      sum 1.15, mean 0.575
    """
    ratio_BT = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]], dtype=torch.float64)
    cur_BT = (-1.0 + ratio_BT.log())
    cur_BT[1, 2] = 30.0
    prox_BT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -40.0]], dtype=torch.float64)
    behav_BT = torch.tensor([[-1.0, -1.0, -1.0 - LN2], [-1.0, -1.0, 7.0]], dtype=torch.float64)
    adv_BT = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 1e6]], dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.int8)
    return cur_BT.requires_grad_(True), prox_BT, behav_BT, adv_BT, mask_BT


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", -0.526),  # (-3.78 + 1.15) / 5 model tokens
    ("seq_mean_token_mean", -0.3425),  # (-1.26 + 0.575) / 2 sequences
    ("seq_mean_token_sum_norm", -0.43833333333333335),  # (-3.78/3 + 1.15/3) / 2, T = 3
])
def test_hand_example_for_each_aggregation(aggregation, expected):
    loss, m = compute_policy_loss(*hand_batch(), make_cfg(aggregation=aggregation))
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m.loss == m.policy_loss == pytest.approx(expected, abs=1e-12)


def test_sum_norm_constant_can_be_fixed_by_the_caller():
    # per-sequence sums -3.78 and 1.15 divided by 6 instead of T = 3, then averaged
    loss, _ = compute_policy_loss(*hand_batch(), make_cfg(aggregation="seq_mean_token_sum_norm"),
                                  sum_norm_tokens=6)
    assert loss.item() == pytest.approx(-0.21916666666666667, abs=1e-12)


def test_hand_example_gradient_is_zero_on_clipped_and_masked_tokens():
    cur_BT, *rest = hand_batch()
    loss, _ = compute_policy_loss(cur_BT, *rest, make_cfg())
    loss.backward()
    # d/dcur of -w*ratio*A / 5 is -w*ratio*A/5 on unclipped tokens:
    # seq0 t1 -0.5/5 = -0.1, seq0 t2 -2*1/5 = -0.4, seq1 t1 -1.5*(-0.5)/5 = 0.15
    torch.testing.assert_close(cur_BT.grad, torch.tensor([[0.0, -0.1, -0.4], [0.0, 0.15, 0.0]],
                                                         dtype=torch.float64))


def test_hand_example_metrics():
    _, m = compute_policy_loss(*hand_batch(), make_cfg())
    assert m.num_tokens == 5 and m.num_seqs == 2
    assert m.clip_frac == pytest.approx(0.4)  # seq0 t0 and seq1 t0
    assert m.dual_clip_frac == 0.0
    assert m.is_weight_mean == pytest.approx(1.2)  # (1 + 1 + 2 + 1 + 1) / 5
    assert m.is_weight_max == pytest.approx(2.0)
    assert m.is_capped_frac == 0.0
    # k3(prox - behav): w - 1 - ln w is 1 - ln 2 = 0.30685281944 on the w = 2 token, 0 elsewhere
    assert m.mismatch_kl == pytest.approx(0.061370563888010946, abs=1e-12)
    # k3(cur - prox): r - 1 - ln r = 0.0945348919 (r 1.5, twice), 0.1931471806 (r 0.5, twice)
    assert m.approx_kl == pytest.approx(0.11507282898071236, abs=1e-12)
    assert math.isnan(m.kl_ref) and math.isnan(m.entropy)
    assert m.to_log()["loss/clip_frac"] == pytest.approx(0.4)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
def test_fully_masked_sequence_changes_nothing(aggregation):
    cur_BT, prox_BT, behav_BT, adv_BT, mask_BT = hand_batch()
    base, _ = compute_policy_loss(cur_BT, prox_BT, behav_BT, adv_BT, mask_BT,
                                  make_cfg(aggregation=aggregation))

    def pad(x):
        return torch.cat([x.detach(), torch.full_like(x[:1], 3.0)])

    loss, m = compute_policy_loss(pad(cur_BT), pad(prox_BT), pad(behav_BT), pad(adv_BT),
                                  torch.cat([mask_BT, torch.zeros_like(mask_BT[:1])]),
                                  make_cfg(aggregation=aggregation))
    assert loss.item() == pytest.approx(base.item(), abs=1e-12)
    assert m.num_seqs == 2 and m.num_tokens == 5


# ---- on-policy equivalence with an independently written standard PPO-clip GRPO loss ----

def reference_grpo_ppo_loss(cur_BT, old_BT, adv_B, mask_BT, aggregation, eps_low, eps_high):
    """Textbook PPO-clip with old = sampling policy, one advantage per sequence, loops."""
    seq_terms, seq_lens = [], []
    for b in range(cur_BT.shape[0]):
        terms = []
        for t in range(cur_BT.shape[1]):
            if mask_BT[b, t] == 1:
                ratio = torch.exp(cur_BT[b, t] - old_BT[b, t])
                objective = torch.min(ratio * adv_B[b],
                                      torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv_B[b])
                terms.append(-objective)
        seq_terms.append(terms)
        seq_lens.append(len(terms))
    if aggregation == "token_mean":
        return sum(sum(ts) for ts in seq_terms) / sum(seq_lens)
    if aggregation == "seq_mean_token_mean":
        return sum(sum(ts) / len(ts) for ts in seq_terms) / len(seq_terms)
    return sum(sum(ts) / cur_BT.shape[1] for ts in seq_terms) / len(seq_terms)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("is_mode", ["mask", "clamp", "off"])
@pytest.mark.parametrize("current_moved", [False, True])
def test_on_policy_equals_standard_ppo_clip_grpo(aggregation, is_mode, current_moved):
    gen = torch.Generator().manual_seed(7)
    B, T = 4, 7
    behav_BT = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    mask_BT = (torch.rand(B, T, generator=gen) < 0.7).to(torch.int8)
    mask_BT[:, 0] = 1  # every sequence has a model token
    adv_B = torch.tensor([1.3, -0.7, 0.4, -2.0], dtype=torch.float64)
    # current == proximal == behaviour, or current moved by one optimizer step (ratios
    # roughly 0.5..2, so some tokens clip) while proximal == behaviour (no staleness)
    shift_BT = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4 if current_moved else 0
    cur_BT = (behav_BT + shift_BT).requires_grad_(True)
    ref_cur_BT = cur_BT.detach().clone().requires_grad_(True)

    adv_BT = adv_B[:, None].expand(B, T) * mask_BT
    cfg = make_cfg(aggregation=aggregation, is_mode=is_mode)
    loss, m = compute_policy_loss(cur_BT, behav_BT.clone(), behav_BT, adv_BT, mask_BT, cfg)
    expected = reference_grpo_ppo_loss(ref_cur_BT, behav_BT, adv_B, mask_BT, aggregation,
                                       cfg.eps_low, cfg.eps_high)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(cur_BT.grad, ref_cur_BT.grad)
    assert m.is_weight_mean == 1.0 and m.mismatch_kl == 0.0 and m.is_capped_frac == 0.0
    assert (m.clip_frac > 0) == current_moved


# ---- behaviour importance weight ----

def is_batch():
    """One sequence, ratio 1, A = 1 (pg = -1 per token), w = [1, 8, 0.25]."""
    cur_BT = torch.full((1, 3), -1.0, dtype=torch.float64, requires_grad=True)
    prox_BT = torch.full((1, 3), -1.0, dtype=torch.float64)
    behav_BT = torch.tensor([[-1.0, -1.0 - math.log(8.0), -1.0 + math.log(4.0)]],
                            dtype=torch.float64)
    return cur_BT, prox_BT, behav_BT, torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3)


@pytest.mark.parametrize("is_mode, expected_loss, expected_grad, capped", [
    # mask: w = 8 > 5 and w = 0.25 < 0.5 leave the numerator, denominator stays 3: -1/3
    ("mask", -1 / 3, [-1 / 3, 0.0, 0.0], 2 / 3),
    # clamp: weights [1, 5, 0.5] -> (-1 - 5 - 0.5) / 3
    ("clamp", -6.5 / 3, [-1 / 3, -5 / 3, -0.5 / 3], 2 / 3),
    # off: weights [1, 1, 1] -> -3 / 3
    ("off", -1.0, [-1 / 3, -1 / 3, -1 / 3], 0.0),
])
def test_is_mode_mask_clamp_off(is_mode, expected_loss, expected_grad, capped):
    cur_BT, *rest = is_batch()
    cfg = make_cfg(is_mode=is_mode, is_min=0.5, is_max=5.0)
    loss, m = compute_policy_loss(cur_BT, *rest, cfg)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(cur_BT.grad, torch.tensor([expected_grad], dtype=torch.float64))
    assert m.is_capped_frac == pytest.approx(capped)
    assert m.is_weight_mean == pytest.approx((1 + 8 + 0.25) / 3)  # raw weights in every mode
    assert m.is_weight_max == pytest.approx(8.0)
    assert m.num_tokens == 3


def test_masked_weight_of_infinity_does_not_poison_the_loss():
    cur_BT, prox_BT, behav_BT, adv_BT, mask_BT = is_batch()
    behav_BT[0, 1] = -1e4  # w = exp(1e4 - 1) = inf
    loss, m = compute_policy_loss(cur_BT, prox_BT, behav_BT, adv_BT, mask_BT, make_cfg())
    assert math.isfinite(loss.item()) and math.isinf(m.is_weight_max)


# ---- dual clip ----

def test_dual_clip_caps_the_loss_of_negative_advantages():
    # c = 1.4
    #   A -0.5, ratio 1.5:    -min(-0.75, -0.64) = 0.75 > 1.4 * 0.5 -> capped to 0.7
    #   A -0.5, ratio 1.1:    in range -> 0.55 < 0.7, unchanged
    #   A +1,   ratio 3.0:    -min(3, 1.28) = -1.28; dual clip never applies to A > 0
    ratio = torch.tensor([[1.5, 1.1, 3.0]], dtype=torch.float64)
    cur_BT = ratio.log().requires_grad_(True)
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    adv_BT = torch.tensor([[-0.5, -0.5, 1.0]], dtype=torch.float64)
    args = (zeros, zeros, adv_BT, torch.ones(1, 3))
    loss, m = compute_policy_loss(cur_BT, *args, make_cfg(dual_clip_c=1.4))
    assert loss.item() == pytest.approx((0.7 + 0.55 - 1.28) / 3, abs=1e-12)
    assert m.dual_clip_frac == pytest.approx(1 / 3) and m.clip_frac == pytest.approx(1 / 3)
    loss.backward()
    # only the in-range token moves the policy: d(-ratio*A)/dcur / 3 = 1.1 * 0.5 / 3
    torch.testing.assert_close(cur_BT.grad, torch.tensor([[0.0, 0.55 / 3, 0.0]],
                                                         dtype=torch.float64))
    no_dual, _ = compute_policy_loss(cur_BT.detach(), *args, make_cfg())
    assert no_dual.item() == pytest.approx((0.75 + 0.55 - 1.28) / 3, abs=1e-12)


def test_dual_clip_bounds_a_huge_ratio():
    cur_BT = torch.tensor([[10.0]], dtype=torch.float64)  # ratio e^10
    zeros = torch.zeros(1, 1, dtype=torch.float64)
    adv_BT = torch.tensor([[-0.5]], dtype=torch.float64)
    loss, _ = compute_policy_loss(cur_BT, zeros, zeros, adv_BT, torch.ones(1, 1),
                                  make_cfg(dual_clip_c=1.4))
    assert loss.item() == pytest.approx(0.7, abs=1e-12)


# ---- KL to the reference and entropy ----

def test_k3_kl_to_reference_by_hand():
    # A = 0 so the policy term is 0; ref - cur = [ln 2, -ln 2, 0, masked]:
    # k3 = e^x - x - 1 = [1 - ln 2, ln 2 - 0.5, 0] -> sum 0.5
    cur_BT = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    ref_BT = torch.tensor([[-1.0 + LN2, -1.0 - LN2, -1.0, float("nan")]], dtype=torch.float64)
    zeros = torch.zeros(1, 4, dtype=torch.float64)
    mask_BT = torch.tensor([[1, 1, 1, 0]])
    loss, m = compute_policy_loss(cur_BT, cur_BT.detach(), cur_BT.detach(), zeros, mask_BT,
                                  make_cfg(kl_coef=0.1), ref_logprobs_BT=ref_BT)
    assert m.kl_ref == pytest.approx(0.5 / 3, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * 0.5 / 3, abs=1e-12)
    loss.backward()
    # d k3 / d cur = 1 - e^(ref - cur) = [-1, 0.5, 0], times kl_coef / 3 tokens
    torch.testing.assert_close(cur_BT.grad, torch.tensor([[-0.1 / 3, 0.05 / 3, 0.0, 0.0]],
                                                         dtype=torch.float64))
    # same aggregation as the policy term: sum 0.5 / T = 4, one sequence
    _, m = compute_policy_loss(cur_BT, cur_BT.detach(), cur_BT.detach(), zeros, mask_BT,
                               make_cfg(kl_coef=0.1, aggregation="seq_mean_token_sum_norm"),
                               ref_logprobs_BT=ref_BT)
    assert m.kl_ref == pytest.approx(0.125, abs=1e-12)


def test_kl_coef_without_reference_is_a_config_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss.kl_coef"):
        compute_policy_loss(x, x, x, x, torch.ones(1, 2), make_cfg(kl_coef=0.1))


def test_entropy_bonus_is_subtracted():
    cur_BT = torch.full((1, 3), -1.0, dtype=torch.float64)
    entropy_BT = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    loss, m = compute_policy_loss(cur_BT, cur_BT, cur_BT, zeros, torch.tensor([[1, 1, 0]]),
                                  make_cfg(entropy_coef=0.01), entropy_BT=entropy_BT)
    assert m.entropy == pytest.approx(1.5)  # mean of 1 and 2
    assert loss.item() == pytest.approx(-0.015, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(entropy_BT.grad, torch.tensor([[-0.005, -0.005, 0.0]],
                                                             dtype=torch.float64))
    with pytest.raises(ValueError, match="loss.entropy_coef"):
        compute_policy_loss(cur_BT, cur_BT, cur_BT, zeros, torch.ones(1, 3),
                            make_cfg(entropy_coef=0.01))


# ---- masking guarantees and input checks ----

@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("is_mode", ["mask", "clamp", "off"])
def test_garbage_at_masked_positions_cannot_leak(aggregation, is_mode):
    gen = torch.Generator().manual_seed(3)
    mask_BT = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]])
    masked = mask_BT == 0
    garbage = torch.tensor([float("nan"), 1e30, -float("inf"), float("inf"), float("nan")])

    def with_garbage(x_BT):
        x_BT = x_BT.clone()
        x_BT[masked] = garbage
        return x_BT

    clean = [-torch.rand(2, 5, generator=gen) * 2 for _ in range(4)]  # cur, prox, behav, ref
    adv_BT = torch.randn(2, 5, generator=gen)
    entropy_BT = torch.rand(2, 5, generator=gen)
    cfg = make_cfg(aggregation=aggregation, is_mode=is_mode, dual_clip_c=3.0, kl_coef=0.05,
                   entropy_coef=0.01)
    losses, grads = [], []
    for prep in (lambda x: x.clone(), with_garbage):
        cur_BT = prep(clean[0]).requires_grad_(True)
        ent_BT = prep(entropy_BT).requires_grad_(True)
        loss, _ = compute_policy_loss(cur_BT, prep(clean[1]), prep(clean[2]), prep(adv_BT),
                                      mask_BT, cfg, ref_logprobs_BT=prep(clean[3]),
                                      entropy_BT=ent_BT)
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.all(cur_BT.grad[masked] == 0) and torch.all(ent_BT.grad[masked] == 0)
        assert torch.isfinite(cur_BT.grad).all() and cur_BT.grad[~masked].abs().sum() > 0
        losses.append(loss.detach())
        grads.append(cur_BT.grad)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_bf16_inputs_are_computed_in_float32():
    x = torch.full((1, 2), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = compute_policy_loss(x, x.detach(), x.detach(), torch.ones(1, 2), torch.ones(1, 2),
                                  make_cfg())
    assert loss.dtype == torch.float32 and loss.item() == -1.0


@pytest.mark.parametrize("name, index", [("proximal_logprobs_BT", 1), ("behaviour_logprobs_BT", 2),
                                         ("advantages_BT", 3), ("mask_BT", 4)])
def test_shape_mismatch_names_the_tensor(name, index):
    args = [torch.zeros(2, 3) for _ in range(5)]
    args[index] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=f"{name} has shape \\(2, 4\\)"):
        compute_policy_loss(*args, make_cfg())


def test_bad_inputs_and_config_are_rejected():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="2-D"):
        compute_policy_loss(torch.zeros(3), *[torch.zeros(3)] * 4, make_cfg())
    with pytest.raises(ValueError, match="ref_logprobs_BT has shape"):
        compute_policy_loss(x, x, x, x, x, make_cfg(), ref_logprobs_BT=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="loss.aggregation"):
        compute_policy_loss(x, x, x, x, x, make_cfg(aggregation="sum"))
    with pytest.raises(ValueError, match="loss.is_mode"):
        compute_policy_loss(x, x, x, x, x, make_cfg(is_mode="truncate"))


def test_aggregate_of_an_all_masked_batch_is_zero():
    values = torch.ones(2, 3)
    none = torch.zeros(2, 3, dtype=torch.bool)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert compute_token_aggregate(values, none, aggregation).item() == 0.0
