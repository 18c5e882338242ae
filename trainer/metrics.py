"""Metrics: one small logger with jsonl, wandb and console sinks, plus the busy/idle
clocks behind perf/*_idle_ratio.

Keys are slash-namespaced (DESIGN.md's list: perf/rollout_idle_ratio, staleness/max,
loss/clip_frac, ...). wandb is offline unless the recipe says otherwise and never needs
a network; it is imported only when its sink is built.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step: {"step": n, "time": unix_s, key: value, ...}."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    def __init__(self, project: str, run_name: str, run_dir: Path, mode: str,
                 config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode,
                               config=dict(config), reinit="finish_previous")
        self.run_dir = Path(self._run.dir).parent

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class ConsoleSink:
    """A compact line per step with the numbers people watch."""

    KEYS = ("reward/mean", "eval/reward_mean", "perf/rollout_idle_ratio",
            "perf/trainer_idle_ratio", "staleness/mean", "staleness/max", "loss/clip_frac",
            "loss/entropy", "perf/weight_sync_s", "timing/step_s")

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(highlight=False)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [f"{k}={metrics[k]:.3g}" for k in self.KEYS if k in metrics]
        self._console.print(f"[bold]step {step}[/bold] " + "  ".join(parts))

    def close(self) -> None:
        pass


class MetricsLogger:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks
        self.keys_seen: set[str] = set()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.keys_seen.update(metrics)
        for sink in self.sinks:
            try:
                sink.write(step, metrics)
            except Exception:  # a broken sink must not stop training
                log.exception("metrics sink %s failed", type(sink).__name__)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class BusyClock:
    """Fraction of wall time something was idle. `busy()` / `idle()` switch state; the
    ratio covers the time since the last `reset()`."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._busy = False
        self._since = now()
        self._window_start = self._since
        self._idle_s = 0.0

    def _settle(self) -> None:
        now = self._now()
        if not self._busy:
            self._idle_s += now - self._since
        self._since = now

    def busy(self) -> None:
        self._settle()
        self._busy = True

    def idle(self) -> None:
        self._settle()
        self._busy = False

    def idle_ratio(self) -> float:
        self._settle()
        window = self._since - self._window_start
        return self._idle_s / window if window > 0 else 0.0

    def reset(self) -> None:
        self._settle()
        self._window_start = self._since
        self._idle_s = 0.0


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
