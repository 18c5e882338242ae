"""Thin Ray shell: one AgentLoopWorker per actor (CPU). All behaviour lives in
rollout.worker; the controller calls run_group and closes/opens the turn gate."""

from __future__ import annotations

from typing import Any

import ray

from envs.types import Group, Task
from rollout.worker import WorkerStats, build_agent_worker


@ray.remote(max_concurrency=100_000)
class AgentWorkerActor:
    def __init__(self, cfg: Any, model_path: str, engine_handles: dict[str, Any],
                 sandbox_handles: dict[str, Any] | None = None) -> None:
        from rollout.engine_actor import RayEngineClient

        engines = {name: RayEngineClient(h) for name, h in engine_handles.items()}
        provider = None
        if sandbox_handles:
            from envs.pool_actor import RaySandboxProvider

            provider = RaySandboxProvider(sandbox_handles)
        self.worker = build_agent_worker(cfg, model_path, engines, sandbox_provider=provider)

    async def run_group(self, task: Task, group_id: str, group_size: int) -> Group:
        return await self.worker.run_group(task, group_id, group_size)

    async def close_gate(self) -> None:
        """Returns once no turn of this worker is generating."""
        await self.worker.gate.close()

    async def open_gate(self) -> None:
        self.worker.gate.open()

    async def stats(self) -> WorkerStats:
        return self.worker.stats()
