"""What long first-use work is doing: the tiny model's build, the warm start, task sets
and images are built once and cached, and can take minutes on a loaded machine. Each says
what it builds, why (first use), where the result is cached, and how far along it is
with an estimate of what is left, in log lines every `every_s` seconds (they read the same
on a terminal and in a log file, and never flood either).

    with FirstUse("the warm start (500 supervised steps)", out, total=500, unit="steps") as p:
        for _ in range(500):
            ...
            p.advance()

Each build is also recorded (`recorded_builds`): a run writes those of its process into
events.jsonl, so the run report labels the time they took in its timeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

EVERY_S = 15.0  # how often a long build says how far it is


@dataclass(frozen=True, slots=True)
class BuildRecord:
    """One first-use build this process ran."""

    what: str
    where: str  # where its result is cached
    t0: float  # unix seconds
    t1: float
    ok: bool  # False: it failed (nothing was cached)


_BUILDS: list[BuildRecord] = []  # this process's builds, oldest first


def recorded_builds() -> list[BuildRecord]:
    """The first-use builds this process has run so far, oldest first."""
    return list(_BUILDS)


class FirstUse:
    def __init__(self, what: str, where: str | Path, *, total: int | None = None,
                 unit: str = "steps", every_s: float = EVERY_S) -> None:
        self.what, self.where, self.total, self.unit = what, where, total, unit
        self.every_s = every_s
        self.done = 0
        self._start = self._said = self._started_at = 0.0

    def __enter__(self) -> FirstUse:
        self._start = self._said = time.monotonic()
        self._started_at = time.time()
        size = f" ({self.total} {self.unit})" if self.total else ""
        log.info("building %s%s: first use, cached in %s for later runs", self.what, size,
                 self.where)
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._said < self.every_s:
            return
        self._said = now
        elapsed = now - self._start
        if self.total:
            left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            log.info("building %s: %d/%d %s, %.0f s so far, about %.0f s left", self.what,
                     self.done, self.total, self.unit, elapsed, left)
        else:
            log.info("building %s: %d %s, %.0f s so far", self.what, self.done, self.unit, elapsed)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        elapsed = time.monotonic() - self._start
        _BUILDS.append(BuildRecord(self.what, str(self.where), self._started_at,
                                   self._started_at + elapsed, kind is None))
        if kind is None:
            log.info("built %s in %.1f s (%s)", self.what, elapsed, self.where)
        else:
            log.warning("building %s failed after %.1f s; nothing was cached", self.what, elapsed)
