"""Sandbox model: how long one sandboxed command takes, and a fixed pool of sandboxes that
trajectories queue for. Clock-free: callers pass the time.

Execution times follow the seed's long-tail table (section 6.1): a typical test run of
~30 s with a lognormal body, rare hangs (dead loops, waits on the network) that run into
the tool timeout (10 minutes at the extreme), and sandbox crashes that are retried (up to
3 times) after a cold start. `SEED_EXEC` is calibrated so that 5% of 20-turn trajectories
meet at least one hang, the seed's "the last 5% stick on timeouts and retries".
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExecSample:
    seconds: float  # wall clock the caller waits, retries included
    timed_out: bool
    retries: int
    failed: bool  # every attempt crashed: the tool returns an error


@dataclass(frozen=True, slots=True)
class ExecTimeModel:
    """One command's wall clock: lognormal body with mean `mean_s`, hangs, crashes."""

    mean_s: float = 30.0
    sigma: float = 0.6  # lognormal shape; 0 makes every run take exactly mean_s
    hang_prob: float = 0.0  # the command never returns by itself: it runs to timeout_s
    timeout_s: float = 600.0
    crash_prob: float = 0.0  # per attempt: the sandbox dies part-way and is restarted
    max_retries: int = 3
    restart_s: float = 3.0  # a cold container start (the seed: 1-5 s)

    def __post_init__(self) -> None:
        if self.mean_s < 0 or self.timeout_s <= 0:
            raise ValueError("mean_s must be >= 0 and timeout_s > 0")
        for name in ("hang_prob", "crash_prob"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1)")
        if self.sigma < 0 or self.max_retries < 0 or self.restart_s < 0:
            raise ValueError("sigma, max_retries and restart_s must be >= 0")

    @property
    def median_s(self) -> float:
        return self.mean_s / math.exp(self.sigma ** 2 / 2)

    def sample(self, rng: random.Random) -> ExecSample:
        waited = 0.0
        for attempt in range(self.max_retries + 1):
            if rng.random() < self.hang_prob:
                run_s = self.timeout_s
            else:
                run_s = min(self.timeout_s, self.median_s * math.exp(self.sigma * rng.gauss(0, 1)))
            if rng.random() >= self.crash_prob:
                return ExecSample(waited + run_s, run_s >= self.timeout_s, attempt, False)
            waited += run_s * rng.random() + self.restart_s  # it died part-way through
        return ExecSample(waited, False, self.max_retries, True)


def hang_prob_for(trajectory_share: float, turns: int) -> float:
    """Per-command hang probability that makes `trajectory_share` of the trajectories of
    `turns` commands meet at least one hang: 1 - (1 - p)^turns = share."""
    return 1 - (1 - trajectory_share) ** (1 / turns)


def seed_tail(exec_s: float, turns: int, timeout_s: float) -> ExecTimeModel:
    """`--tail seed` of `launch.simulate`: a lognormal body of mean `exec_s`, hangs on 5% of
    the trajectories of `turns` commands, run into `timeout_s` (the tool timeout), and 1%
    of attempts crashing (retried up to 3 times after a 3 s cold start). The heavy-tail
    bench (tests/bench/heavy_tail_loop.py) draws its sandbox commands' times from it too."""
    return ExecTimeModel(mean_s=exec_s, sigma=0.6, hang_prob=hang_prob_for(0.05, turns),
                         timeout_s=timeout_s, crash_prob=0.01, max_retries=3, restart_s=3.0)


SEED_EXEC = ExecTimeModel(mean_s=30.0, sigma=0.6, hang_prob=hang_prob_for(0.05, 20),
                          timeout_s=600.0, crash_prob=0.01, max_retries=3, restart_s=3.0)


@dataclass(frozen=True, slots=True)
class SandboxPoolStats:
    in_use: int
    queued: int
    peak_in_use: int
    peak_queued: int
    mean_in_use: float  # time-weighted since time 0
    num_grants: int
    mean_wait_s: float
    max_wait_s: float


class SandboxPoolModel:
    """`num_sandboxes` sandboxes granted first come, first served. A stateful trajectory
    holds one from its first turn to its last; a releasable one per command, paying
    `restore_s` (snapshot restore) on every grant."""

    def __init__(self, num_sandboxes: int, restore_s: float = 0.0) -> None:
        if num_sandboxes < 1:
            raise ValueError("num_sandboxes must be >= 1")
        self.num_sandboxes = num_sandboxes
        self.restore_s = restore_s
        self._holders: set[str] = set()
        self._queue: deque[tuple[str, float]] = deque()
        self._last_s = 0.0
        self._area = 0.0  # integral of in_use over time
        self._peak = self._peak_queued = self._grants = 0
        self._wait_sum = self._wait_max = 0.0
        self.timeline: list[tuple[float, int, int]] = []  # (time, in use, queued) on change

    def acquire(self, now: float, holder: str) -> bool:
        """True: granted now; False: queued, granted by a later `release`."""
        if holder in self._holders or self.is_queued(holder):
            raise ValueError(f"{holder} already holds or waits for a sandbox")
        self._tick(now)
        if len(self._holders) < self.num_sandboxes:
            self._grant(now, holder, now)
            granted = True
        else:
            self._queue.append((holder, now))
            self._peak_queued = max(self._peak_queued, len(self._queue))
            granted = False
        self._record(now)
        return granted

    def release(self, now: float, holder: str) -> list[str]:
        """Free `holder`'s sandbox; the holders granted one in its place, in order."""
        if holder not in self._holders:
            raise ValueError(f"{holder} holds no sandbox")
        self._tick(now)
        self._holders.remove(holder)
        granted = []
        while self._queue and len(self._holders) < self.num_sandboxes:
            waiter, since = self._queue.popleft()
            self._grant(now, waiter, since)
            granted.append(waiter)
        self._record(now)
        return granted

    def leave_queue(self, now: float, holder: str) -> None:
        """A waiter gives up (its trajectory timed out or was cancelled)."""
        self._tick(now)
        self._queue = deque((h, t) for h, t in self._queue if h != holder)
        self._record(now)

    def is_queued(self, holder: str) -> bool:
        return any(h == holder for h, _ in self._queue)

    def stats(self, now: float) -> SandboxPoolStats:
        self._tick(now)
        return SandboxPoolStats(
            in_use=len(self._holders), queued=len(self._queue), peak_in_use=self._peak,
            peak_queued=self._peak_queued, mean_in_use=self._area / now if now > 0 else 0.0,
            num_grants=self._grants, mean_wait_s=self._wait_sum / self._grants if self._grants else 0.0,
            max_wait_s=self._wait_max)

    def _grant(self, now: float, holder: str, since: float) -> None:
        self._holders.add(holder)
        self._grants += 1
        self._wait_sum += now - since
        self._wait_max = max(self._wait_max, now - since)
        self._peak = max(self._peak, len(self._holders))

    def _tick(self, now: float) -> None:
        if now < self._last_s:
            raise ValueError(f"time went back: {now} < {self._last_s}")
        self._area += len(self._holders) * (now - self._last_s)
        self._last_s = now

    def _record(self, now: float) -> None:
        self.timeline.append((now, len(self._holders), len(self._queue)))
