"""What long first-use work is doing: the tiny model's build, the warm start, task sets
and images are built once and cached, and can take minutes on a loaded machine. Each says
what it builds, why (first use), where the result is cached, and how far along it is
with an estimate of what is left, in log lines every `every_s` seconds (in a log file and
on a terminal, never flooding either); on a terminal a build with a known size also keeps
a progress bar on stderr's last line, cleared before each log line and at the end.

    with FirstUse("the warm start (500 supervised steps)", out, total=500, unit="steps") as p:
        for _ in range(500):
            ...
            p.advance()

Each build is also recorded (`recorded_builds`): a run writes those of its process into
events.jsonl, so the run report labels the time they took in its timeline.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

EVERY_S = 15.0  # how often a long build says how far it is
BAR_EVERY_S = 0.5  # how often the terminal's bar is redrawn
BAR_WIDTH = 30


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
        self._start = self._said = self._started_at = self._drawn = 0.0
        self._bar_shown = False
        self._tty = False

    def __enter__(self) -> FirstUse:
        self._start = self._said = time.monotonic()
        self._started_at = time.time()
        self._tty = bool(self.total) and sys.stderr.isatty()
        size = f" ({self.total} {self.unit})" if self.total else ""
        log.info("building %s%s: first use, cached in %s for later runs", self.what, size,
                 self.where)
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        elapsed = now - self._start
        left = elapsed / self.done * (self.total - self.done) if self.total and self.done else 0.0
        if now - self._said >= self.every_s:
            self._said = now
            self._clear_bar()
            if self.total:
                log.info("building %s: %d/%d %s, %.0f s so far, about %.0f s left", self.what,
                         self.done, self.total, self.unit, elapsed, left)
            else:
                log.info("building %s: %d %s, %.0f s so far", self.what, self.done, self.unit,
                         elapsed)
        if self._tty and (now - self._drawn >= BAR_EVERY_S or self.done == self.total):
            self._drawn = now
            self._draw_bar(left)

    def _draw_bar(self, left_s: float) -> None:
        total = max(self.total or 1, 1)
        filled = min(BAR_WIDTH, BAR_WIDTH * self.done // total)
        sys.stderr.write(f"\r{self.what[:48]} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                         f"{self.done}/{total} {self.unit}, about {left_s:.0f} s left\033[K")
        sys.stderr.flush()
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._bar_shown = False

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        elapsed = time.monotonic() - self._start
        self._clear_bar()
        _BUILDS.append(BuildRecord(self.what, str(self.where), self._started_at,
                                   self._started_at + elapsed, kind is None))
        if kind is None:
            log.info("built %s in %.1f s (%s)", self.what, elapsed, self.where)
        else:
            log.warning("building %s failed after %.1f s; nothing was cached", self.what, elapsed)
