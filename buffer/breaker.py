"""The circuit breaker of a run: a failure that repeats for group after group (a plug-in
that cannot be imported, a task naming an unregistered tool, a reward function that
raises every time) stops the run with that error instead of retrying forever, and its
log lines are counted instead of repeated.

A group's failure has a signature: the error with the parts that vary per task (quoted
names, numbers, paths) masked, so "task 'a' names unknown tools ['x']" and "task 'b'
names unknown tools ['x']" are the same error. The breaker trips after `threshold`
consecutive failed groups with one signature, or `3 * threshold` consecutive failed
groups of any kind (nothing is succeeding). Any group that produced a trainable
trajectory resets it. Plain Python.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from envs.types import Group, TerminationReason

log = logging.getLogger(__name__)

_VARYING = [(re.compile(r"'[^']*'|\"[^\"]*\""), "'…'"),  # quoted names and paths
            (re.compile(r"0x[0-9a-fA-F]+|\d+(\.\d+)?"), "N")]
# A failed group: none of its samples ended on its own. A group its deadline cut whole is
# not one: the straggler policy drops it (`dropped_at_deadline`).
FAILED = (TerminationReason.ERROR, TerminationReason.TIMEOUT)


def failure_signature(message: str) -> str:
    """The error of `message` (its first line) with per-task details masked."""
    line = (message.strip().splitlines() or [""])[0][:300]
    for pattern, mask in _VARYING:
        line = pattern.sub(mask, line)
    return line


def group_failure(group: Group) -> str | None:
    """The signature of a group in which every trajectory failed (None if one did not)."""
    if not all(t.termination in FAILED for t in group.trajectories):
        return None
    first = group.trajectories[0]
    return failure_signature(first.termination_detail or first.termination.value)


EVERY_GROUP_FAILS = "every group fails"  # the signature of a trip on failures of any kind
DEADLINE_DROPS = "every group dropped at its deadline"  # ... on straggler-policy drops


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]


@dataclass(frozen=True, slots=True)
class RepeatedFailure:
    signature: str  # grouping only: numbers and quoted names are masked in it
    count: int  # consecutive failed groups when the breaker tripped
    example: str  # the first message of the streak, as it was
    limit: int  # buffer.max_repeated_failures

    def message(self) -> str:
        if self.signature == DEADLINE_DROPS:
            return (f"stopped: the last {self.count} groups to come back (every admission slot, "
                    f"(buffer.max_staleness + 1) x train.groups_per_step) were all dropped at "
                    f"their deadline; {self.example.strip()}")
        if self.signature == EVERY_GROUP_FAILS:
            head = (f"stopped: no group succeeded in the last {self.count} (3 x "
                    f"buffer.max_repeated_failures={self.limit}); {self.example.strip()}")
        else:
            head = (f"stopped: {self.count} groups in a row failed with the same error "
                    f"(buffer.max_repeated_failures={self.limit}); the first of them:\n"
                    f"  {self.example.strip()}")
        return (f"{head}\nFix the cause (often a plug-in import string, a task's tool names, a "
                "tool or a reward function), then resume.")


class FailureBreaker:
    """Stops the run on failures that repeat for every group: `threshold` in a row with
    the same error, 3x that with any. Groups the straggler policy drops at their deadline
    are not failures (at scale they come back in bursts as many groups meet one deadline):
    only `deadline_threshold` of them in a row with no group trained on between (every
    admission slot cycled through for nothing) trips it."""

    def __init__(self, threshold: int, deadline_threshold: int | None = None) -> None:
        if threshold < 1:
            raise ValueError(f"buffer.max_repeated_failures must be >= 1, got {threshold}")
        self.threshold = threshold
        self.deadline_threshold = deadline_threshold or threshold
        self._deadline_streak = 0
        self._streak: Counter[str] = Counter()
        self._streak_total = 0
        self._seen: Counter[str] = Counter()  # all-time, for log throttling
        self._examples: dict[str, str] = {}
        self.tripped: RepeatedFailure | None = None

    def succeeded(self) -> None:
        self._streak.clear()
        self._streak_total = 0
        self._deadline_streak = 0

    def dropped_at_deadline(self, message: str) -> RepeatedFailure | None:
        """Count one group dropped at its deadline; the RepeatedFailure once the breaker trips."""
        self._deadline_streak += 1
        if self.tripped is None and self._deadline_streak >= self.deadline_threshold:
            self.tripped = RepeatedFailure(DEADLINE_DROPS, self._deadline_streak, message,
                                           self.threshold)
        return self.tripped

    def failed(self, message: str) -> RepeatedFailure | None:
        """Count one failed group; the RepeatedFailure once the breaker trips."""
        sig = failure_signature(message)
        self._seen[sig] += 1
        n = self._seen[sig]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a repeated error costs log lines in log2(n)
            log.error("group failed (%d time%s so far): %s", n, "" if n == 1 else "s",
                      message.strip() if n == 1 else _first_line(message))
        self._streak[sig] += 1
        self._streak_total += 1
        if self._streak[sig] == 1:  # the example shown is the first of this streak
            self._examples[sig] = message
        if self.tripped is None:
            if self._streak[sig] >= self.threshold:
                self.tripped = RepeatedFailure(sig, self._streak[sig], self._examples[sig],
                                               self.threshold)
            elif self._streak_total >= 3 * self.threshold:
                top = "\n".join(f"  (x{n}) {_first_line(self._examples[k])}"
                                 for k, n in self._streak.most_common(3))
                self.tripped = RepeatedFailure(EVERY_GROUP_FAILS, self._streak_total,
                                               f"the most frequent errors:\n{top}", self.threshold)
        return self.tripped
