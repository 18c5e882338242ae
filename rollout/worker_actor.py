"""Thin Ray shell of the rollout side: one AgentLoopWorker per actor, placed in a bundle
of the sandbox pool beside its node's SandboxPoolActor, and `RayRollout`, the
controller's RolloutSide over those actors. All behaviour lives in rollout.worker.

Groups come back to the driver as pickled bytes, so the driver counts exactly what it
receives (`bytes_received`): scored trajectories, never workspaces.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from envs.types import Group, Task
from rollout.durable import DurableSetup
from rollout.engine import EngineStats
from rollout.router import Router
from rollout.worker import WorkerStats, build_agent_worker

# Every call of the engines' or workers' trajectories is in flight at once; the async actor
# queues none of them (set at creation: Ray's typed decorator takes no actor options).
MAX_CONCURRENCY = 100_000


@ray.remote
class AgentWorkerActor:
    def __init__(self, cfg: Any, model_path: str, engine_handles: dict[str, Any],
                 sandbox_handles: dict[str, Any] | None = None,
                 judge_handles: dict[str, Any] | None = None,
                 judge_model_path: str | None = None, durable: DurableSetup | None = None) -> None:
        from rollout.engine import quiet_vllm_cpu_notice
        from rollout.engine_actor import RayEngineClient

        quiet_vllm_cpu_notice()  # before the parsers import vLLM
        engines = {name: RayEngineClient(h) for name, h in engine_handles.items()}
        provider = None
        if sandbox_handles:
            from envs.pool_actor import RaySandboxProvider

            provider = RaySandboxProvider(sandbox_handles)
        judge = None
        if judge_handles:
            from rollout.judge_client import build_judge_client

            judge = build_judge_client(cfg, judge_model_path or "",
                                       {n: RayEngineClient(h) for n, h in judge_handles.items()})
        self.worker = build_agent_worker(cfg, model_path, engines, sandbox_provider=provider,
                                         judge=judge, durable=durable)
        self.node_id = ray.get_runtime_context().get_node_id()

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> bytes:
        group = await self.worker.run_group(task, group_id, group_size, deadline_s)
        return pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)

    async def close_gate(self) -> None:
        """Returns once no turn of this worker is generating."""
        await self.worker.gate.close()

    async def open_gate(self) -> None:
        self.worker.gate.open()

    async def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def node(self) -> str:
        return self.node_id


class RayRollout:
    """The controller's RolloutSide over AgentWorkerActor handles (driver side): a group
    goes to the worker with the fewest groups in flight; cancelling a group cancels it in
    its actor (its trajectories end and their sandboxes are released there)."""

    def __init__(self, workers: Sequence[Any], router: Router) -> None:
        if not workers:
            raise ValueError("no agent-loop workers; set rollout.num_agent_workers >= 1")
        self.workers = list(workers)
        self.router = router
        self._load = [0] * len(self.workers)
        self.bytes_received = 0  # pickled groups received by the driver, in all

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        i = min(range(len(self.workers)), key=self._load.__getitem__)
        self._load[i] += 1
        ref = self.workers[i].run_group.remote(task, group_id, group_size, deadline_s)
        try:
            blob = await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        finally:
            self._load[i] -= 1
        self.bytes_received += len(blob)
        return pickle.loads(blob)

    async def close_gates(self) -> None:
        await asyncio.gather(*(w.close_gate.remote() for w in self.workers))

    async def open_gates(self) -> None:
        await asyncio.gather(*(w.open_gate.remote() for w in self.workers))

    async def worker_stats(self) -> Sequence[WorkerStats]:
        return await asyncio.gather(*(w.stats.remote() for w in self.workers))

    async def engine_stats(self) -> Mapping[str, EngineStats]:
        return await self.router.engine_stats()


def start_agent_workers(cfg: Any, num_workers: int, model_path: str, engine_handles: dict[str, Any],
                        sandbox_handles: Mapping[str, Any], placement_group: Any | None,
                        judge_handles: dict[str, Any] | None = None,
                        judge_model_path: str | None = None,
                        durable: DurableSetup | None = None) -> list[Any]:
    """`num_workers` actors (rollout.num_agent_workers as the trainer resolved it, the
    auto count included); worker j lives in bundle j % S of the sandbox pool (S sandbox
    workers, one per bundle) and uses only that bundle's sandbox pool, so its sandboxes,
    their final workspaces and its grading stay on one node."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pools = list(sandbox_handles.items())
    if not pools or num_workers < 1 or num_workers % len(pools):
        raise ValueError(f"{num_workers} agent-loop workers cannot be spread evenly over "
                         f"{len(pools)} sandbox pools; rollout.num_agent_workers must be a "
                         "positive multiple of envs.num_sandbox_workers (or 0: auto)")
    workers = []
    for j in range(num_workers):
        name, handle = pools[j % len(pools)]
        options: dict[str, Any] = {"num_cpus": cfg.rollout.cpus_per_agent_worker,
                                   "max_concurrency": MAX_CONCURRENCY}
        if placement_group is not None:  # the bundle reserves the worker's CPUs
            options.update(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=j % len(pools)))
        # @ray.remote made the class an ActorClass; type checkers do not apply class decorators.
        workers.append(AgentWorkerActor.options(**options).remote(  # pyrefly: ignore[missing-attribute]
            cfg, model_path, engine_handles, {name: handle}, judge_handles, judge_model_path, durable))
    return workers
