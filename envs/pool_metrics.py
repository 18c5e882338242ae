"""Sandbox-pool statistics as per-step metrics (DESIGN.md `env/*` keys).

PoolStats are cumulative and per pool; a training step wants what happened since the last
step across all pools. `PoolMetrics.update` keeps the previous totals and returns the
difference: commands run, their mean duration and a histogram (bucket counts under
`env/exec_s_hist/le_<bound>`), queue wait, faults, plus the point-in-time occupancy.
"""

from __future__ import annotations

from collections.abc import Sequence

from envs.pool import PoolStats

_FAULTS = ("num_timeouts", "num_oom_kills", "num_crashes", "num_recreates",
           "num_recreate_failures", "num_create_failures")


class PoolMetrics:
    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def _delta(self, key: str, total: float) -> float:
        previous = self._last.get(key, 0.0)
        self._last[key] = total
        return total - previous

    def update(self, stats: Sequence[PoolStats]) -> dict[str, float]:
        if not stats:
            return {}
        out = {"env/sandboxes_in_use": float(sum(s.num_in_use for s in stats)),
               "env/sandboxes_warm": float(sum(s.num_warm for s in stats)),
               "env/queue_length": float(sum(s.queue_length for s in stats)),
               "env/queue_wait_s_p99": max(s.queue_wait.p99_s for s in stats),
               "env/exec_s_p50": max(s.exec.p50_s for s in stats),
               "env/exec_s_p99": max(s.exec.p99_s for s in stats),
               "env/create_s_p50": max(s.create.p50_s for s in stats),
               # the image cache of the sandbox nodes, from prewarm (totals over pools)
               "env/images_ready": float(sum(s.num_images_ready for s in stats)),
               "env/images_loaded": float(sum(s.num_images_loaded for s in stats)),
               "env/images_pulled": float(sum(s.num_images_pulled for s in stats))}
        execs = self._delta("execs", sum(s.exec.count for s in stats))
        exec_s = self._delta("exec_s", sum(s.exec.total_s for s in stats))
        waits = self._delta("waits", sum(s.queue_wait.count for s in stats))
        wait_s = self._delta("wait_s", sum(s.queue_wait.total_s for s in stats))
        out["env/execs"] = execs
        out["env/exec_s"] = exec_s / execs if execs else 0.0
        out["env/queue_wait_s"] = wait_s / waits if waits else 0.0
        bounds = stats[0].exec.bounds_s
        for i, bound in enumerate((*bounds, float("inf"))):
            label = "inf" if bound == float("inf") else f"{bound:g}"
            count = sum(s.exec.counts[i] for s in stats)
            out[f"env/exec_s_hist/le_{label}"] = self._delta(f"hist{i}", count)
        for name in _FAULTS:
            out["env/" + name.removeprefix("num_")] = self._delta(
                name, sum(getattr(s, name) for s in stats))
        return out
