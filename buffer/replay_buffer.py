"""The replay buffer between rollout and training: terminal groups only, bounded staleness.

Two mechanisms keep off-policy data within `buffer.max_staleness` (eta) versions:
- admission: a new task group may start only while the groups alive now
  (running + buffered + in training) number fewer than (eta + 1) * groups_per_step, so
  rollout never produces more than training can consume fresh. A group taken by the
  trainer stays alive until its step ends (`end_step`): groups admitted during a step
  are trained at the next version at the earliest. This is AReaL's rule
  accepted + running <= (version + eta + 1) * B in steady state, stated on what is live
  rather than on totals since the start, so it is the same after a resume;
- eviction: a group whose oldest token is more than eta versions behind the trainer when
  it is taken is dropped (counted, broken down by length and turns, so a bias against
  long trajectories shows up in the metrics).

Stragglers (`buffer.group_deadline_s`): a group whose deadline cut some samples
(TerminationReason.DEADLINE) is dropped, or under `straggler_policy: partial` trained on
its finished samples when at least `min_group_size` finished, the cut ones masked and
outside the baseline (Group.in_baseline). Cut samples are counted by the turns and tokens
they had reached, the length bias a deadline introduces.

Every admitted group is accounted for: admitted = trained + dropped + running + buffered
+ in training (`check_accounting`). The buffer owns its checkpointed state (`state()`,
`restore()`): the buffered groups and the totals, so counters continue across resumes;
groups running at a checkpoint are not in it (their tasks are re-admitted on resume).
Plain Python; the controller owns the one instance.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from buffer.batch import is_zero_variance
from envs.types import NO_VERSION, Group, TerminationReason, Trajectory

FAILED = (TerminationReason.ERROR, TerminationReason.TIMEOUT)
DropReason = Literal["stale", "failed", "zero_variance", "resubmits_exhausted", "deadline"]
StragglerPolicy = Literal["wait", "drop", "partial"]
PutOutcome = Literal["buffered", "dropped", "resubmit"]


class AccountingError(RuntimeError):
    """A group was lost or counted twice; the run must stop."""


@dataclass(frozen=True, slots=True)
class BufferStats:
    admitted: int  # groups allowed to start
    running: int  # admitted, not yet returned
    buffered: int  # terminal, waiting for the trainer
    trained: int  # trained on (their step ended)
    in_training: int  # taken by the trainer for the step in progress
    dropped: dict[str, int]  # by reason
    resubmitted: int  # tasks sent back for another attempt (not counted as admitted again)
    masked_trajectories: int
    stale_by_turns: dict[int, int]  # evicted groups by the max turns of their trajectories
    stale_by_length: dict[str, int]  # evicted groups by response-length bucket
    # Group deadlines: late_groups (returned after it; under `wait` all of them trained),
    # cut_samples, partial_groups (trained on their finished samples)
    deadline: dict[str, int] = field(default_factory=dict)
    cut_by_turns: dict[int, int] = field(default_factory=dict)  # cut samples by turns reached
    cut_by_length: dict[str, int] = field(default_factory=dict)  # ... by response tokens reached


@dataclass(frozen=True, slots=True)
class BufferState:
    """What a checkpoint keeps of the buffer: its terminal groups and its totals."""

    groups: tuple[Group, ...]
    admitted: int  # without the groups running at the checkpoint (they are re-admitted)
    trained: int
    dropped: dict[str, int]
    resubmitted: int
    masked_trajectories: int
    attempts: dict[str, int]  # resubmissions per task id
    deadline: dict[str, int] = field(default_factory=dict)  # BufferStats.deadline


def mask_trajectory(t: Trajectory) -> Trajectory:
    """The trajectory with no model token left for the loss (kept for the group's baseline)."""
    zeros = np.zeros(len(t.response_ids))
    return dataclasses.replace(t, response_mask=zeros.astype(np.int8),
                               logprobs=zeros.astype(np.float32),
                               versions=np.full(len(t.response_ids), NO_VERSION, np.int32))


LENGTH_EDGES = (256, 1024, 4096, 16384, 65536)  # response-length buckets of stale evictions


def length_bucket(tokens: float) -> str:
    """The bucket (`<256` ... `>=65536`) a response of `tokens` tokens is counted in."""
    return next((f"<{e}" for e in LENGTH_EDGES if tokens < e), f">={LENGTH_EDGES[-1]}")


class ReplayBuffer:
    def __init__(self, *, max_staleness: int, groups_per_step: int,
                 failure_policy: Literal["mask", "drop", "resubmit"] = "mask",
                 max_resubmits: int = 2, filter_zero_variance: bool = False,
                 straggler_policy: StragglerPolicy = "wait", min_group_size: int = 2) -> None:
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError("need buffer.max_staleness >= 0 and train.groups_per_step >= 1")
        if min_group_size < 2:
            raise ValueError("need buffer.min_group_size >= 2: a baseline needs two samples")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.failure_policy = failure_policy
        self.max_resubmits = max_resubmits
        self.filter_zero_variance = filter_zero_variance
        self.straggler_policy = straggler_policy
        self.min_group_size = min_group_size
        self._groups: deque[Group] = deque()  # oldest first
        self._admitted = self._running = self._trained = self._resubmitted = 0
        self._in_training = 0  # taken for the step in progress
        self._masked = 0
        self._dropped: Counter[str] = Counter()
        self._attempts: Counter[str] = Counter()  # resubmissions per task id
        self._stale_by_turns: Counter[int] = Counter()
        self._stale_by_length: Counter[str] = Counter()
        self._deadline: Counter[str] = Counter()
        self._cut_by_turns: Counter[int] = Counter()
        self._cut_by_length: Counter[str] = Counter()

    @property
    def capacity(self) -> int:
        """Groups that may be alive at once: (eta + 1) * groups_per_step."""
        return (self.max_staleness + 1) * self.groups_per_step

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_alive(self) -> int:
        """Running + buffered + in training: what admission is bounded on."""
        return self._running + len(self._groups) + self._in_training

    @property
    def is_full(self) -> bool:
        """The staleness budget is spent: no group is admitted until one leaves."""
        return self.num_alive >= self.capacity

    def try_admit(self) -> bool:
        """Reserve a slot for one new task group if the staleness budget allows it."""
        if self.is_full:
            return False
        self._admitted += 1
        self._running += 1
        return True

    def put(self, group: Group, *, late: bool = False) -> PutOutcome:
        """A running group came back terminal: buffer it, drop it, or ask for a resubmit.
        On "resubmit" the slot stays reserved (running) for the task's next attempt.
        `late`: it came back after its deadline (counted; under `wait` it is not cut)."""
        if self._running <= 0:
            raise AccountingError(f"group {group.group_id} returned but none was running")
        if late:
            self._deadline["late_groups"] += 1
        cut = [t for t in group.trajectories if t.termination is TerminationReason.DEADLINE]
        if cut:
            self._count_cut(cut)
            if (self.straggler_policy != "partial"
                    or group.num_samples - len(cut) < self.min_group_size):
                return self._drop("deadline")
            group = Group(group.task_id, group.group_id, tuple(
                mask_trajectory(t) if t.termination is TerminationReason.DEADLINE else t
                for t in group.trajectories))
            self._deadline["partial_groups"] += 1
        failed = [t for t in group.trajectories if t.termination in FAILED]
        if failed and self.failure_policy == "resubmit":
            if self._attempts[group.task_id] < self.max_resubmits:
                self._attempts[group.task_id] += 1
                self._resubmitted += 1
                return "resubmit"
            return self._drop("resubmits_exhausted")
        if failed and self.failure_policy == "drop":
            return self._drop("failed")
        if failed:  # mask
            if len(failed) + len(cut) == group.size:  # nothing left to train
                return self._drop("failed")
            group = Group(group.task_id, group.group_id, tuple(
                mask_trajectory(t) if t.termination in FAILED else t for t in group.trajectories))
            self._masked += len(failed)
        if self.filter_zero_variance and is_zero_variance(group.rewards()[group.in_baseline()]):
            return self._drop("zero_variance")
        self._running -= 1
        self._groups.append(group)
        return "buffered"

    def _count_cut(self, cut: list[Trajectory]) -> None:
        self._deadline["cut_samples"] += len(cut)
        for t in cut:
            self._cut_by_turns[len(t.turns)] += 1
            self._cut_by_length[length_bucket(len(t.response_ids))] += 1

    def drop_running(self, reason: str) -> None:
        """A running group that will never come back (its worker died, its reward failed)."""
        if self._running <= 0:
            raise AccountingError("drop_running called but no group is running")
        self._running -= 1
        self._dropped[reason] += 1

    def _drop(self, reason: DropReason) -> PutOutcome:
        self._running -= 1
        self._dropped[reason] += 1
        return "dropped"

    def get(self, n: int, version: int) -> list[Group]:
        """Up to `n` groups, oldest first, after evicting every group too stale to train at
        `version`. Returns fewer than n when not enough are buffered (the trainer waits).
        The groups stay alive (in training) until `end_step`."""
        self._evict_stale(version)
        out = [self._groups.popleft() for _ in range(min(n, len(self._groups)))]
        self._in_training += len(out)
        return out

    def end_step(self) -> None:
        """The step on the groups taken since the last call is over: they count as trained
        and their admission slots are free."""
        self._trained += self._in_training
        self._in_training = 0

    def give_back(self, groups: list[Group]) -> None:
        """Groups taken for a step that did not happen (the run stopped first): buffered
        again, oldest first."""
        if len(groups) > self._in_training:
            raise AccountingError(f"{len(groups)} groups given back, {self._in_training} taken")
        self._in_training -= len(groups)
        self._groups.extendleft(reversed(groups))

    def _evict_stale(self, version: int) -> None:
        keep: deque[Group] = deque()
        for group in self._groups:
            oldest = group.oldest_version()
            if oldest is not None and version - oldest > self.max_staleness:
                self._dropped["stale"] += 1
                self._stale_by_turns[max(len(t.turns) for t in group.trajectories)] += 1
                longest = max(len(t.response_ids) for t in group.trajectories)
                self._stale_by_length[length_bucket(longest)] += 1
            else:
                keep.append(group)
        self._groups = keep

    def state(self) -> BufferState:
        """The checkpoint of the buffer between steps (nothing in training)."""
        if self._in_training:
            raise AccountingError("state() during a step: end_step() or give_back() first")
        return BufferState(tuple(self._groups), self._admitted - self._running, self._trained,
                           dict(self._dropped), self._resubmitted, self._masked,
                           dict(self._attempts), dict(self._deadline))

    def restore(self, state: BufferState) -> None:
        """Continue from a checkpoint: its groups buffered, its totals carried on."""
        if self._admitted or self._groups:
            raise AccountingError("restore() into a buffer that was already used")
        self._groups.extend(state.groups)
        self._admitted, self._trained = state.admitted, state.trained
        self._dropped.update(state.dropped)
        self._resubmitted, self._masked = state.resubmitted, state.masked_trajectories
        self._attempts.update(state.attempts)
        self._deadline.update(getattr(state, "deadline", {}))  # absent in older checkpoints

    def __len__(self) -> int:
        return len(self._groups)

    def check_accounting(self) -> None:
        """admitted = trained + dropped + running + buffered + in training, or AccountingError."""
        total = (self._trained + sum(self._dropped.values()) + self._running + len(self._groups)
                 + self._in_training)
        if total != self._admitted:
            raise AccountingError(f"admitted {self._admitted} groups but trained {self._trained} + "
                                  f"dropped {dict(self._dropped)} + running {self._running} + "
                                  f"buffered {len(self._groups)} + in training "
                                  f"{self._in_training} = {total}")

    def stats(self) -> BufferStats:
        return BufferStats(self._admitted, self._running, len(self._groups), self._trained,
                           self._in_training, dict(self._dropped), self._resubmitted, self._masked,
                           dict(self._stale_by_turns), dict(self._stale_by_length),
                           dict(self._deadline), dict(self._cut_by_turns), dict(self._cut_by_length))
