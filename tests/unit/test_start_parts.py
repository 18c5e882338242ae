"""trainer.run.system.start_parts with its Ray shells replaced: the train ranks, engines
and sandbox pools start side by side, and a part that fails to start leaves no mounted
sandbox behind (the started pools are closed before the error reaches the run)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from trainer.run import system
from trainer.run.recipe import load_config


def pool_handle(log: list[str]) -> SimpleNamespace:
    """A SandboxPoolActor handle: only `close.remote()` is called here."""

    async def close() -> None:
        log.append("pools closed")

    return SimpleNamespace(close=SimpleNamespace(remote=close))


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The order things happen in, with every Ray-touching step replaced."""
    import envs.pool_actor
    import rollout.engine_actor
    import trainer.run.pools
    import trainer.train.train_actor

    log: list[str] = []

    async def start_engines(spec, num, pg):
        log.append("engines starting")
        await asyncio.sleep(0.05)
        raise RuntimeError("engine core initialization failed")

    async def start_sandbox_pools(envs, pg, images=()):
        log.append("pools starting")
        await asyncio.sleep(0.1)  # still warming up when the engines fail
        log.append("pools started")
        return SimpleNamespace(handles={"sandbox-pool-0": pool_handle(log)})

    monkeypatch.setattr(trainer.run.pools, "connect_cluster", lambda cfg: None)
    monkeypatch.setattr(trainer.run.pools, "build_pools",
                        lambda cfg: {"rollout": None, "train": None, "sandbox": None})
    monkeypatch.setattr(trainer.train.train_actor, "TrainGroup",
                        lambda cfg, path, pg: log.append("train ranks started"))
    monkeypatch.setattr(rollout.engine_actor, "start_engines", start_engines)
    monkeypatch.setattr(envs.pool_actor, "start_sandbox_pools", start_sandbox_pools)
    return log


def test_a_part_that_fails_to_start_leaves_no_sandbox_mounted(parts: list[str]) -> None:
    cfg = load_config("quickstart.yaml", ["model.warm_start=null"])
    with pytest.raises(RuntimeError, match="engine core initialization failed"):
        asyncio.run(system.start_parts(cfg, "unused-model-path"))
    # The ranks start first; engines and pools start side by side; the pools that came up
    # after the engines failed are closed before the error is raised.
    assert parts == ["train ranks started", "engines starting", "pools starting",
                     "pools started", "pools closed"]


def test_a_local_ray_start_that_times_out_is_tried_again_and_its_processes_killed(monkeypatch):
    """Ray gives a new local node 30 s to register; a loaded machine can miss that. The
    failed attempt's processes are killed, the next attempt runs, and after the last a
    StartupError (exit 4) says what happened and what to do."""
    import subprocess
    import sys

    import ray

    from trainer.run.pools import StartupError, _descendants, _start_local_cluster

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    started: list[subprocess.Popen] = []

    def init(succeed_at: int) -> None:  # starts a "raylet", then fails as Ray's node does
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if len(started) < succeed_at:
            raise Exception("The current node timed out during startup.")

    try:
        assert _start_local_cluster(lambda: init(succeed_at=3)) is None  # the third attempt
        assert [p.wait(timeout=10) for p in started[:2]] == [-9, -9]  # failed attempts' processes
        assert started[2].poll() is None and started[2].pid in _descendants()
        started[2].kill()
        started.clear()
        with pytest.raises(StartupError, match=r"did not start \(3 attempts; the last: Exception: "
                                               r"The current node timed out.*cluster.address=auto"):
            _start_local_cluster(lambda: init(succeed_at=99))
        assert all(p.wait(timeout=10) == -9 for p in started)
    finally:
        for p in started:
            p.kill()
