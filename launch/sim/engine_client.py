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
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from launch.sim.engine_model import BlockEvent, EngineModel, SimRequest
from rollout.engine import EngineStats, FinishReason, Sampling, TokenOutput
from rollout.kv_residency import KvEventLog, KvResidencyDelta, block_keys

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
        return content_ids(request.request_id, max(1, request.new_tokens // self.token_unit)), "stop"


def content_ids(source: str, count: int) -> np.ndarray:
    """`count` ids that stand for text of `source` alone (a task's prompt, a turn's output
    or observation): two trajectories' contexts share block keys exactly as far as their
    text is the same, which is what a residency router reads."""
    return ((zlib.crc32(source.encode()) + 7919 * np.arange(count, dtype=np.int64))
            % (1 << 30) + 4).astype(np.int32)


class SimKvEvents:
    """The KV events of one simulated engine, in the key space a router computes from the
    prompt ids (`rollout.kv_residency.block_keys`), as vLLM's `kv_events_config` publishes
    them: the engine model's block events (an entry cached, cut by eviction, all cleared)
    become the keys of the blocks stored and removed.

    A key block is `ids_per_block` ids (one id stands for `token_unit` tokens; at least one
    id, so with token_unit above the model's block size a key covers several model blocks,
    and a model block count maps to the keys it covers whole). A task entry's blocks are the
    first of its shared prompt; a trajectory entry's are the blocks after that prompt of the
    content last sent for it. Entries share keys (siblings their task prompt's): a key is
    stored when its first entry gets it and removed when its last loses it. Events of an
    older salt are dropped: a router's view forgets that salt's blocks when the salt changes.
    An entry in the pool and in the tier holds the longer of its two prefixes: the engine
    serves both, and vLLM publishes both, each under its medium.
    """

    def __init__(self, block_tokens: int, token_unit: int, max_batches: int = 4096) -> None:
        self.ids_per_block = max(1, block_tokens // token_unit)
        self._block_tokens = block_tokens
        self._key_tokens = self.ids_per_block * token_unit
        self._salt = 0
        # session -> (salt, content ids, their keys, tokens of the shared prompt);
        # task -> keys of its shared prompt
        self._sessions: dict[str, tuple[int, np.ndarray, list[int], int]] = {}
        self._tasks: dict[str, list[int]] = {}
        self._held: dict[tuple[str, str, int], int] = {}  # entry -> keys published
        self._media: dict[tuple[str, str, int], dict[str, int]] = {}  # entry -> medium -> blocks
        # key -> entries holding it: siblings hold their shared prompt's keys, and a key is
        # removed only when the last of them loses it (vLLM shares one block among them)
        self._refs: dict[int, int] = {}
        self._pending: dict[str, int] = {}  # session -> requests sent, not finished
        self._log = KvEventLog(max_batches)  # the real engines' log, fed keys directly
        self._log.block_size = self.ids_per_block

    @property
    def salt(self) -> str:
        return f"sim-v{self._salt}"

    def new_salt(self) -> None:
        self._salt += 1
        self._refs.clear()  # the older salt's keys: forgotten by every view at the change
        self._held.clear()
        self._media.clear()

    def sent(self, request: SimRequest, prompt_ids: np.ndarray | list[int], output_ids: np.ndarray) -> None:
        """Remember what a request's session (and task) will hold once it finishes: its
        prompt and output (known when it is sent: the script makes the output)."""
        self._pending[request.session] = self._pending.get(request.session, 0) + 1
        ids = np.concatenate([np.asarray(prompt_ids, np.int64), output_ids.astype(np.int64)])
        known: list[int] = []
        last = self._sessions.get(request.session)
        if last is not None and last[0] == self._salt and len(last[1]) <= len(ids) \
                and np.array_equal(last[1], ids[:len(last[1])]):
            known = last[2]
        keys = block_keys(ids, self.ids_per_block, self.salt, known)
        shared = 0
        if request.shared_key:  # the model's shared head: whole blocks of the task prompt
            bt = self._block_tokens
            shared = min(request.shared_tokens, request.context_tokens) // bt * bt
            self._tasks.setdefault(request.shared_key, keys[:shared // self._key_tokens])
        self._sessions[request.session] = (self._salt, ids, keys, shared)

    def finished(self, request: SimRequest) -> None:
        left = self._pending.pop(request.session) - 1
        if left:
            self._pending[request.session] = left

    def publish(self, events: list[BlockEvent]) -> None:
        """One batch of the model's block events."""
        stored: list[int] = []
        removed: list[int] = []
        cleared = False
        for event in events:
            if event.key is None and all(set(m) <= {event.medium} for m in self._media.values()):
                cleared, stored, removed = True, [], []
                self._held.clear()
                self._refs.clear()
                self._media.clear()
            elif event.key is None:  # another medium keeps some entries: one by one
                for entry in list(self._media):
                    self._publish_entry(entry, event.medium, 0, stored, removed)
            else:
                self._publish_entry(event.key, event.medium, event.blocks, stored, removed)
        if stored or removed or cleared:
            self._log.add_keys(stored, removed, cleared)

    def _publish_entry(self, entry: tuple[str, str, int], medium: str, blocks: int,
                       stored: list[int], removed: list[int]) -> None:
        """The entry holds its first `blocks` model blocks in `medium` now: add the keys
        that stores or removes to the batch's lists."""
        media = self._media.setdefault(entry, {})
        if blocks:
            media[medium] = blocks
        else:
            media.pop(medium, None)
        if not media:
            del self._media[entry]
        kind, name, salt = entry
        keys = self._entry_keys(kind, name, max(media.values(), default=0)) if salt == self._salt else None
        if keys is None:
            return
        before = self._held.get(entry, 0)
        # The entry's keys, in order; it grows or loses its tail.
        held_now = len(keys[1])
        for key in keys[1][before:]:
            self._refs[key] = self._refs.get(key, 0) + 1
            if self._refs[key] == 1:
                stored.append(key)
        for key in keys[0][held_now:before]:
            left = self._refs.pop(key, 1) - 1
            if left:
                self._refs[key] = left
            else:
                removed.append(key)
        if held_now:
            self._held[entry] = held_now
        else:
            self._held.pop(entry, None)
        if held_now == 0 and kind == "traj" and name not in self._pending:
            self._sessions.pop(name, None)  # gone from the cache, and nothing on the way

    def _entry_keys(self, kind: str, name: str, blocks: int) -> tuple[list[int], list[int]] | None:
        """(all the entry's keys, those its first `blocks` model blocks cover whole)."""
        if kind == "task":
            keys, start = self._tasks.get(name, []), 0
        else:
            session = self._sessions.get(name)
            if session is None or session[0] != self._salt:
                return None
            start = session[3]
            keys = session[2][start // self._key_tokens:]
        end = (start + blocks * self._block_tokens) // self._key_tokens - start // self._key_tokens
        return keys, keys[:max(0, end)]

    def since(self, seq: int) -> KvResidencyDelta:
        return self._log.since(seq, self.salt)


class SimEngine:
    """An `EngineClient` whose generate calls are timed by an `EngineModel`."""

    def __init__(self, model: EngineModel, world: EngineScript,
                 kv_after_push: str = "recompute", kv_events: bool = False) -> None:
        """`kv_events`: publish KV events (`kv_residency`) for a residency router; the
        model must then record its block events (`EngineModel(record_blocks=True)`)."""
        self.model = model
        self.kv_events = SimKvEvents(model.spec.block_tokens, world.token_unit) if kv_events else None
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
        if self.kv_events is not None:
            self.kv_events.sent(request, prompt_ids, ids)
        try:
            self.model.submit(loop.time(), request)
            self._publish()
            self._ensure_driver().set()
            cached = await future
        finally:
            if self.kv_events is not None:
                self.kv_events.finished(request)
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
                self._publish()
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

    def _publish(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.model.take_block_events())

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
            self._publish()  # the old salt's events first: they are dropped after the change
            self.model.new_salt()
            if self.kv_events is not None:
                self.kv_events.new_salt()

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        raise NotImplementedError("simulated pushes go through update_weights")

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        raise NotImplementedError("simulated pushes go through update_weights")

    async def reset_prefix_cache(self) -> None:
        if not self.model.reset_prefix_cache():
            self.num_failed_resets += 1
        self._publish()

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
        """The KV events after `since` (`kv_events`); without them none, and no block size:
        a residency router then routes as the sticky one."""
        if self.kv_events is None:
            return KvResidencyDelta(seq=since, block_size=0, salt=None, stored=(), removed=(),
                                    cleared=False, lost=False)
        self._publish()
        return self.kv_events.since(since)
