"""The replay buffer between rollout and training: terminal groups only, bounded staleness.

Two mechanisms keep off-policy data within `buffer.max_staleness` (eta) versions:
- admission (AReaL's rule): a new task group may start only while
  accepted + running < (version + eta + 1) * groups_per_step, so rollout never produces
  more than training can consume fresh;
- eviction: a group whose oldest token is more than eta versions behind the trainer when
  it is taken is dropped (counted, broken down by length and turns, so a bias against
  long trajectories shows up in the metrics).

Every admitted group is accounted for: admitted = trained + dropped + running + buffered
(`check_accounting`). Plain Python; the controller owns the one instance.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from envs.types import NO_VERSION, Group, TerminationReason, Trajectory

FAILED = (TerminationReason.ERROR, TerminationReason.TIMEOUT)
DropReason = Literal["stale", "failed", "zero_variance", "resubmits_exhausted"]
PutOutcome = Literal["buffered", "dropped", "resubmit"]


class AccountingError(RuntimeError):
    """A group was lost or counted twice; the run must stop."""


@dataclass(frozen=True, slots=True)
class BufferStats:
    admitted: int  # groups allowed to start
    running: int  # admitted, not yet returned
    buffered: int  # terminal, waiting for the trainer
    trained: int  # handed to the trainer
    dropped: dict[str, int]  # by reason
    resubmitted: int  # tasks sent back for another attempt (not counted as admitted again)
    masked_trajectories: int
    stale_by_turns: dict[int, int]  # evicted groups by the max turns of their trajectories
    stale_by_length: dict[str, int]  # evicted groups by response-length bucket


def mask_trajectory(t: Trajectory) -> Trajectory:
    """The trajectory with no model token left for the loss (kept for the group's baseline)."""
    zeros = np.zeros(len(t.response_ids))
    return dataclasses.replace(t, response_mask=zeros.astype(np.int8),
                               logprobs=zeros.astype(np.float32),
                               versions=np.full(len(t.response_ids), NO_VERSION, np.int32))


def _length_bucket(n: int) -> str:
    edges = (256, 1024, 4096, 16384, 65536)
    for edge in edges:
        if n < edge:
            return f"<{edge}"
    return f">={edges[-1]}"


class ReplayBuffer:
    def __init__(self, *, max_staleness: int, groups_per_step: int,
                 failure_policy: Literal["mask", "drop", "resubmit"] = "mask",
                 max_resubmits: int = 2, filter_zero_variance: bool = False) -> None:
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError("need buffer.max_staleness >= 0 and train.groups_per_step >= 1")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.failure_policy = failure_policy
        self.max_resubmits = max_resubmits
        self.filter_zero_variance = filter_zero_variance
        self._groups: deque[Group] = deque()  # oldest first
        self._admitted = self._running = self._trained = self._resubmitted = 0
        self._masked = 0
        self._dropped: Counter[str] = Counter()
        self._attempts: Counter[str] = Counter()  # resubmissions per task id
        self._stale_by_turns: Counter[int] = Counter()
        self._stale_by_length: Counter[str] = Counter()

    def capacity(self, version: int) -> int:
        """Groups that may be accepted or running at trainer `version` (AReaL's bound)."""
        return (version + self.max_staleness + 1) * self.groups_per_step

    def try_admit(self, version: int) -> bool:
        """Reserve a slot for one new task group if the staleness budget allows it."""
        accepted = self._trained + len(self._groups)
        if accepted + self._running >= self.capacity(version):
            return False
        self._admitted += 1
        self._running += 1
        return True

    def put(self, group: Group) -> PutOutcome:
        """A running group came back terminal: buffer it, drop it, or ask for a resubmit.
        On "resubmit" the slot stays reserved (running) for the task's next attempt."""
        if self._running <= 0:
            raise AccountingError(f"group {group.group_id} returned but none was running")
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
            if len(failed) == group.size:
                return self._drop("failed")
            group = Group(group.task_id, group.group_id, tuple(
                mask_trajectory(t) if t.termination in FAILED else t for t in group.trajectories))
            self._masked += len(failed)
        if self.filter_zero_variance:
            rewards = group.rewards()
            if float(rewards.max() - rewards.min()) <= 1e-8:
                return self._drop("zero_variance")
        self._running -= 1
        self._groups.append(group)
        return "buffered"

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
        `version`. Returns fewer than n when not enough are buffered (the trainer waits)."""
        self._evict_stale(version)
        out = [self._groups.popleft() for _ in range(min(n, len(self._groups)))]
        self._trained += len(out)
        return out

    def _evict_stale(self, version: int) -> None:
        keep: deque[Group] = deque()
        for group in self._groups:
            oldest = group.oldest_version()
            if oldest is not None and version - oldest > self.max_staleness:
                self._dropped["stale"] += 1
                self._stale_by_turns[max(len(t.turns) for t in group.trajectories)] += 1
                longest = max(len(t.response_ids) for t in group.trajectories)
                self._stale_by_length[_length_bucket(longest)] += 1
            else:
                keep.append(group)
        self._groups = keep

    def buffered_groups(self) -> list[Group]:
        """The terminal groups waiting for the trainer (for checkpoints)."""
        return list(self._groups)

    def restore(self, groups: list[Group]) -> None:
        """Put checkpointed groups back; they count as admitted and buffered."""
        self._groups.extend(groups)
        self._admitted += len(groups)

    def __len__(self) -> int:
        return len(self._groups)

    def check_accounting(self) -> None:
        """admitted = trained + dropped + running + buffered, or AccountingError."""
        total = self._trained + sum(self._dropped.values()) + self._running + len(self._groups)
        if total != self._admitted:
            raise AccountingError(f"admitted {self._admitted} groups but trained {self._trained} + "
                                  f"dropped {dict(self._dropped)} + running {self._running} + "
                                  f"buffered {len(self._groups)} = {total}")

    def stats(self) -> BufferStats:
        return BufferStats(self._admitted, self._running, len(self._groups), self._trained,
                           dict(self._dropped), self._resubmitted, self._masked,
                           dict(self._stale_by_turns), dict(self._stale_by_length))
