"""Thin Ray shell: one SandboxPool per sandbox-worker actor, and the SandboxProvider that
agent-loop workers use to reach those actors. All behaviour lives in envs.pool."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions

from envs.pool import PoolStats, SandboxLease, build_sandbox_pool
from envs.sandbox.base import ExecResult, SandboxSpec
from envs.sandbox.images import ImagePrewarm, prewarm_images
from envs.types import WorkspaceChanges
from envs.config import EnvsConfig

if TYPE_CHECKING:
    from ray.actor import ActorMethod
    from ray.util.placement_group import PlacementGroup

# Every sandbox call of the node's trajectories is in flight at once; the async actor queues
# none of them (set at creation: Ray's typed decorator takes no actor options).
MAX_CONCURRENCY = 100_000


@ray.remote
class SandboxPoolActor:
    def __init__(self, envs: EnvsConfig, name: str) -> None:
        self.pool = build_sandbox_pool(envs, name=name)
        self.backend = envs.sandbox_backend
        self.images = ImagePrewarm()

    async def start(self, images: Sequence[str] = ()) -> None:
        """Reap what dead runs left on this node (the driver reaps only its own machine),
        make every task image present here (container backend; ValueError naming the
        missing ones), then warm the pool."""
        from envs.reaper import reap_stale_state

        await asyncio.to_thread(reap_stale_state)
        if images and self.backend == "container":
            self.images = await asyncio.to_thread(prewarm_images, list(images))
        await self.pool.start()

    async def acquire(self, spec: SandboxSpec) -> SandboxLease:
        return await self.pool.acquire(spec)

    async def release(self, lease: SandboxLease) -> None:
        await self.pool.release(lease)

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        return await self.pool.exec(lease, cmd, timeout_s, stdin)

    async def read_file(self, lease: SandboxLease, path: str) -> bytes:
        return await self.pool.read_file(lease, path)

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None:
        await self.pool.write_file(lease, path, data)

    async def checkpoint(self, lease: SandboxLease) -> None:
        await self.pool.checkpoint(lease)

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        return await self.pool.workspace_changes(lease, max_bytes)

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        return await self.pool.save_state(lease, path)

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        await self.pool.restore_state(lease, path)

    async def stats(self) -> PoolStats:
        return dataclasses.replace(self.pool.stats(), num_images_ready=self.images.num_ready,
                                   num_images_loaded=self.images.num_loaded,
                                   num_images_pulled=self.images.num_pulled)

    async def close(self) -> None:
        await self.pool.close()


class RaySandboxProvider:
    """SandboxProvider over one or more SandboxPoolActor handles: acquires go round-robin,
    every later call goes to the actor that owns the lease. Errors raised in the actor
    come back as the original exception, so tools show the model its message and not a
    Ray traceback. Cancelling a call here does not cancel it in the actor."""

    def __init__(self, handles: dict[str, "ray.actor.ActorHandle"]) -> None:
        if not handles:
            raise ValueError("RaySandboxProvider needs at least one SandboxPoolActor; "
                             "set envs.num_sandbox_workers >= 1")
        self.handles = dict(handles)
        self._next = itertools.cycle(list(self.handles.values()))

    async def acquire(self, spec: SandboxSpec) -> SandboxLease:
        return await _call(next(self._next).acquire, spec)

    async def release(self, lease: SandboxLease) -> None:
        await _call(self.handles[lease.pool].release, lease)

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        return await _call(self.handles[lease.pool].exec, lease, cmd, timeout_s, stdin)

    async def read_file(self, lease: SandboxLease, path: str) -> bytes:
        return await _call(self.handles[lease.pool].read_file, lease, path)

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None:
        await _call(self.handles[lease.pool].write_file, lease, path, data)

    async def checkpoint(self, lease: SandboxLease) -> None:
        await _call(self.handles[lease.pool].checkpoint, lease)

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        return await _call(self.handles[lease.pool].workspace_changes, lease, max_bytes)

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        # The path is on the pool actor's node, which is the worker's (placed beside it).
        return await _call(self.handles[lease.pool].save_state, lease, path)

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        await _call(self.handles[lease.pool].restore_state, lease, path)

    async def stats(self) -> list[PoolStats]:
        """Every pool actor's statistics (one entry per actor)."""
        return list(await asyncio.gather(*(_call(h.stats) for h in self.handles.values())))


async def _call(method: ActorMethod, *args: object) -> Any:  # Any: Ray types no actor method's result
    try:
        return await method.remote(*args)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise


async def start_sandbox_pools(envs: EnvsConfig, placement_group: PlacementGroup | None = None,
                              images: Sequence[str] = (), **actor_options: object,
                              ) -> RaySandboxProvider:
    """Start `envs.num_sandbox_workers` pool actors (bundle i of the sandbox pool each, when
    given), make the task `images` present on each one's node (prewarm), wait for their
    warm sandboxes, and return the provider over them."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    handles = {}
    for i in range(envs.num_sandbox_workers):
        name = f"sandbox-pool-{i}"
        options: dict[str, object] = {"num_cpus": envs.cpus_per_sandbox_worker,
                                   "max_concurrency": MAX_CONCURRENCY, **actor_options}
        if placement_group is not None:  # the bundle reserves CPUs and the sandbox resource
            options.update(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=i))
        # @ray.remote made the class an ActorClass; type checkers do not apply class decorators.
        handles[name] = SandboxPoolActor.options(**options).remote(envs, name)  # pyrefly: ignore[missing-attribute]
    try:
        await asyncio.gather(*(h.start.remote(list(images)) for h in handles.values()))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):  # the missing images, named
            raise exc.cause from None
        raise
    return RaySandboxProvider(handles)
