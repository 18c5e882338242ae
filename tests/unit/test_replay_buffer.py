"""Replay buffer: the admission bound on live groups (the same after a resume), staleness
eviction, failure policies, the accounting identity, oldest-first order, checkpointed state."""

from __future__ import annotations

import pytest

from buffer.replay_buffer import AccountingError, BufferState, ReplayBuffer
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


def test_admission_bounds_the_live_groups_and_a_step_frees_its_slots():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
    assert [buf.try_admit() for _ in range(5)] == [True] * 4 + [False]  # (1+1)*2 = 4
    for gid in "ab":
        buf.put(group(gid))
    assert not buf.try_admit()  # buffered groups are alive
    taken = buf.get(2, version=0)
    assert len(taken) == 2 and not buf.try_admit()  # in training: still alive
    buf.end_step()
    assert [buf.try_admit() for _ in range(3)] == [True, True, False]  # the step freed 2
    buf.check_accounting()
    assert buf.stats().trained == 2


def test_oldest_first_and_eviction_of_stale_groups_with_breakdown():
    buf = ReplayBuffer(max_staleness=2, groups_per_step=1)
    for v in range(3):
        assert buf.try_admit()
    buf.put(group("a", version=0, turns=5, length=300))
    buf.put(group("b", version=1))
    buf.put(group("c", version=2))
    taken = buf.get(2, version=3)  # a is 3 versions old: evicted
    assert [g.group_id for g in taken] == ["b", "c"]
    buf.end_step()
    stats = buf.stats()
    assert stats.dropped == {"stale": 1} and stats.trained == 2
    assert stats.stale_by_turns == {5: 1} and stats.stale_by_length == {"<1024": 1}
    buf.check_accounting()


def test_get_returns_fewer_when_not_enough_are_buffered():
    buf = ReplayBuffer(max_staleness=0, groups_per_step=4)
    buf.try_admit()
    buf.put(group("a"))
    assert len(buf.get(4, version=0)) == 1 and buf.get(4, version=0) == []


def test_mask_policy_masks_failed_trajectories_and_keeps_the_group():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1, failure_policy="mask")
    buf.try_admit()
    assert buf.put(group("a", reasons=("finished", "error"))) == "buffered"
    (g,) = buf.get(1, 0)
    failed = g.trajectories[1]
    assert failed.num_model_tokens == 0 and set(failed.versions) == {NO_VERSION}
    assert g.trajectories[0].num_model_tokens == 3 and buf.stats().masked_trajectories == 1
    buf.try_admit()
    assert buf.put(group("b", reasons=("timeout", "error"))) == "dropped"  # nothing left to train
    buf.check_accounting()


def test_drop_and_resubmit_policies():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, failure_policy="drop")
    buf.try_admit()
    assert buf.put(group("a", reasons=("finished", "timeout"))) == "dropped"
    assert buf.stats().dropped == {"failed": 1}
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, failure_policy="resubmit", max_resubmits=1)
    buf.try_admit()
    assert buf.put(group("a", reasons=("error", "finished"))) == "resubmit"
    assert buf.stats().running == 1  # the slot stays reserved for the retry
    assert buf.put(group("a", reasons=("error", "finished"))) == "dropped"
    assert buf.stats().dropped == {"resubmits_exhausted": 1} and buf.stats().resubmitted == 1
    buf.check_accounting()


def test_zero_variance_filter():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2, filter_zero_variance=True)
    buf.try_admit()
    buf.try_admit()
    assert buf.put(group("a", rewards=(1.0, 1.0))) == "dropped"
    assert buf.put(group("b", rewards=(1.0, 0.0))) == "buffered"
    assert buf.stats().dropped == {"zero_variance": 1}


def test_accounting_catches_a_group_that_was_never_admitted():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1)
    with pytest.raises(AccountingError, match="none was running"):
        buf.put(group("x"))


def test_a_lost_running_group_is_counted_as_dropped():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1)
    buf.try_admit()
    buf.drop_running("group_failed:RayActorError")
    assert buf.stats().dropped == {"group_failed:RayActorError": 1}
    buf.check_accounting()
    with pytest.raises(AccountingError):
        buf.drop_running("again")


def run_steps(buf: ReplayBuffer, version: int, steps: int) -> tuple[int, int]:
    """Drive the buffer like the controller for `steps` steps from `version`, every group
    finishing at once; (admissions, the most groups alive at any time)."""
    admitted = peak = 0
    for v in range(version, version + steps):
        while buf.try_admit():
            admitted += 1
            peak = max(peak, buf.num_alive)
            buf.put(group(f"g{admitted}", version=v))
        assert len(buf.get(buf.groups_per_step, v)) == buf.groups_per_step
        buf.end_step()
        buf.check_accounting()
    return admitted, peak


def test_a_resumed_buffer_admits_exactly_what_a_fresh_one_does():
    # The bug this guards: capacity grew with the version, so a run resumed at step 100
    # admitted (100 + eta + 1) * B groups at once, almost all generated to be evicted.
    fresh = ReplayBuffer(max_staleness=2, groups_per_step=500)
    assert [fresh.try_admit() for _ in range(1501)].count(True) == 1500
    resumed = ReplayBuffer(max_staleness=2, groups_per_step=500)
    resumed.restore(BufferState(groups=(), admitted=50_000, trained=50_000, dropped={},
                                resubmitted=0, masked_trajectories=0, attempts={}))
    assert [resumed.try_admit() for _ in range(1501)].count(True) == 1500
    assert resumed.stats().admitted == 51_500  # totals carry on across the resume
    resumed.check_accounting()


def test_resume_twice_in_a_row_keeps_the_bound_and_the_totals():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
    first = run_steps(buf, 0, 3)
    for resume_at in (3, 6):
        state = buf.state()
        buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
        buf.restore(state)
        # 2 per step (the 2 buffered at the checkpoint fill the rest); never > 4 alive
        assert run_steps(buf, resume_at, 3) == (6, 4)
    assert first == (8, 4)
    stats = buf.stats()
    assert (stats.admitted, stats.trained, stats.buffered, stats.dropped) == (20, 18, 2, {})


def test_resume_with_groups_in_flight_and_buffered():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
    for _ in range(4):
        assert buf.try_admit()
    buf.put(group("done", version=7))  # 1 buffered, 3 running when the checkpoint is taken
    state = buf.state()
    assert state.admitted == 1 and [g.group_id for g in state.groups] == ["done"]
    resumed = ReplayBuffer(max_staleness=1, groups_per_step=2)
    resumed.restore(state)
    # The 3 in flight are re-admitted by the controller: they take 3 of the 3 free slots.
    assert [resumed.try_admit() for _ in range(4)] == [True, True, True, False]
    resumed.check_accounting()
    assert resumed.stats().admitted == 4 and resumed.stats().buffered == 1


def test_a_step_that_did_not_happen_gives_its_groups_back_in_order():
    buf = ReplayBuffer(max_staleness=1, groups_per_step=2)
    for gid in "abc":
        buf.try_admit()
        buf.put(group(gid))
    taken = buf.get(2, version=0)
    buf.give_back(taken)
    assert [g.group_id for g in buf.get(3, version=0)] == ["a", "b", "c"]
    with pytest.raises(AccountingError, match="state\\(\\) during a step"):
        buf.state()
