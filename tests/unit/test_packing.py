"""Packing of trajectories into padding-free micro-batches, checked against literal tensors
on a hand-made example; the token-budget planner; unpacking; the block-diagonal attention
mask; and the micro-batch loss weights that keep token_mean exact under accumulation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from envs.types import Trajectory
from trainer.train.backends.logprobs import build_block_causal_mask, compute_logprobs_from_logits
from trainer.train.backends.packing import (build_micro_batches, pack_trajectories,
                                            plan_micro_batches, split_minibatches, unpack_responses,
                                            unpack_sequences, unpack_to_rows)
from trainer.train.backends.step import (compute_combined_metrics, compute_micro_batch_weights,
                                         compute_warmup_factor)
from trainer.train.loss import LossMetrics


def make_traj(prompt, response, mask, logprobs=None, index=0) -> Trajectory:
    mask = np.asarray(mask)
    if logprobs is None:
        logprobs = np.where(mask == 1, -0.5, 0.0)
    return Trajectory(task_id="t", group_id="g", index=index, prompt_ids=prompt,
                      response_ids=response, response_mask=mask, logprobs=logprobs,
                      versions=np.where(mask == 1, 0, -1), termination="finished")


@pytest.fixture
def two_trajs() -> list[Trajectory]:
    # A: prompt of 2, response of 3 with a tool token (mask 0) in the middle.
    a = make_traj([10, 11], [20, 21, 22], [1, 0, 1], [-0.5, 0.0, -0.25])
    # B: prompt of 1, response of 2 model tokens.
    b = make_traj([30], [40, 41], [1, 1], [-1.0, -2.0], index=1)
    return [a, b]


def test_hand_made_pair_packs_to_literal_tensors(two_trajs):
    packed = pack_trajectories(two_trajs, torch.tensor([2.0, -1.0]))
    assert packed.input_ids_T.tolist() == [10, 11, 20, 21, 22, 30, 40, 41]
    # Positions restart at 0 where B starts.
    assert packed.position_ids_T.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # Targets: the next token of the same sequence; a sequence's last position has none (0).
    assert packed.target_ids_T.tolist() == [11, 20, 21, 22, 0, 40, 41, 0]
    # Position t is trained iff its target is a model token: A's 20 and 22, B's 40 and 41.
    assert packed.loss_mask_T.tolist() == [False, True, False, True, False, True, True, False]
    assert packed.behaviour_logprobs_T.tolist() == [0, -0.5, 0, -0.25, 0, -1.0, -2.0, 0]
    assert packed.advantages_T.tolist() == [0, 2.0, 0, 2.0, 0, -1.0, -1.0, 0]
    assert packed.seq_index_T.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert packed.cu_seqlens.tolist() == [0, 5, 8]
    assert packed.cu_seqlens.dtype == torch.int32
    assert (packed.num_tokens, packed.num_seqs, packed.num_model_tokens) == (8, 2, 4)
    assert packed.max_seqlen == 5 and packed.prompt_lens == (2, 1)


def test_fully_masked_trajectory_has_no_targets_and_counts_no_sequence(two_trajs):
    tool_only = make_traj([5, 6], [7, 8], [0, 0], index=2)
    packed = pack_trajectories([two_trajs[0], tool_only], torch.tensor([1.0, 3.0]))
    assert packed.loss_mask_T[5:].tolist() == [False] * 4
    assert packed.advantages_T[5:].tolist() == [0.0] * 4  # no signal on environment tokens
    assert packed.num_model_seqs == 1


def test_block_causal_mask_keeps_sequences_apart(two_trajs):
    packed = pack_trajectories(two_trajs, torch.tensor([2.0, -1.0]))
    allowed = build_block_causal_mask(packed)[0, 0].int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    assert torch.equal(allowed, expected)


def test_plan_is_first_fit_decreasing_within_the_budget():
    # Visit order by length: 4 (6), 0 (5), 2 (4), 1 (3), 3 (2); budget 8.
    # 4 -> bin0 (6); 0 -> bin1 (5); 2 -> bin2 (4); 1 -> bin1 (8); 3 -> bin0 (8).
    assert plan_micro_batches([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]
    assert plan_micro_batches([5, 3, 4, 2, 6], 100) == [[0, 1, 2, 3, 4]]
    assert plan_micro_batches([5, 3, 4, 2, 6], 1) == [[4], [0], [2], [1], [3]]


def test_oversize_trajectory_gets_its_own_micro_batch():
    assert plan_micro_batches([10, 2, 3], 4) == [[0], [2], [1]]
    long = make_traj(list(range(1, 7)), [7, 8, 9, 10], [1, 1, 1, 1])
    short = [make_traj([1], [2], [1], index=i) for i in range(1, 3)]
    batches = build_micro_batches([long, *short], torch.tensor([1.0, 0.5, -0.5]), max_tokens=4)
    assert [b.traj_indices for b in batches] == [(0,), (1, 2)]
    assert [b.num_tokens for b in batches] == [10, 4]  # 10 > budget: the oversize one


def test_micro_batches_cover_every_trajectory_once_and_respect_the_budget():
    rng = np.random.default_rng(0)
    trajs = [make_traj(rng.integers(1, 500, rng.integers(1, 20)).tolist(),
                       rng.integers(1, 500, n).tolist(), rng.integers(0, 2, n), index=i)
             for i, n in enumerate(rng.integers(1, 40, 17))]
    batches = build_micro_batches(trajs, torch.arange(17.0), max_tokens=64)
    seen = sorted(i for b in batches for i in b.traj_indices)
    assert seen == list(range(17))
    assert all(b.num_tokens <= 64 for b in batches)
    assert len(batches) > 1
    again = build_micro_batches(trajs, torch.arange(17.0), max_tokens=64)
    assert [b.traj_indices for b in again] == [b.traj_indices for b in batches]  # deterministic


def test_unpack_round_trip_restores_each_trajectory(two_trajs):
    trajs = [*two_trajs, make_traj([1, 2, 3], [4, 5, 6, 7], [0, 1, 1, 0], index=2)]
    batches = build_micro_batches(trajs, torch.tensor([2.0, -1.0, 0.5]), max_tokens=8)
    assert len(batches) == 2
    for packed in batches:
        ids = unpack_sequences(packed, packed.input_ids_T)
        behav = unpack_responses(packed, packed.behaviour_logprobs_T)
        mask = unpack_responses(packed, packed.loss_mask_T)
        for k, i in enumerate(packed.traj_indices):
            assert ids[k].tolist() == trajs[i].input_ids().tolist()
            assert np.array_equal(behav[k].numpy(), trajs[i].logprobs)
            assert mask[k].int().tolist() == trajs[i].response_mask.tolist()


def test_unpack_to_rows_pads_per_sequence_and_passes_gradients(two_trajs):
    packed = pack_trajectories(two_trajs, torch.tensor([2.0, -1.0]))
    values_T = torch.arange(8.0, requires_grad=True)
    rows_BT = unpack_to_rows(packed, values_T, fill=-1.0)
    assert rows_BT.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1]]
    rows_BT.sum().backward()
    assert values_T.grad.tolist() == [1.0] * 8


def test_bad_inputs_raise_with_the_fix(two_trajs):
    with pytest.raises(ValueError, match="one advantage per trajectory"):
        pack_trajectories(two_trajs, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        build_micro_batches(two_trajs, torch.tensor([1.0, 2.0]), max_tokens=0)
    with pytest.raises(ValueError, match="num_minibatches"):
        split_minibatches(2, 3)
    with pytest.raises(ValueError, match="no trajectories"):
        pack_trajectories([], torch.zeros(0))
    assert split_minibatches(5, 2) == [[0, 1, 2], [3, 4]]


class FakeOps:
    """Stands in for a backend's StepOps in the weight arithmetic (no model involved)."""

    def __init__(self, world_size: int = 1, others_total: float = 0.0) -> None:
        self.world_size = world_size
        self._others = others_total

    def all_reduce(self, values: list[float], op: str) -> list[float]:
        return [v + self._others for v in values] if op == "sum" else values


