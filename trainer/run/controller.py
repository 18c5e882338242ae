"""The controller: owns the admission and training loops of a run and wires them through
the replay buffer. It talks only to the two seams (trainer.run.seams): the rollout side runs
and scores groups where their sandboxes are; the trainer side trains and pushes weights
from its own ranks. The driver moves tasks, scored groups and versions, never workspaces
or weights.

    tasks ──admit──> RolloutSide.run_group ──scored group──put──> ReplayBuffer ──get──> trainer
      ^   (alive: running + buffered          (workers: agent loop     (terminal groups,   │
      │    + in training < (eta+1)*B)          + reward, same node)     staleness <= eta)  │ train
      │                                                                                    v
      └──── a slot frees when a group is dropped or its step ends <── push at a turn boundary:
                                                                       close gates (turns drain,
                                                                       tools keep running),
                                                                       push + verify, open gates

Back-pressure: admission stops while (eta + 1) * B groups are alive, so rollout never
produces groups that would only be evicted, and while the groups running would hold more
trajectories than the sandbox pool has sandboxes x envs.sandbox_oversubscription; the
trainer waits (idle) when the buffer holds fewer than `train.groups_per_step` groups.
`train.mode=sync` is the same machinery with eta = 0. A failure that repeats group after
group trips the breaker (buffer.breaker) and ends the run with that error.

Held-out evaluation (eval.tasks) runs before the first step and after the last (and every
eval.every_steps) while the training loop waits, so no push lands in it: each score is
one version's. Admission goes on meanwhile.

`stop()` (Ctrl-C) ends the run at the next step boundary, or at once when the trainer is
waiting for groups; in-flight groups are cancelled and their tasks kept for the resume.
The controller owns its checkpointed state (`state()` / `restore()`), the buffer's in it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from buffer.batch import TrainBatch
from buffer.breaker import FailureBreaker, RepeatedFailure, group_failure
from buffer.replay_buffer import BufferState, ReplayBuffer
from envs.types import Group, Task, TerminationReason
from trainer.train.advantages import compute_group_advantages
from trainer.run.config import SluiceConfig
from trainer.run.metrics import (BusyClock, EventSink, MetricsLogger, StateClock, TranscriptSink,
                             compute_batch_metrics, compute_loop_metrics, mean_sample_reward,
                             turn_events)
from trainer.run.seams import RolloutSide, TrainerSide

log = logging.getLogger(__name__)

# Metrics of the environment side since the last call (sandbox pools: env/* keys).
EnvMetrics = Callable[[], Awaitable[dict[str, float]]]


def log_sandbox_cap(cfg: SluiceConfig, max_running_groups: int, capacity: int) -> None:
    """Say, once at the start, that the sandbox pool (not the staleness bound) caps the
    groups in flight, and what sandboxes_per_worker lets the staleness bound decide. Under
    a heavy tail the slow groups then hold most of those few slots and the trainer waits."""
    e, t = cfg.envs, cfg.train
    needed = e.sandboxes_per_worker
    while int(e.num_sandbox_workers * needed * e.sandbox_oversubscription) // t.group_size < capacity:
        needed += 1
    log.info("admission keeps at most %d groups in flight (envs.num_sandbox_workers x "
             "sandboxes_per_worker x sandbox_oversubscription / train.group_size = %d x %d x %g / %d), "
             "fewer than the %d the staleness bound allows ((buffer.max_staleness + 1) x "
             "train.groups_per_step, train.mode=%s): the sandbox pool caps rollout. Set "
             "envs.sandboxes_per_worker=%d to let the staleness bound decide.",
             max_running_groups, e.num_sandbox_workers, e.sandboxes_per_worker,
             e.sandbox_oversubscription, t.group_size, capacity, t.mode, needed)


class RepeatedFailureError(RuntimeError):
    """The run stopped because the same failure repeated group after group."""

    def __init__(self, failure: RepeatedFailure) -> None:
        super().__init__(failure.message())
        self.failure = failure


@dataclass(frozen=True, slots=True)
class ControllerState:
    """What a checkpoint keeps of the controller (between steps)."""

    version: int
    data_cursor: int  # tasks taken from the seeded task stream so far
    in_flight_tasks: tuple[Task, ...]  # admitted, not returned: re-admitted first on resume
    buffer: BufferState
    next_group: int  # group ids continue, so no id is reused across resumes
    end_reasons: dict[str, int] = field(default_factory=dict)
    eval_rewards: dict[int, float] = field(default_factory=dict)
    # The group id of each in-flight task: re-admitted under it, so its workers find the
    # journals of its trajectories (rollout.durable) and continue them.
    in_flight_groups: tuple[str, ...] = ()
    run_id: str = ""  # the run's identity across resumes (journals of another run are never replayed)


@dataclass(frozen=True, slots=True)
class RunSummary:
    steps: int
    rewards_per_step: tuple[float, ...]  # of this invocation's steps
    admitted: int  # totals across resumes
    trained: int
    dropped: dict[str, int]
    running: int  # in flight when the run ended (cancelled; re-admitted on resume)
    buffered: int  # terminal but not trained when the run ended
    seconds: float
    eval_rewards: dict[int, float]  # policy version -> mean held-out reward (eval.tasks)
    stopped_early: bool  # stop() (Ctrl-C) ended it before train.num_steps


class Controller:
    def __init__(self, cfg: SluiceConfig, *, tasks: Sequence[Task], rollout: RolloutSide,
                 trainer: TrainerSide, logger: MetricsLogger,
                 transcripts: TranscriptSink | None = None, events: EventSink | None = None,
                 eval_tasks: Sequence[Task] = (), env_metrics: EnvMetrics | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, run_id: str = "") -> None:
        if not tasks:
            raise ValueError("no tasks to train on; check envs.tasks")
        self.cfg = cfg
        self.tasks = list(tasks)
        self.rollout = rollout
        self.trainer = trainer
        self.logger = logger
        self.transcripts = transcripts
        self.events = events
        self.wall_clock = wall_clock  # timestamps of events.jsonl (a simulator's virtual clock)
        self.clock = clock  # durations: timing/*, idle ratios (a simulator's virtual clock)
        self.eval_tasks = list(eval_tasks)
        self.env_metrics = env_metrics
        self.eval_rewards: dict[int, float] = {}
        b = cfg.buffer
        eta = 0 if cfg.train.mode == "sync" else b.max_staleness
        self.buffer = ReplayBuffer(max_staleness=eta, groups_per_step=cfg.train.groups_per_step,
                                   failure_policy=b.failure_policy, max_resubmits=b.max_resubmits,
                                   filter_zero_variance=b.filter_zero_variance,
                                   straggler_policy=b.straggler_policy,
                                   min_group_size=b.min_group_size)
        # Under `wait` a group is never cut, only counted when it comes back late.
        self._deadline_s = b.group_deadline_s or None
        self._cut_at_deadline = self._deadline_s is not None and b.straggler_policy != "wait"
        self.breaker = FailureBreaker(b.max_repeated_failures,
                                      deadline_threshold=self.buffer.capacity)
        e = cfg.envs  # the third ratio: trajectories in flight per sandbox
        sandboxes = e.num_sandbox_workers * e.sandboxes_per_worker
        self.max_running_groups = max(1, int(sandboxes * e.sandbox_oversubscription)
                                      // cfg.train.group_size)
        if self.max_running_groups < self.buffer.capacity:
            log_sandbox_cap(cfg, self.max_running_groups, self.buffer.capacity)
        self.version = 0
        self.cursor = 0
        self.run_id = run_id
        # In flight at the checkpoint, with their group ids: admitted first.
        self._pending: list[tuple[Task, str]] = []
        self._task_stream = self._iter_tasks()
        self._in_flight: dict[str, Task] = {}  # group id -> task, for checkpoints
        self._running: set[asyncio.Task] = set()
        self._capacity = asyncio.Event()
        self._group_ready = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()  # set by stop(): work that would outlast it is cancelled
        self._trainer_clock = BusyClock(clock)
        # Why admission waits: "staleness" (the (eta + 1) x B groups alive) or "sandboxes"
        # (the running groups fill the sandbox pool x oversubscription; the staleness bound
        # would admit more). Neither: a group is being admitted, or none can be (stopping).
        self._admission_clock = StateClock(clock)
        self._rollout_idle: list[float] = []
        self._group_ids = itertools.count()
        self._end_reasons: Counter[str] = Counter()
        self._cache_counters = (0, 0)  # prefix-cache queries, hits at the last step
        self._push_event: dict[str, object] = {}  # the last push's event row (mixed values, as JSON)

    # --- checkpointed state ------------------------------------------------------------
    def state(self) -> ControllerState:
        in_flight = [*self._pending, *((task, gid) for gid, task in self._in_flight.items())]
        return ControllerState(self.version, self.cursor, tuple(t for t, _ in in_flight),
                               self.buffer.state(), self._peek_group_id(),
                               dict(self._end_reasons), dict(self.eval_rewards),
                               tuple(g for _, g in in_flight), self.run_id)

    def restore(self, state: ControllerState) -> None:
        """Continue where `state` was taken; call before run()."""
        self.version, self.cursor = state.version, state.data_cursor
        # A checkpoint of before group ids were kept: fresh ids (their journals are not found).
        groups = state.in_flight_groups or ("",) * len(state.in_flight_tasks)
        self._pending = list(zip(state.in_flight_tasks, groups, strict=True))
        self.buffer.restore(state.buffer)
        self._group_ids = itertools.count(state.next_group)
        self._end_reasons.update(state.end_reasons)
        self.eval_rewards.update(state.eval_rewards)
        self.run_id = state.run_id or self.run_id

    def _peek_group_id(self) -> int:
        n = next(self._group_ids)
        self._group_ids = itertools.count(n)
        return n

    def _iter_tasks(self) -> Iterator[tuple[Task, str]]:
        """(task, group id) in a seeded order that is a function of the cursor and the group
        counter (resume-safe: a resumed run admits the groups the killed one had admitted
        after its checkpoint under the same ids), after the tasks that were in flight when
        the run was checkpointed, under their own ids."""
        while True:
            if self._pending:
                task, group_id = self._pending.pop(0)
                yield task, group_id or f"g{next(self._group_ids)}"
                continue
            epoch, index = divmod(self.cursor, len(self.tasks))
            order = np.random.default_rng(self.cfg.train.seed + epoch).permutation(len(self.tasks))
            self.cursor += 1
            yield self.tasks[int(order[index])], f"g{next(self._group_ids)}"

    # --- admission loop ----------------------------------------------------------------
    async def _admission_loop(self) -> None:
        while not self._stopping:
            while not self._stopping and not self._sandboxes_full() and self.buffer.try_admit():
                task, group_id = next(self._task_stream)
                job = asyncio.create_task(self._run_group(task, group_id))
                self._running.add(job)
                job.add_done_callback(self._running.discard)
            self._capacity.clear()
            self._admission_clock.enter(self._admission_limit())
            await self._capacity.wait()
            self._admission_clock.enter(None)

    def _admission_limit(self) -> str | None:
        """The bound that stops admission now (the staleness bound first: it is the design's)."""
        if self._stopping:
            return None
        if self.buffer.is_full:
            return "staleness"
        return "sandboxes" if self._sandboxes_full() else None

    def _sandboxes_full(self) -> bool:
        """The running groups fill the sandbox pool (x its oversubscription)."""
        return self.buffer.num_running >= self.max_running_groups

    async def _run_group(self, task: Task, group_id: str) -> None:
        self._in_flight[group_id] = task
        try:
            while True:
                started = self.clock()
                if self._cut_at_deadline:
                    group = await self.rollout.run_group(task, group_id, self.cfg.train.group_size,
                                                         deadline_s=self._deadline_s)
                else:
                    group = await self.rollout.run_group(task, group_id, self.cfg.train.group_size)
                late = self._deadline_s is not None and self.clock() - started >= self._deadline_s
                failure = group_failure(group)
                outcome = self.buffer.put(group, late=late)
                if outcome != "resubmit":
                    break
            self._end_reasons.update(t.termination.value for t in group.trajectories)
            self._in_flight.pop(group_id, None)
            if failure is not None:
                self._count_failure(group.trajectories[0].termination_detail or failure)
            elif outcome == "dropped" and any(t.termination is TerminationReason.DEADLINE
                                              for t in group.trajectories):
                # Not a failure; a deadline that drops every group would starve the trainer.
                policy = self.cfg.buffer.straggler_policy
                other = ("lower buffer.min_group_size" if policy == "partial" else
                         "train their finished samples with straggler_policy=partial")
                if self.breaker.dropped_at_deadline(
                        f"straggler_policy={policy} dropped them at buffer.group_deadline_s="
                        f"{self._deadline_s:g}; raise the deadline, or {other}") is not None:
                    self.stop()
            else:
                self.breaker.succeeded()
        except asyncio.CancelledError:  # stop(): the task stays in flight for the resume
            raise
        except Exception as exc:  # the group could not run at all: dropped, counted
            self._in_flight.pop(group_id, None)
            self.buffer.drop_running(f"group_failed:{type(exc).__name__}")
            self._count_failure(f"{type(exc).__name__}: {exc}")
        finally:
            self._group_ready.set()
            self._capacity.set()

    def _count_failure(self, message: str) -> None:
        if self.breaker.failed(message) is not None:
            self.stop()

    # --- training loop -----------------------------------------------------------------
    async def _take_batch(self) -> list[Group] | None:
        """groups_per_step groups, or None when the run is stopping (they go back)."""
        groups: list[Group] = []
        self._trainer_clock.idle()
        while len(groups) < self.cfg.train.groups_per_step and not self._stopping:
            groups += self.buffer.get(self.cfg.train.groups_per_step - len(groups), self.version)
            if len(groups) < self.cfg.train.groups_per_step:
                self._capacity.set()  # evictions may have freed admission slots
                self._group_ready.clear()
                await self._group_ready.wait()
        self._trainer_clock.busy()
        if self._stopping:
            self.buffer.give_back(groups)
            return None
        return groups

    async def _train_on(self, groups: list[Group]) -> dict[str, float]:
        # Per sample over each group, then onto each of its rows (segments of a sample).
        batch = TrainBatch.from_groups(groups, [compute_group_advantages(g, self.cfg.loss) for g in groups],
                                       self.version)
        start = self.clock()
        outcome = await self.trainer.train(batch)
        return {"timing/train_s": self.clock() - start, **outcome.metrics}

    async def _push(self) -> dict[str, float]:
        """Weights to engines at a turn boundary: prepare them while turns go on, then
        drain turns, send + verify, reopen. Only the send holds the gates closed."""
        start, wall = self.clock(), self.wall_clock()
        await self.trainer.prepare_weights(self.version + 1)
        prepared = self.clock()
        await self.rollout.close_gates()
        try:
            outcome = await self.trainer.push_weights(self.version + 1)
        finally:
            await self.rollout.open_gates()
        end = self.clock()
        if outcome.failed_engines:
            log.warning("engines %s failed during the push of version %d; the run goes on without them",
                        ", ".join(outcome.failed_engines), self.version + 1)
        self._push_event = {"kind": "push", "version": self.version + 1, "t0": round(wall, 4),
                            "prepare_s": round(prepared - start, 4),
                            "gates_closed_s": round(end - prepared, 4),
                            "failed_engines": list(outcome.failed_engines)}
        return {"perf/weight_sync_s": end - start, "perf/weight_gates_closed_s": end - prepared,
                "perf/weight_push_failed_engines": float(len(outcome.failed_engines)),
                "perf/weight_push_attempts": float(outcome.attempts)}

    async def _poll_rollout_idle(self) -> None:
        """Sample whether engines have requests in flight (paused counts as idle)."""
        while not self._stopping:
            stats = await self.rollout.engine_stats()
            busy = [s.num_in_flight > 0 and not s.paused for s in stats.values()]
            self._rollout_idle.append(1.0 - sum(busy) / max(len(busy), 1))
            await asyncio.sleep(0.1)

    async def run(self, on_step: Callable[[int], Awaitable[None]] | None = None,
                  on_batch: Callable[[list[Group], int], None] | None = None) -> RunSummary:
        """Train until train.num_steps or stop(). `on_step(version)` runs after each step
        (checkpoints); `on_batch(groups, version)` sees each batch before training (tests).
        Raises RepeatedFailureError when the breaker tripped (after cleaning up)."""
        start = self.clock()
        rewards: list[float] = []
        admission = asyncio.create_task(self._admission_loop())
        poller = asyncio.create_task(self._poll_rollout_idle())
        every = self.cfg.eval.every_steps
        try:
            if self.eval_tasks and self.version not in self.eval_rewards:
                if before := await self._evaluate():  # weights before any step
                    self.logger.log(self.version, before)
            while self.version < self.cfg.train.num_steps and not self._stopping:
                step_start, step_wall = self.clock(), self.wall_clock()
                groups = await self._take_batch()
                if groups is None:
                    break
                if on_batch is not None:
                    on_batch(groups, self.version)
                metrics = compute_batch_metrics(groups, self.version)
                metrics.update(await self._train_on(groups))
                metrics.update(await self._push())
                self.version += 1
                self.buffer.end_step()
                self._capacity.set()
                self.buffer.check_accounting()
                metrics.update(await self._loop_metrics(step_start))
                rewards.append(metrics["reward/mean"])
                last = self.version >= self.cfg.train.num_steps
                if self.eval_tasks and (last or (every and self.version % every == 0)):
                    metrics.update(await self._evaluate())
                self.logger.log(self.version, metrics)
                if self.transcripts is not None:
                    self.transcripts.write(self.version, groups)
                if self.events is not None:
                    self._write_events(groups, step_wall, metrics)
                if on_step is not None:
                    await on_step(self.version)
        finally:
            self._stopping = True
            self._capacity.set()
            for job in (admission, poller, *self._running):
                job.cancel()
            await asyncio.gather(admission, poller, *self._running, return_exceptions=True)
        if self.breaker.tripped is not None:
            raise RepeatedFailureError(self.breaker.tripped)
        return self.summary(tuple(rewards), self.clock() - start)

    def _write_events(self, groups: list[Group], step_wall: float, metrics: dict[str, float]) -> None:
        assert self.events is not None
        turns, dropped = turn_events(self.version, groups, self.events.max_turns_per_step)
        step = {"kind": "step", "step": self.version, "t0": round(step_wall, 4),
                "t1": round(self.wall_clock(), 4), "turns_dropped": dropped,
                "trainer_wait_s": round(metrics.get("perf/trainer_idle_ratio", 0.0)
                                        * metrics.get("timing/step_s", 0.0), 4)}
        self.events.write([*turns, {**self._push_event, "step": self.version}, step])

    def summary(self, rewards: tuple[float, ...] = (), seconds: float = 0.0) -> RunSummary:
        stats = self.buffer.stats()
        return RunSummary(self.version, rewards, stats.admitted, stats.trained, stats.dropped,
                          stats.running, stats.buffered, seconds, dict(self.eval_rewards),
                          self.version < self.cfg.train.num_steps)

    def stop(self) -> None:
        """Stop admitting and end the run at the next step boundary (Ctrl-C, SIGTERM)."""
        self._stopping = True
        self._stopped.set()
        self._capacity.set()
        self._group_ready.set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # --- evaluation --------------------------------------------------------------------
    async def _evaluate(self) -> dict[str, float]:
        """Mean reward of the held-out tasks under the current version. Runs while the
        training loop waits, so no push can land mid-trajectory; admission goes on."""
        start = self.clock()
        n = self.cfg.eval.samples_per_task
        evaluation = asyncio.ensure_future(asyncio.gather(
            *(self.rollout.run_group(t, f"eval-v{self.version}-{i}", n)
              for i, t in enumerate(self.eval_tasks)), return_exceptions=True))
        stopped = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait({evaluation, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not evaluation.done():  # stop() (Ctrl-C, the breaker): minutes of eval are not waited for
            evaluation.cancel()
            await asyncio.gather(evaluation, return_exceptions=True)
            log.warning("eval at version %d cancelled: the run is stopping", self.version)
            return {}
        results = evaluation.result()
        failed = [r for r in results if isinstance(r, BaseException)]
        for exc in failed[:3]:  # an evaluation problem is reported, never ends the run
            log.error("eval at version %d: a group failed: %r", self.version, exc)
        trajs = [t for g in results if isinstance(g, Group) for t in g.trajectories]
        if not trajs:
            return {"eval/failed_groups": float(len(failed))}
        versions = {int(v) for t in trajs for v in t.versions[t.response_mask == 1]}
        if versions - {self.version}:
            raise RuntimeError(f"eval at version {self.version} sampled tokens of versions "
                               f"{sorted(versions)}: a weight push landed during evaluation")
        samples = [t for t in trajs if t.segment == 0]  # one row per sample (segments share its ending)
        mean = mean_sample_reward(samples)
        self.eval_rewards[self.version] = mean
        log.info("eval at version %d: mean reward %.3f over %d trajectories", self.version,
                 mean, len(samples))
        return {"eval/reward_mean": mean, "eval/num_trajectories": float(len(samples)),
                "eval/failed_groups": float(len(failed)),
                "eval/finished_frac": float(np.mean([t.termination == TerminationReason.FINISHED
                                                     for t in samples])),
                "timing/eval_s": self.clock() - start}

    # --- metrics -----------------------------------------------------------------------
    async def _loop_metrics(self, step_start: float) -> dict[str, float]:
        engines, workers = await asyncio.gather(self.rollout.engine_stats(),
                                                self.rollout.worker_stats())
        out, self._cache_counters = compute_loop_metrics(self.buffer.stats(), engines, workers,
                                                         self._cache_counters)
        idle = self._rollout_idle
        out.update({"perf/trainer_idle_ratio": self._trainer_clock.idle_ratio(),
                    "perf/rollout_idle_ratio": float(np.mean(idle)) if idle else 0.0,
                    "perf/admission_blocked_staleness_ratio": self._admission_clock.ratio("staleness"),
                    "perf/admission_blocked_sandboxes_ratio": self._admission_clock.ratio("sandboxes"),
                    "timing/step_s": self.clock() - step_start})
        if self.env_metrics is not None:
            out.update(await self.env_metrics())
        self._trainer_clock.reset()
        self._admission_clock.reset()
        self._rollout_idle = []
        return out
