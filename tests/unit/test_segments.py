"""Samples split into segments (a black-box harness that rewrote its history): the group
holds every segment, the baseline is taken over samples (hand-computed values), each
segment gets its sample's advantage, reward and ending, metrics count samples, and the
worker joins what a loop left on ctx.segments, on a timeout too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from buffer.batch import TrainBatch
from buffer.replay_buffer import ReplayBuffer
from envs.types import NO_VERSION, Group, Task, Message, TerminationReason, Trajectory
from rollout.gateway.server import GatewayStats
from rollout.recorder import TrajectoryRecorder
from rollout.worker import WorkerStats
from tests.unit.test_agent_loop import make_worker
from trainer.train.advantages import compute_group_advantages
from trainer.train.config import LossConfig
from trainer.run.metrics import compute_batch_metrics, compute_loop_metrics


def row(index: int, reward: float | None, segment: int = 0, termination: str = "finished",
        num_model: int = 2) -> Trajectory:
    return Trajectory("t", "g", index, [1, 2], [3] * num_model + [4], [1] * num_model + [0],
                      [-0.5] * num_model + [0.0], [0] * num_model + [NO_VERSION], termination,
                      reward=reward, segment=segment)


# Sample 0 was split in two segments; samples 1 and 2 are one trajectory each.
ROWS = (row(0, 1.0, 0), row(0, 1.0, 1), row(1, 0.0), row(2, 0.5))


def loss(**over) -> LossConfig:
    return dataclasses.replace(LossConfig(), **{"adv_std_norm": False, "adv_leave_one_out": False,
                                                "adv_eps": 0.0, **over})


def test_a_group_holds_segments_and_one_reward_per_sample():
    group = Group("t", "g", ROWS)
    assert group.size == 4 and group.num_samples == 3
    assert group.rewards().tolist() == [1.0, 0.0, 0.5]  # per sample, not per row
    assert group.sample_of_rows().tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="segments \\[0, 2\\]"):
        Group("t", "g", (row(0, 1.0, 0), row(0, 1.0, 2), row(1, 0.0)))
    with pytest.raises(ValueError, match="different rewards"):
        Group("t", "g", (row(0, 1.0, 0), row(0, 0.0, 1), row(1, 0.0)))


def test_advantages_are_over_samples_and_given_to_every_segment():
    group = Group("t", "g", ROWS)
    # mean over the 3 samples = (1 + 0 + 0.5) / 3 = 0.5 -> [0.5, -0.5, 0.0]; sample 0's
    # two segments both get 0.5. (Over the 4 rows the mean would be 0.625.)
    assert compute_group_advantages(group, loss()).tolist() == pytest.approx([0.5, 0.5, -0.5, 0.0], abs=1e-7)
    # population std of [1, 0, 0.5] = sqrt(1/6) = 0.408248290463863; 0.5 / it = 1.224744871391589
    assert compute_group_advantages(group, loss(adv_std_norm=True)).tolist() == pytest.approx(
        [1.224744871391589, 1.224744871391589, -1.224744871391589, 0.0], abs=1e-6)
    # leave-one-out: G/(G-1) = 3/2 of the centred value -> [0.75, -0.75, 0]
    assert compute_group_advantages(group, loss(adv_leave_one_out=True)).tolist() == pytest.approx(
        [0.75, 0.75, -0.75, 0.0], abs=1e-7)
    other = Group("t", "g", (row(0, 0.0), row(1, 1.0)))
    batch = TrainBatch.from_groups([group, other], [compute_group_advantages(g, loss()) for g in (group, other)],
                                   version=0)
    assert batch.advantages.tolist() == pytest.approx([0.5, 0.5, -0.5, 0.0, -0.5, 0.5], abs=1e-7)


def test_the_buffer_masks_a_failed_sample_in_all_its_segments():
    # The worker gives every segment its sample's ending, so a failed sample is masked whole.
    failed = (row(0, 0.0, 0, "error"), row(0, 0.0, 1, "error"), row(1, 1.0))
    buffer = ReplayBuffer(max_staleness=4, groups_per_step=1, failure_policy="mask")
    assert buffer.try_admit()
    assert buffer.put(Group("t", "g", failed)) == "buffered"
    (group,) = buffer.get(1, 0)
    assert [int(t.response_mask.sum()) for t in group.trajectories] == [0, 0, 2]


def test_batch_metrics_count_samples_and_loop_metrics_sum_gateways():
    m = compute_batch_metrics([Group("t", "g", ROWS)], version=1)
    assert m["reward/mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3 samples
    assert m["end/finished"] == 3.0
    assert m["rollout/segments_per_sample"] == pytest.approx(4 / 3)
    assert m["rollout/tokens_generated"] == 8.0  # every trained row's model tokens
    from buffer.replay_buffer import BufferStats

    stats = BufferStats(**{f.name: (0 if f.type in ("int", int) else {}) for f in dataclasses.fields(BufferStats)})
    gw = [GatewayStats(3, 1, 5, 2, 40, 9, 1), GatewayStats(2, 0, 2, 0, 0, 4, 0)]
    workers = [WorkerStats(0, 3, {}, 0, 0, num_segments=5, gateway=gw[0]),
               WorkerStats(0, 2, {}, 0, 0, num_segments=2, gateway=gw[1]), WorkerStats(0, 1, {}, 0, 0)]
    out, _ = compute_loop_metrics(stats, {}, workers, (0, 0))
    assert {k: v for k, v in out.items() if k.startswith("gateway/")} == {
        "gateway/sessions": 5.0, "gateway/open_sessions": 1.0, "gateway/segments": 7.0,
        "gateway/segments_per_session": 1.4, "gateway/prefix_breaks": 2.0, "gateway/reencoded_tokens": 40.0,
        "gateway/requests": 13.0, "gateway/errors": 1.0}
    out, _ = compute_loop_metrics(stats, {}, workers[2:], (0, 0))
    assert not any(k.startswith("gateway/") for k in out)  # no gateway: no keys


class RestartingLoop:
    """Generates once, starts over from a fresh render (as the gateway does on a history
    rewrite) and generates again: two segments for one sample."""

    async def run(self, task, ctx):
        prompt = ctx.chat.initial_prompt_ids(task.messages, None)
        first = ctx.start(prompt)
        await ctx.generate()
        ctx.segments.append(first.finish(TerminationReason.FINISHED, "started over"))
        ctx.recorder = TrajectoryRecorder(task.id, ctx.group_id, ctx.index, prompt, ctx.settings.budgets)
        await ctx.generate()
        return ctx.recorder.finish(TerminationReason.FINISHED)


TASK = Task("t0", (Message("system", "Answer."), Message("user", "2+3?")), answer="5")


async def test_the_worker_trains_every_segment_under_the_last_ones_reward(tokenizer):
    worker, engine = make_worker(tokenizer, ["wrong", "5"], default_loop=f"{__name__}:RestartingLoop")
    group = await worker.run_group(TASK, "g", 2)
    assert [(t.index, t.segment) for t in group.trajectories] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t.reward == 1.0 for t in group.trajectories)  # the last segment ("5") was scored
    first = group.trajectories[0]
    assert tokenizer.decode(first.response_ids.tolist(), skip_special_tokens=True) == "wrong"
    assert first.termination is TerminationReason.FINISHED and "started over" in first.termination_detail
    for t in group.trajectories:  # each segment is exactly what its engine call saw and sampled
        assert any(np.array_equal(t.input_ids()[:len(p)], p) for p in engine.prompts[f"g/{t.index}"])
    stats = worker.stats()
    assert stats.num_finished == 2 and stats.num_segments == 4


async def test_a_timeout_after_a_restart_keeps_both_segments_as_timed_out(tokenizer):
    # The first turn returns (0.4 s), the second is cut by the 0.6 s trajectory timeout.
    worker, _ = make_worker(tokenizer, ["wrong", "5"], default_loop=f"{__name__}:RestartingLoop",
                            traj_timeout_s=0.6, engine_delay_s=0.4)
    first, second = await worker.run_sample(TASK, "g", 0)
    assert (first.segment, second.segment) == (0, 1)
    assert first.termination is second.termination is TerminationReason.TIMEOUT
    assert "trajectory_timeout_s" in first.termination_detail and "started over" in first.termination_detail
    assert first.num_model_tokens > 0 and second.num_model_tokens == 0  # the open segment, salvaged
    assert first.reward == second.reward == 0.0


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())
