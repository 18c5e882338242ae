"""The async core on its own: the real Controller, ReplayBuffer and TurnGate against
in-process stand-ins of the rollout side and the trainer side (no Ray, no engine).

Admission bound, back-pressure both ways, staleness eviction, failure policies, the
circuit breaker, resume, the accounting identity, stop (Ctrl-C), pushes only at turn
boundaries, and the held-out evaluation. The whole file runs in a few seconds: every
latency is a few milliseconds of real asyncio time."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from buffer.batch import TrainBatch
from envs.types import Group, Message, Task, TerminationReason, Trajectory, Turn
from rollout.engine import EngineStats
from rollout.deadline import DeadlineCut, absorb_cut, gather_by_deadline
from rollout.gate import TurnGate
from rollout.worker import WorkerStats
from trainer.run.controller import Controller, ControllerState, RepeatedFailureError
from trainer.run.metrics import MetricsLogger
from trainer.run.recipe import build_config
from trainer.train.outcomes import PushOutcome, TrainOutcome

TASKS = [Task(f"t{i}", (Message("user", f"q{i}"),), answer=str(i)) for i in range(6)]


class FakeRollout:
    """RolloutSide stand-in: each trajectory runs `turns` turns through a real TurnGate, its
    tokens tagged with the version the (fake) engines serve; reward 1 for even task ids
    and trajectory index 0, so groups have variance. `fail` maps a task id to an exception
    to raise or a termination to end every trajectory with; `slow` a task id (or
    "task/index", one sample) to the seconds its first tool takes."""

    def __init__(self, *, turns: int = 2, turn_s: float = 0.002, slow: Mapping[str, float] = {},
                 fail: Mapping[str, object] = {}, group_size_check: int | None = None) -> None:
        self.gate = TurnGate()
        self.engine_version = 0
        self.turns, self.turn_s = turns, turn_s
        self.slow, self.fail = dict(slow), dict(fail)
        self.calls: list[tuple[str, str]] = []  # (task id, group id) per run_group
        self.cancelled: list[str] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.controller: Controller | None = None
        self.peak_alive = 0

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        self.calls.append((task.id, group_id))
        if self.controller is not None:
            self.peak_alive = max(self.peak_alive, self.controller.buffer.num_alive)
        failure = self.fail.get(task.id)
        if isinstance(failure, Exception):
            raise failure
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            cut = DeadlineCut()
            trajs = await gather_by_deadline([self._trajectory(task, group_id, i, cut)
                                              for i in range(group_size)], deadline_s, cut)
        except asyncio.CancelledError:
            self.cancelled.append(group_id)
            raise
        finally:
            self.in_flight -= 1
        if isinstance(failure, TerminationReason):
            trajs = [dataclasses.replace(t, termination=failure, termination_detail=f"{failure.value}: "
                                         f"tool broke on {task.id}") for t in trajs]
        return Group(task.id, group_id, tuple(trajs))

    async def _trajectory(self, task: Task, group_id: str, index: int,
                          cut: DeadlineCut) -> Trajectory:
        versions, turns = [], []
        ending, reward = TerminationReason.FINISHED, float(int(task.id[1:]) % 2 == 0 and index == 0)
        try:
            for k in range(self.turns):
                async with self.gate.turn():
                    v = self.engine_version
                    await asyncio.sleep(self.turn_s)
                    versions.append(v)
                    turns.append(Turn(k, 2, k, 1, 0, "stop", v))
                if k == 0:  # a slow tool: outside the gate, so pushes go on meanwhile
                    await asyncio.sleep(self.slow.get(task.id, 0.0)
                                        + self.slow.get(f"{task.id}/{index}", 0.0))
        except asyncio.CancelledError:
            if not absorb_cut(cut):
                raise
            ending, reward = TerminationReason.DEADLINE, 0.0
        n = len(versions)
        return Trajectory(task.id, group_id, index, [1, 2], list(range(3, 3 + n)), [1] * n,
                          [-0.5] * n, versions, ending, turns=tuple(turns), reward=reward)

    async def close_gates(self) -> None:
        await self.gate.close()

    async def open_gates(self) -> None:
        self.gate.open()

    async def worker_stats(self) -> Sequence[WorkerStats]:
        return [WorkerStats(self.in_flight, 0, {}, 0, 0)]

    async def engine_stats(self) -> Mapping[str, EngineStats]:
        return {"e0": EngineStats(self.engine_version, self.in_flight, self.in_flight, 0, 0.0,
                                  0, 0, not self.gate.is_open)}


class FakeTrainer:
    """TrainerSide stand-in: records each batch, takes `train_s`, and on push checks that
    no turn is generating (pushes land only at turn boundaries) before the engines adopt
    the version."""

    def __init__(self, rollout: FakeRollout, train_s: float = 0.002) -> None:
        self.rollout = rollout
        self.train_s = train_s
        self.batches: list[TrainBatch] = []
        self.pushes: list[int] = []
        self.prepared = -1
        self.push_failures: dict[int, tuple[str, ...]] = {}  # version -> engines lost in its push

    async def train(self, batch: TrainBatch) -> TrainOutcome:
        self.batches.append(batch)
        await asyncio.sleep(self.train_s)
        return TrainOutcome({"loss/loss": 0.0})

    async def prepare_weights(self, version: int) -> None:
        assert self.rollout.gate.is_open  # the gather overlaps rollout: gates still open
        self.prepared = version

    async def push_weights(self, version: int) -> None:
        assert self.prepared == version, "push without its prepare"
        gate = self.rollout.gate
        assert not gate.is_open and gate.num_generating == 0, "a push landed inside a turn"
        await asyncio.sleep(0.001)
        self.rollout.engine_version = version
        self.pushes.append(version)
        return PushOutcome(self.push_failures.get(version, ()))

    def save_state(self, folder: Path) -> None: ...

    def load_state(self, folder: Path) -> None: ...


def make(fake: FakeRollout | None = None, *, steps: int = 4, eta: int = 1, B: int = 2,
         G: int = 2, policy: str = "mask", train_s: float = 0.002, eval_tasks=(),
         breaker: int = 4, **extra) -> tuple[Controller, FakeRollout, FakeTrainer]:
    rollout = fake or FakeRollout()
    cfg = build_config({"train": {"num_steps": steps, "groups_per_step": B, "group_size": G,
                                  **extra.pop("train", {})},
                        "buffer": {"max_staleness": eta, "failure_policy": policy,
                                   "max_repeated_failures": breaker, **extra.pop("buffer", {})},
                        "eval": {"samples_per_task": 2, **({"tasks": "toy_arithmetic_easy_heldout"}
                                                           if eval_tasks else {})}, **extra})
    trainer = FakeTrainer(rollout, train_s)
    ctl = Controller(cfg, tasks=TASKS, rollout=rollout, trainer=trainer,
                     logger=MetricsLogger([]), eval_tasks=eval_tasks, run_id="run-1")
    rollout.controller = ctl
    return ctl, rollout, trainer


def check_every_step(ctl: Controller):
    """on_step: the accounting identity holds at every step boundary."""
    async def on_step(version: int) -> None:
        ctl.buffer.check_accounting()
        stats = ctl.buffer.stats()
        assert stats.admitted == (stats.trained + sum(stats.dropped.values()) + stats.running
                                  + stats.buffered + stats.in_training)
    return on_step


async def test_admission_never_exceeds_the_live_bound_and_batches_stay_fresh():
    ctl, rollout, trainer = make(steps=6, eta=1, B=2)
    summary = await ctl.run(check_every_step(ctl))
    assert summary.steps == 6 and len(trainer.batches) == 6
    assert rollout.peak_alive <= (1 + 1) * 2
    for batch in trainer.batches:  # staleness = trainer version - oldest token version <= eta
        assert max(batch.version - t.oldest_version for t in batch.trajectories) <= 1
    assert trainer.pushes == [1, 2, 3, 4, 5, 6]
    assert summary.trained == 12 and summary.admitted == summary.trained + summary.running + summary.buffered


async def test_a_slow_trainer_stops_admission_and_a_slow_rollout_makes_the_trainer_wait():
    ctl, rollout, _ = make(steps=3, eta=0, B=2, train_s=0.05)
    await ctl.run()
    assert rollout.peak_in_flight <= 2  # eta = 0: one batch ahead at most, never more
    slow = FakeRollout(turn_s=0.02)
    ctl, _, _ = make(slow, steps=2, eta=1, B=2)
    idle = []
    original = ctl._loop_metrics

    async def spy(step_start):
        out = await original(step_start)
        idle.append(out["perf/trainer_idle_ratio"])
        return out
    ctl._loop_metrics = spy
    await ctl.run()
    assert max(idle) > 0.5  # the trainer waited for groups most of the step


async def test_groups_older_than_the_bound_are_evicted_and_counted():
    # t0's groups take ~10 steps of time to come back: they are too stale when they do.
    ctl, _, trainer = make(FakeRollout(slow={"t0": 0.12}), steps=16, eta=1, B=1)
    summary = await ctl.run(check_every_step(ctl))
    assert summary.dropped.get("stale", 0) >= 1
    assert all(b.version - t.oldest_version <= 1 for b in trainer.batches for t in b.trajectories)


async def test_failed_trajectories_follow_the_failure_policy():
    fail = {"t1": TerminationReason.ERROR}
    ctl, _, trainer = make(FakeRollout(fail=fail), steps=3, policy="drop", breaker=50)
    summary = await ctl.run(check_every_step(ctl))
    assert summary.dropped.get("failed", 0) >= 1
    assert all(t.task_id != "t1" for b in trainer.batches for t in b.trajectories)
    # Enough steps that t1 (admitted in the first epoch of 6 tasks) has come back twice
    # before the run ends, however late in that epoch the seeded order puts it.
    ctl, _, trainer = make(FakeRollout(fail=fail), steps=8, policy="resubmit", breaker=50,
                           buffer={"max_resubmits": 1})
    summary = await ctl.run(check_every_step(ctl))
    assert summary.dropped.get("resubmits_exhausted", 0) >= 1


async def test_a_group_that_raises_is_dropped_counted_and_the_run_goes_on():
    ctl, rollout, trainer = make(FakeRollout(fail={"t2": ConnectionError("worker lost")}),
                                 steps=4, breaker=50)
    summary = await ctl.run(check_every_step(ctl))
    assert summary.steps == 4 and summary.dropped.get("group_failed:ConnectionError", 0) >= 1


@pytest.mark.parametrize("failure", [ValueError("agent loop 'x:Y': cannot import 'x'"),
                                     TerminationReason.ERROR])
async def test_a_failure_repeating_for_every_group_trips_the_breaker(failure):
    ctl, rollout, trainer = make(FakeRollout(fail={t.id: failure for t in TASKS}), steps=4,
                                 breaker=5)
    with pytest.raises(RepeatedFailureError, match="5 groups in a row failed") as info:
        await asyncio.wait_for(ctl.run(), 10)
    assert len(rollout.calls) < 5 + 2 * 2  # stopped, not looping: the breaker plus in flight
    assert trainer.batches == [] and "tool broke" in str(info.value) or "cannot import" in str(info.value)
    ctl.buffer.check_accounting()


async def test_varied_failures_that_never_stop_still_trip_the_breaker():
    fail = {t.id: RuntimeError(f"error number {i} of a kind nobody saw: {t.id * (i + 1)}")
            for i, t in enumerate(TASKS)}
    ctl, rollout, _ = make(FakeRollout(fail=fail), breaker=2)
    with pytest.raises(RepeatedFailureError):
        await asyncio.wait_for(ctl.run(), 10)


async def test_resume_continues_versions_counters_and_group_ids_without_extra_admissions():
    ctl, rollout, _ = make(steps=3, eta=1, B=2)
    first = await ctl.run()
    state = ctl.state()
    assert isinstance(state, ControllerState) and state.version == 3
    again = FakeRollout()
    again.engine_version = 3
    ctl2, _, trainer2 = make(again, steps=6, eta=1, B=2)
    ctl2.restore(state)
    second = await ctl2.run(check_every_step(ctl2))
    assert second.steps == 6 and trainer2.pushes == [4, 5, 6]
    assert again.peak_alive <= 4  # the bound is the same after the resume
    assert second.trained == 12 and second.admitted >= first.admitted
    # The groups in flight at the checkpoint come first, under their own ids (their workers
    # find their trajectories' journals: rollout.durable); no other id is reused.
    resumed = [(t.id, g) for t, g in zip(state.in_flight_tasks, state.in_flight_groups, strict=True)]
    assert resumed and again.calls[:len(resumed)] == resumed
    assert {g for _, g in resumed} <= {g for _, g in rollout.calls}
    later = [g for _, g in again.calls[len(resumed):]]
    assert len(set(later)) == len(later) and not set(later) & {g for _, g in rollout.calls}
    assert state.run_id == "run-1" and ctl2.state().run_id == "run-1"


async def test_stop_while_the_trainer_waits_ends_the_run_at_once_and_cancels_groups():
    ctl, rollout, trainer = make(FakeRollout(turn_s=30.0), steps=5)
    run = asyncio.create_task(ctl.run())
    await asyncio.sleep(0.05)
    ctl.stop()
    summary = await asyncio.wait_for(run, 2.0)  # not 30 s: the wait for groups looks at stop
    assert summary.stopped_early and summary.steps == 0 and trainer.batches == []
    assert len(rollout.cancelled) == summary.running > 0
    state = ctl.state()  # in-flight tasks are kept for the resume
    assert len(state.in_flight_tasks) == summary.running
    ctl.buffer.check_accounting()


async def test_stop_mid_run_finishes_the_step_and_keeps_the_state_consistent():
    ctl, _, trainer = make(steps=50, train_s=0.01)

    async def stop_after_two(version: int) -> None:
        if version == 2:
            ctl.stop()
    summary = await ctl.run(stop_after_two)
    assert summary.steps == 2 and len(trainer.batches) == 2 and summary.stopped_early
    ctl.state()
    ctl.buffer.check_accounting()


async def test_pushes_land_only_at_turn_boundaries_with_many_turns_in_flight():
    # FakeTrainer.push_weights asserts the gate is closed and drained.
    ctl, rollout, trainer = make(FakeRollout(turns=5, turn_s=0.003), steps=5, B=3, G=4)
    await ctl.run()
    assert trainer.pushes == [1, 2, 3, 4, 5]
    for batch in trainer.batches:  # every token carries the version that produced it
        for t in batch.trajectories:
            assert all(u.version <= batch.version for u in t.turns)


class RecordingSink:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def write(self, step: int, metrics) -> None:
        self.rows[step] = dict(metrics)

    def close(self) -> None: ...


async def test_an_engine_lost_in_a_push_is_counted_and_the_run_goes_on():
    ctl, _, trainer = make(steps=3)
    sink = RecordingSink()
    ctl.logger = MetricsLogger([sink])
    trainer.push_failures[2] = ("e1",)
    summary = await ctl.run()
    assert summary.steps == 3 and trainer.pushes == [1, 2, 3]
    lost = {step: row["perf/weight_push_failed_engines"] for step, row in sink.rows.items()
            if "perf/weight_push_failed_engines" in row}
    assert lost == {1: 0.0, 2: 1.0, 3: 0.0}


async def test_sync_mode_trains_each_batch_on_one_version():
    ctl, _, trainer = make(steps=3, train={"mode": "sync"})
    await ctl.run()
    for batch in trainer.batches:
        assert {int(v) for t in batch.trajectories for v in t.versions} == {batch.version}


# --- held-out evaluation ---------------------------------------------------------------

async def test_eval_is_the_mean_reward_of_one_version():
    ctl, _, _ = make(eval_tasks=TASKS[:4])
    metrics = await ctl._evaluate()
    # even tasks reward index 0 only: t0, t2 give 1 of 2 samples -> 2/8
    assert metrics["eval/reward_mean"] == 0.25 and metrics["eval/num_trajectories"] == 8
    assert metrics["eval/failed_groups"] == 0 and ctl.eval_rewards == {0: 0.25}


async def test_a_failed_eval_group_is_reported_not_fatal():
    ctl, _, _ = make(FakeRollout(fail={"t1": RuntimeError("worker lost")}), eval_tasks=TASKS[:4])
    metrics = await ctl._evaluate()
    assert metrics["eval/failed_groups"] == 1 and metrics["eval/num_trajectories"] == 6


async def test_a_breaker_that_trips_during_the_first_eval_ends_the_run_at_once():
    """Training groups that all fail trip the breaker while the held-out tasks are still
    being scored (slow eval groups): the run ends without waiting for the evaluation."""
    rollout = FakeRollout(fail={t.id: TerminationReason.ERROR for t in TASKS},
                          slow={t.id: 30.0 for t in TASKS[:4]})
    ctl, _, _ = make(rollout, eval_tasks=TASKS[:4], breaker=2)
    with pytest.raises(RepeatedFailureError):
        await asyncio.wait_for(ctl.run(), 5.0)  # not 30 s: stop() cancels the eval groups
    assert any(g.startswith("eval-v0") for g in rollout.cancelled)


async def test_tokens_of_another_version_are_refused():
    rollout = FakeRollout()
    rollout.engine_version = 1
    ctl, _, _ = make(rollout, eval_tasks=TASKS[:2])
    with pytest.raises(RuntimeError, match="a weight push landed during evaluation"):
        await ctl._evaluate()


async def test_a_run_with_eval_scores_before_and_after_and_skips_the_baseline_on_resume():
    ctl, _, _ = make(steps=2, eval_tasks=TASKS[:2])
    summary = await ctl.run()
    assert set(summary.eval_rewards) == {0, 2}
    state = ctl.state()
    rollout = FakeRollout()
    rollout.engine_version = 2
    ctl2, rollout2, _ = make(rollout, steps=3, eval_tasks=TASKS[:2])
    ctl2.restore(state)
    await ctl2.run()
    assert not any(g.startswith("eval-v2") for _, g in rollout2.calls)  # version 2 was scored


def test_train_batch_shards_balance_tokens_not_counts():
    lengths = [49_000, 300, 300, 300, 12_000, 12_000, 12_000, 12_000]
    trajs = tuple(Trajectory("t", "g", i, [1] * 10, [3] * n, [1] * n, [-0.5] * n, [0] * n, "finished")
                  for i, n in enumerate(lengths))
    batch = TrainBatch(trajs, np.arange(8, dtype=np.float32), version=0)
    shards = batch.shards(2)
    totals = [s.num_tokens for s in shards]
    assert sum(totals) == batch.num_tokens and max(totals) / (sum(totals) / 2) < 1.02
    by_count = [sum(n + 10 for n in lengths[:4]), sum(n + 10 for n in lengths[4:])]
    assert max(by_count) / (sum(by_count) / 2) > 1.01  # what contiguous count splits gave
    merged = sorted((t.index, float(a)) for s in shards for t, a in zip(s.trajectories, s.advantages))
    assert merged == [(i, float(i)) for i in range(8)]  # each advantage stays with its trajectory


async def test_admission_stops_at_the_sandbox_capacity_times_oversubscription():
    # 2 workers x 3 sandboxes x 1.4 = 8 trajectories = 2 groups of 4 in flight at most,
    # although the staleness budget would allow (3 + 1) * 2 = 8 groups.
    ctl, rollout, _ = make(FakeRollout(turn_s=0.01), steps=3, eta=3, B=2, G=4,
                           envs={"num_sandbox_workers": 2, "sandboxes_per_worker": 3,
                                 "num_warm_sandboxes": 0, "sandbox_oversubscription": 1.4},
                           rollout={"num_agent_workers": 2})
    assert ctl.max_running_groups == 2
    await ctl.run()
    assert rollout.peak_in_flight == 2


async def test_admission_waits_are_put_on_the_bound_that_stops_it(caplog):
    # The sandbox cap binds (2 groups of the 8 the staleness bound allows): it is said once
    # at the start with the sandboxes_per_worker that lifts it, and each step reports the
    # share of its time admission waited on each bound.
    capped = dict(steps=4, eta=3, B=2, G=4, rollout={"num_agent_workers": 2})
    with caplog.at_level("INFO", logger="trainer.run.controller"):
        ctl, _, _ = make(FakeRollout(turn_s=0.01), envs={
            "num_sandbox_workers": 2, "sandboxes_per_worker": 3, "num_warm_sandboxes": 0,
            "sandbox_oversubscription": 1.4}, **capped)
    assert [r.getMessage() for r in caplog.records if "sandbox pool caps" in r.getMessage()] == [
        "admission keeps at most 2 groups in flight (envs.num_sandbox_workers x sandboxes_per_worker x "
        "sandbox_oversubscription / train.group_size = 2 x 3 x 1.4 / 4), fewer than the 8 the "
        "staleness bound allows ((buffer.max_staleness + 1) x train.groups_per_step, "
        "train.mode=async): the sandbox pool caps rollout. Set envs.sandboxes_per_worker=12 to "
        "let the staleness bound decide."]  # 2 x 12 x 1.4 = 33.6 -> 33 // 4 = 8 groups
    sink = RecordingSink()
    ctl.logger = MetricsLogger([sink])
    await ctl.run()
    rows = list(sink.rows.values())
    assert all(0 < r["perf/admission_blocked_sandboxes_ratio"] <= 1 for r in rows)
    assert all(r["perf/admission_blocked_staleness_ratio"] == 0 for r in rows)  # never reached

    caplog.clear()
    with caplog.at_level("INFO", logger="trainer.run.controller"):  # sandboxes for all 8
        ctl, _, _ = make(FakeRollout(turn_s=0.01), envs={
            "num_sandbox_workers": 2, "sandboxes_per_worker": 12, "num_warm_sandboxes": 0,
            "sandbox_oversubscription": 1.4}, **capped)
    assert not [r for r in caplog.records if "sandbox pool caps" in r.getMessage()]
    sink = RecordingSink()
    ctl.logger = MetricsLogger([sink])
    await ctl.run()
    rows = list(sink.rows.values())
    assert all(r["perf/admission_blocked_sandboxes_ratio"] == 0 for r in rows)
    assert all(0 < r["perf/admission_blocked_staleness_ratio"] <= 1 for r in rows)


# --- stragglers (buffer.group_deadline_s) ---------------------------------------------

def straggler_run(policy: str, *, slow_s: float = 0.12, **buffer):
    """Sample 1 of every t1 group takes `slow_s` more than the others (~50 ms a group):
    past the 0.1 s deadline; the staleness bound is loose enough for a late t1 group to
    train under `wait` (and tight enough under the others that few t1 groups run at once:
    a burst of deadline drops trips the breaker)."""
    fake = FakeRollout(turn_s=0.02, slow={"t1/1": slow_s})
    return make(fake, steps=10, eta=30 if policy == "wait" else 8, B=2, G=3,
                envs={"num_sandbox_workers": 1, "sandboxes_per_worker": 6, "num_warm_sandboxes": 0,
                      "sandbox_oversubscription": 1.0},  # two groups run at once
                buffer={"group_deadline_s": 0.1, "straggler_policy": policy, **buffer})


async def test_under_wait_a_late_group_is_counted_and_trained_whole():
    ctl, _, trainer = straggler_run("wait")
    await ctl.run(check_every_step(ctl))
    trained = [t for b in trainer.batches for t in b.trajectories]
    assert any(t.task_id == "t1" for t in trained)
    assert all(t.termination is TerminationReason.FINISHED for t in trained)
    stats = ctl.buffer.stats()
    assert stats.deadline.get("late_groups", 0) >= 1 and "cut_samples" not in stats.deadline


async def test_under_drop_the_group_is_cut_at_its_deadline_and_dropped():
    ctl, _, trainer = straggler_run("drop", slow_s=5.0)  # were it waited for, the run would hang
    summary = await ctl.run(check_every_step(ctl))
    assert summary.steps == 10
    assert not any(t.task_id == "t1" for b in trainer.batches for t in b.trajectories)
    stats = ctl.buffer.stats()
    assert stats.dropped["deadline"] >= 1
    assert stats.deadline["cut_samples"] == stats.dropped["deadline"]  # one straggler a group
    assert stats.cut_by_turns == {1: stats.deadline["cut_samples"]}  # cut in its first tool


async def test_under_partial_the_finished_samples_train_and_the_cut_one_is_outside_the_baseline():
    ctl, _, trainer = straggler_run("partial", slow_s=5.0)
    await ctl.run(check_every_step(ctl))
    t1 = [(b, i) for b in trainer.batches for i, t in enumerate(b.trajectories) if t.task_id == "t1"]
    assert t1 and ctl.buffer.stats().deadline["partial_groups"] >= 1
    for batch, i in t1:
        t = batch.trajectories[i]
        if t.index == 1:  # the straggler: nothing of it trains
            assert t.termination is TerminationReason.DEADLINE
            assert t.response_mask.sum() == 0 and batch.advantages[i] == 0.0
        else:  # rewards 0 and 0 (t1 is odd): a zero-variance baseline of the two finished
            assert t.termination is TerminationReason.FINISHED and batch.advantages[i] == 0.0


async def test_partial_drops_a_group_with_fewer_finished_samples_than_the_minimum():
    ctl, _, trainer = straggler_run("partial", slow_s=5.0, min_group_size=3)
    await ctl.run(check_every_step(ctl))
    assert not any(t.task_id == "t1" for b in trainer.batches for t in b.trajectories)
    assert ctl.buffer.stats().dropped["deadline"] >= 1


async def test_a_deadline_that_drops_every_group_stops_the_run():
    fake = FakeRollout(turn_s=0.02, slow={f"t{i}/1": 5.0 for i in range(6)})
    ctl, _, _ = make(fake, steps=10, eta=1, B=2, G=3,
                     buffer={"group_deadline_s": 0.05, "straggler_policy": "drop"})
    with pytest.raises(RepeatedFailureError, match=r"the last 4 groups to come back .* were all "
                       r"dropped at their deadline; .*raise the deadline"):
        await ctl.run()