def _micro_means(values: list[list[float]]) -> list[float]:
    return [sum(v) / len(v) for v in values]


def test_token_mean_weights_make_accumulation_exact(two_trajs):
    # Micro-batches with 4 and 1 model tokens: the naive mean of means is wrong.
    third = make_traj([1], [2, 3], [1, 0], index=2)
    batches = [pack_trajectories(two_trajs, torch.tensor([1.0, 1.0])),
               pack_trajectories([third], torch.tensor([1.0]))]
    token_losses = [[1.0, 2.0, 3.0, 4.0], [10.0]]
    weights = compute_micro_batch_weights(batches, "token_mean", FakeOps())
    assert weights == [4 / 5, 1 / 5]
    accumulated = sum(w * m for w, m in zip(weights, _micro_means(token_losses)))
    assert accumulated == pytest.approx(20.0 / 5)
    assert sum(_micro_means(token_losses)) / 2 != pytest.approx(20.0 / 5)
    # Sequence means weigh by sequences with a model token (2 and 1).
    assert compute_micro_batch_weights(batches, "seq_mean_token_mean", FakeOps()) == [2 / 3, 1 / 3]
    # Two ranks, the other holding 5 model tokens: shares of 10, times 2 for DP averaging.
    assert compute_micro_batch_weights(batches, "token_mean", FakeOps(2, 5.0)) == [0.8, 0.2]


def test_combined_metrics_weigh_fractions_by_tokens_and_losses_by_share():
    base = LossMetrics(loss=1.0, policy_loss=1.0, clip_frac=0.5, dual_clip_frac=0.0,
                       is_weight_mean=1.0, is_weight_max=1.5, is_capped_frac=0.0,
                       mismatch_kl=0.0, approx_kl=0.0, kl_ref=float("nan"),
                       entropy=float("nan"), num_tokens=3, num_seqs=1)
    other = dataclasses.replace(base, loss=4.0, policy_loss=4.0, clip_frac=0.0,
                                is_weight_max=3.0, num_tokens=1, num_seqs=2)
    out = compute_combined_metrics([base, other], [0.75, 0.25])
    assert out.loss == pytest.approx(1.75) and out.clip_frac == pytest.approx(0.375)
    assert (out.is_weight_max, out.num_tokens, out.num_seqs) == (3.0, 4, 3)


def test_warmup_is_linear_and_the_first_step_moves():
    assert [compute_warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert compute_warmup_factor(0, 0) == 1.0


def test_logprobs_and_entropy_from_logits_match_log_softmax():
    logits_TV = torch.randn(5, 7, dtype=torch.float64)
    targets_T = torch.tensor([0, 6, 3, 3, 1])
    logp_T, ent_T = compute_logprobs_from_logits(logits_TV, targets_T, 0.7, with_entropy=True)
    assert logp_T.dtype == ent_T.dtype == torch.float32  # computed in fp32 whatever comes in
    ref_TV = torch.log_softmax(logits_TV / 0.7, dim=-1)  # the fp64 truth, another formula
    fp32 = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's float32 defaults
    torch.testing.assert_close(logp_T.double(), ref_TV[torch.arange(5), targets_T], **fp32)
    torch.testing.assert_close(ent_T.double(), -(ref_TV.exp() * ref_TV).sum(-1), **fp32)
