"""The SandboxPool Ray shell with real Ray and real LocalSandboxes: sandbox tools work
through RaySandboxProvider exactly as they do in-process, errors and the final-workspace
capture included."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from envs.tools.sandbox_tools import build_sandbox_tool_settings
from envs.trajectory_env import EnvBuilder, load_tool_classes
from envs.types import Message, Task
from trainer.run.config import EnvsConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")
ENVS = EnvsConfig(num_sandbox_workers=2, cpus_per_sandbox_worker=0.5, sandboxes_per_worker=2,
                  num_warm_sandboxes=1, memory_limit_mb=256, exec_timeout_s=10.0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def provider() -> AsyncIterator:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    import ray

    from envs.pool_actor import start_sandbox_pools

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    provider = await start_sandbox_pools(ENVS)
    yield provider
    for handle in provider.handles.values():
        await handle.close.remote()
    ray.shutdown()


async def test_tools_work_through_the_actor(provider) -> None:
    task = Task("t", (Message("user", "hi"),), tools=("bash", "write_file", "read_file"))
    settings = build_sandbox_tool_settings(ENVS)
    envs = [EnvBuilder(load_tool_classes(), provider, settings).build(task) for _ in range(2)]
    await asyncio.gather(*(env.open() for env in envs))
    trajectories = [env.tools for env in envs]
    for i, tools in enumerate(trajectories):
        await tools["write_file"].execute({"path": "a.txt", "content": f"from {i}\n"})
        shown = await tools["bash"].execute({"command": "cat a.txt"})
        assert shown.text == f"exit code: 0\nstdout:\nfrom {i}\nstderr: (empty)"
        missing = await tools["read_file"].execute({"path": "missing.txt"})
        assert missing.is_error and missing.text == "Error: no file 'missing.txt' in the workspace"
    leases = [tools["bash"].session.lease for tools in trajectories]
    assert {lease.pool for lease in leases} == {"sandbox-pool-0", "sandbox-pool-1"}  # round-robin
    captured = await asyncio.gather(*(env.release() for env in envs))
    for i, workspace in enumerate(captured):  # captured in the actor before the release
        assert workspace.written == {"a.txt": f"from {i}\n".encode()}
    for handle in provider.handles.values():
        stats = await handle.stats.remote()
        assert (stats.num_in_use, stats.num_acquires, stats.num_warm_hits) == (0, 1, 1)
