"""Faults inside a whole run (real Ray, vLLM, sandboxes, DeepSpeed), each injected from
outside the way it happens in production, not through a hook in the code under test:

- one of two engines is SIGKILLed mid-run (a node or process dies): its sessions move to
  the other engine, the weight push goes on to the live one;
- sandbox workspaces vanish under running trajectories (a host cleanup or a crashed
  sandbox): the tool call becomes an error observation and the pool recreates the
  sandbox from its last snapshot;
- every tool call outlives agent.tool_timeout_s: each becomes a timeout observation.

In each case the run reaches train.num_steps and the accounting identity holds (the
controller also checks it after every step and would stop the run)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import threading

import pytest

from envs.sandbox import workspace
from quickstart_run import quickstart_config

pytestmark = pytest.mark.timeout(1200)


def _metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_accounted(summary) -> None:
    assert summary.admitted == summary.trained + sum(summary.dropped.values()) + \
        summary.running + summary.buffered


def _kill_one_engine() -> int:
    """SIGKILL the process of one live EngineActor of this Ray cluster; its pid."""
    import ray._private.state as ray_state

    live = [a for a in ray_state.actors().values()
            if a["ActorClassName"] == "EngineActor" and a["State"] == "ALIVE"]
    assert len(live) == 2, f"expected two live engines, found {len(live)}"
    pid = int(live[0]["Pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


class WorkspaceWiper(threading.Thread):
    """Removes every live sandbox workspace under `root` (the test's own temp folder: its
    run's sandboxes only, never another run's on this machine) a few times a second."""

    def __init__(self, root: str) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.wiped = 0

    def run(self) -> None:
        while not self.stop.wait(0.3):
            for ws in glob.glob(os.path.join(self.root, "sluice-sandbox-*", "workspace")):
                try:
                    workspace.unmount(ws)
                    os.rmdir(ws)
                    self.wiped += 1
                except OSError:
                    pass  # released meanwhile, or not mounted yet


def test_a_killed_engine_and_vanishing_sandboxes_do_not_stop_the_run(tmp_path, own_tmpdir):
    from trainer.run.system import run

    cfg = quickstart_config(tmp_path, "faults", "train.num_steps=4", "rollout.num_engines=2")
    killed: list[int] = []

    def inject(groups, version):
        if version == 1 and not killed:
            killed.append(_kill_one_engine())

    wiper = WorkspaceWiper(str(own_tmpdir))
    wiper.start()
    try:
        summary, run_dir = asyncio.run(run(cfg, "faults", on_batch=inject))
    finally:
        wiper.stop.set()
        wiper.join()
    assert killed and summary.steps == 4
    _assert_accounted(summary)
    rows = _metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert wiper.wiped > 0
    assert sum(r.get("env/crashes", 0) for r in rows) > 0, "no sandbox crash reached the pool"
    assert sum(r.get("env/recreates", 0) for r in rows) > 0
    # The killed engine is dropped once: by the push that found it dead, or before it by
    # the driver's own calls; the engine left serves every later version.
    assert sum(r["perf/weight_push_failed_engines"] for r in rows) <= 1
    assert all(r["staleness/max"] <= cfg.buffer.max_staleness for r in rows)


def test_tool_calls_that_time_out_become_observations(tmp_path):
    from trainer.run.system import run

    cfg = quickstart_config(tmp_path, "timeouts", "train.num_steps=1",
                            "agent.tool_timeout_s=0.001")
    summary, run_dir = asyncio.run(run(cfg, "timeouts"))
    assert summary.steps == 1
    _assert_accounted(summary)
    rows = _metric_rows(run_dir)
    assert sum(r["rollout/tool_timeouts"] for r in rows) > 0
    # malformed calls are errors before any tool runs; every call that ran timed out
    assert all(r["rollout/tool_timeouts"] <= r["rollout/tool_calls"] for r in rows)
    transcripts = [json.loads(line) for line in
                   (run_dir / "transcripts.jsonl").read_text().splitlines()]
    assert any("Timeout: python did not finish within 0.001 s." in t["response"]
               for t in transcripts)

