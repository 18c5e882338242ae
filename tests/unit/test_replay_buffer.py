"""Replay buffer: AReaL admission bound, staleness eviction, failure policies, the
accounting identity, oldest-first order."""

from __future__ import annotations

import pytest

from buffer.replay_buffer import AccountingError, ReplayBuffer
from envs.types import NO_VERSION, Group, Trajectory, Turn


def traj(task="t", group="g", index=0, version=0, reason="finished", reward=1.0, turns=1, length=3):
    ids = list(range(3, 3 + length))
    mask = [1] * length
    return Trajectory(task, group, index, [1, 2], ids, mask, [-0.5] * length, [version] * length,
                      reason, turns=tuple(Turn(i, 2, 0, 1, 0, "stop", version) for i in range(turns)),
                      reward=reward)


def group(gid="g", version=0, reasons=("finished", "finished"), rewards=(1.0, 0.0), **kw):
    return Group("t" + gid, gid, tuple(traj("t" + gid, gid, i, version, r, w, **kw)
                                       for i, (r, w) in enumerate(zip(reasons, rewards))))


def test_admission_follows_the_areal_bound():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
    assert [buf.try_admit(version=0) for _ in range(5)] == [True] * 4 + [False]  # (0+1+1)*2 = 4
    assert buf.try_admit(version=1)  # the bound grows with the policy version
    buf.check_accounting()


def test_oldest_first_and_eviction_of_stale_groups_with_breakdown():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1)
    for v in range(3):
        assert buf.try_admit(2)
    buf.put(group("a", version=0, turns=5, length=300))
    buf.put(group("b", version=1))
    buf.put(group("c", version=2))
    taken = buf.get(2, version=2)  # a is 2 versions old: evicted
    assert [g.group_id for g in taken] == ["b", "c"]
    stats = buf.stats()
    assert stats.dropped == {"stale": 1} and stats.trained == 2
    assert stats.stale_by_turns == {5: 1} and stats.stale_by_length == {"<1024": 1}
    buf.check_accounting()


def test_get_returns_fewer_when_not_enough_are_buffered():
    buf = ReplayBuffer(max_staleness=0, groups_per_step=4)
    buf.try_admit(0)
    buf.put(group("a"))
    assert len(buf.get(4, version=0)) == 1 and buf.get(4, version=0) == []


def test_mask_policy_masks_failed_trajectories_and_keeps_the_group():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1, failure_policy="mask")
    buf.try_admit(0)
    assert buf.put(group("a", reasons=("finished", "error"))) == "buffered"
    (g,) = buf.get(1, 0)
    failed = g.trajectories[1]
    assert failed.num_model_tokens == 0 and set(failed.versions) == {NO_VERSION}
    assert g.trajectories[0].num_model_tokens == 3 and buf.stats().masked_trajectories == 1
    buf.try_admit(0)
    assert buf.put(group("b", reasons=("timeout", "error"))) == "dropped"  # nothing left to train
    buf.check_accounting()


def test_drop_and_resubmit_policies():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, failure_policy="drop")
    buf.try_admit(0)
    assert buf.put(group("a", reasons=("finished", "timeout"))) == "dropped"
    assert buf.stats().dropped == {"failed": 1}
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, failure_policy="resubmit", max_resubmits=1)
    buf.try_admit(0)
    assert buf.put(group("a", reasons=("error", "finished"))) == "resubmit"
    assert buf.stats().running == 1  # the slot stays reserved for the retry
    assert buf.put(group("a", reasons=("error", "finished"))) == "dropped"
    assert buf.stats().dropped == {"resubmits_exhausted": 1} and buf.stats().resubmitted == 1
    buf.check_accounting()


def test_zero_variance_filter():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, filter_zero_variance=True)
    buf.try_admit(0)
    buf.try_admit(0)
    assert buf.put(group("a", rewards=(1.0, 1.0))) == "dropped"
    assert buf.put(group("b", rewards=(1.0, 0.0))) == "buffered"
    assert buf.stats().dropped == {"zero_variance": 1}


def test_accounting_catches_a_group_that_was_never_admitted():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1)
    with pytest.raises(AccountingError, match="none was running"):
        buf.put(group("x"))


def test_a_lost_running_group_is_counted_as_dropped():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1)
    buf.try_admit(0)
    buf.drop_running("group_failed:RayActorError")
    assert buf.stats().dropped == {"group_failed:RayActorError": 1}
    buf.check_accounting()
    with pytest.raises(AccountingError):
        buf.drop_running("again")
