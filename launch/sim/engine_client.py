"""The engine model behind the router's `EngineClient` interface, on the running event
loop's clock: under a virtual clock (looptime) a generate call takes the model's time and
no real time. One driver task per engine advances the model to each of its events.

What a call is and what it returns come from an `EngineScript`. `SimWorld` serves the
simulator's own trajectories (launch.sim.sides): they register each call's real sizes, and
the ids sent to the engine stand for `token_unit` tokens each, so 40K-token trajectories
stay small in memory while the engine model, the KV pool and the trainer see the real
token counts. `launch.sim.agent_side.ScriptedChat` serves the real agent loop: real ids,
and outputs that parse as the recipe's tool calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from launch.sim.engine_model import EngineModel, SimRequest
from rollout.engine import EngineStats, FinishReason, Sampling, TokenOutput
from rollout.kv_residency import KvResidencyDelta

BEHAVIOUR_LOGPROB = -0.7  # any finite value <= 0: the simulated policy's tokens
CLOCK_RESOLUTION_S = 1e-6


class EngineScript(Protocol):
    """What a simulated engine needs to know about a call beyond the model's timing."""

    token_unit: int  # real tokens per id of the calls

    def describe(self, request_id: str, prompt_ids: np.ndarray | list[int],
                 sampling: Sampling) -> SimRequest:
        """The call's real sizes (its `request_id` is the agent loop's, without the
        router's attempt suffix)."""
        ...

    def output(self, request: SimRequest, prompt_ids: np.ndarray | list[int],
               sampling: Sampling) -> tuple[np.ndarray, FinishReason]:
        """The ids the call returns, and why it stopped."""
        ...


@dataclass(slots=True)
class SimWorld:
    """What the simulated agent loop tells the engines about each call: its real sizes."""

    token_unit: int
    requests: dict[str, SimRequest] = field(default_factory=dict)

    def register(self, request: SimRequest) -> None:
        self.requests[request.request_id] = request

    def describe(self, request_id: str, prompt_ids: np.ndarray | list[int],
                 sampling: Sampling) -> SimRequest:
        return self.requests.pop(request_id)

    def output(self, request: SimRequest, prompt_ids: np.ndarray | list[int],
               sampling: Sampling) -> tuple[np.ndarray, FinishReason]:
        return np.ones(max(1, request.new_tokens // self.token_unit), np.int32), "stop"


class SimEngine:
    """An `EngineClient` whose generate calls are timed by an `EngineModel`."""

    def __init__(self, model: EngineModel, world: EngineScript,
                 kv_after_push: str = "recompute") -> None:
        self.model = model
        self.world = world
        self.kv_after_push = kv_after_push  # rollout.kv_after_push
        self.version = 0
        self.paused = False
        self.num_failed_resets = 0  # prefix-cache resets refused (requests held blocks)
        self._futures: dict[str, asyncio.Future[int]] = {}
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None

    async def generate(self, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling) -> TokenOutput:
        loop = asyncio.get_running_loop()
        # The router appends ".<attempt>" to the agent loop's request id.
        request = self.world.describe(request_id.rsplit(".", 1)[0], prompt_ids, sampling)
        ids, finish = self.world.output(request, prompt_ids, sampling)
        future: asyncio.Future[int] = loop.create_future()
        self._futures[request.request_id] = future
        self.model.submit(loop.time(), request)
        self._ensure_driver().set()
        cached = await future
        unit = self.world.token_unit
        return TokenOutput(token_ids=ids, logprobs=np.full(len(ids), BEHAVIOUR_LOGPROB, np.float32),
                           versions=np.full(len(ids), self.version, np.int32), finish_reason=finish,
                           num_prompt_tokens=len(prompt_ids), cached_prompt_tokens=cached // unit)

    def _ensure_driver(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return self._wake

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            now = loop.time()
            while True:
                for done in self.model.advance(now):
                    future = self._futures.pop(done.request_id)
                    if not future.done():
                        future.set_result(done.cached_tokens)
                at = self.model.next_event_s()
                # The loop's clock is rounded (looptime: 1 us): an event due within that
                # is processed now, else its timer would fire at once, forever.
                if at is None or at > now + CLOCK_RESOLUTION_S:
                    break
                now = at
            self._wake.clear()
            timer = loop.call_at(at, self._wake.set) if at is not None else None
            await self._wake.wait()
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()

    async def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError("the engine model does not abort requests; the simulator "
                                  "pushes weights only at turn boundaries")

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def update_weights(self, version: int, blob: bytes | None = None,
                             path: str | None = None) -> None:
        """Adopt `version`; under recompute, requests from now on carry a new cache salt
        (no older block is hit again, in the pool or the tier), as the real engines do;
        under reuse the cached KV keeps serving."""
        self.version = version
        if self.kv_after_push == "recompute":
            self.model.new_salt()

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        raise NotImplementedError("simulated pushes go through update_weights")

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        raise NotImplementedError("simulated pushes go through update_weights")

    async def reset_prefix_cache(self) -> None:
        if not self.model.reset_prefix_cache():
            self.num_failed_resets += 1

    async def checksum(self, names: list[str]) -> str:
        return f"v{self.version}"

    async def get_stats(self) -> EngineStats:
        s = self.model.stats()
        return EngineStats(version=self.version, num_in_flight=len(self._futures),
                           num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_cache_usage=s.kv_used_blocks / s.kv_total_blocks,
                           prefix_cache_queries=s.prefix_cache_queries,
                           prefix_cache_hits=s.prefix_cache_hits, paused=self.paused,
                           prefix_reset_refused=self.num_failed_resets)

    async def kv_residency(self, since: int) -> KvResidencyDelta:
        """No KV events: the engine model does not publish blocks, so a residency router
        over simulated engines routes as the sticky one (not modelled yet)."""
        return KvResidencyDelta(seq=since, block_size=0, salt=None, stored=(), removed=(),
                                cleared=False, lost=False)
