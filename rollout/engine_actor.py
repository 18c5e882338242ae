"""Thin Ray shell: one VLLMEngine per actor, placed in a rollout-pool bundle, and the
EngineClient the router uses to call it. All behaviour lives in rollout.engine."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from envs.types import TrajectoryImage
from rollout.engine import EngineSpec, EngineStats, Sampling, TokenOutput, VLLMEngine
from rollout.kv_residency import KvResidencyDelta

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

# Every call of the engines' or workers' trajectories is in flight at once; the async actor
# queues none of them (set at creation: Ray's typed decorator takes no actor options).
MAX_CONCURRENCY = 100_000


@ray.remote
class EngineActor:
    def __init__(self, spec: EngineSpec) -> None:
        self.engine = VLLMEngine(spec)

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, request_id: str, prompt_ids: np.ndarray, sampling: Sampling,
                       images: tuple[TrajectoryImage, ...] = ()) -> TokenOutput:
        return await self.engine.generate(request_id, prompt_ids, sampling, images)

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, version: int, blob: bytes | None = None, path: str | None = None) -> None:
        await self.engine.update_weights(version, blob=blob, path=path)

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        return await self.engine.init_weight_group(host, port, rank_offset, world_size, backend, timeout_s)

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        await self.engine.receive_weights(version, wire)

    async def checksum(self, names: list[str]) -> str:
        return await self.engine.checksum(names)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def get_stats(self) -> EngineStats:
        return self.engine.stats()

    async def kv_residency(self, since: int) -> KvResidencyDelta:
        return await self.engine.kv_residency(since)


class RayEngineClient:
    """EngineClient over an EngineActor handle."""

    def __init__(self, handle: "ray.actor.ActorHandle") -> None:
        self.handle = handle

    async def generate(self, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling, images: tuple[TrajectoryImage, ...] = ()) -> TokenOutput:
        """Cancelling this call cancels the actor's task too, whose cancellation aborts the
        request in vLLM. Cancelling only the wait here would leave the request running:
        its tokens wasted, its KV blocks held through the next push (a refused prefix
        reset), and the caller's retry of the turn racing it."""
        ref = self.handle.generate.remote(request_id, np.asarray(prompt_ids, np.int32), sampling, images)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    async def abort(self, request_ids: list[str]) -> None:
        await self.handle.abort.remote(request_ids)

    async def pause(self) -> None:
        await self.handle.pause.remote()

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def update_weights(self, version: int, blob: bytes | None = None, path: str | None = None) -> None:
        await self.handle.update_weights.remote(version, blob, path)

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        return await self.handle.init_weight_group.remote(host, port, rank_offset, world_size,
                                                          backend, timeout_s)

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        await self.handle.receive_weights.remote(version, wire)

    async def reset_prefix_cache(self) -> None:
        await self.handle.reset_prefix_cache.remote()

    async def checksum(self, names: list[str]) -> str:
        return await self.handle.checksum.remote(names)

    async def get_stats(self) -> EngineStats:
        return await self.handle.get_stats.remote()

    async def kv_residency(self, since: int) -> KvResidencyDelta:
        return await self.handle.kv_residency.remote(since)


async def start_engines(spec: EngineSpec, num_engines: int,
                        placement_group: PlacementGroup | None = None) -> dict[str, RayEngineClient]:
    """Start `num_engines` actors (bundle i of the rollout pool each) and wait until ready."""
    handles = {}
    for i in range(num_engines):
        options: dict[str, object] = {"num_cpus": 0,  # the bundle reserves the resources
                                      "max_concurrency": MAX_CONCURRENCY}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=i)
            options["num_gpus"] = placement_group.bundle_specs[i].get("GPU", 0)
        # @ray.remote made the class an ActorClass; type checkers do not apply class decorators.
        handles[f"engine-{i}"] = EngineActor.options(name=None, **options).remote(spec)  # pyrefly: ignore[missing-attribute]
    await _gather_refs([h.start.remote() for h in handles.values()])
    return {name: RayEngineClient(h) for name, h in handles.items()}


async def _gather_refs(refs: list) -> None:
    for ref in refs:
        await ref
