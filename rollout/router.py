"""Sticky, load-aware routing of generate calls over the rollout engines.

A trajectory's first turn goes to the least-loaded engine; later turns stick to the same
engine so its prefix cache holds the shared context. Load is what the engines report
themselves (running + waiting requests, polled every `load_poll_s` and shared by every
router, so one agent-loop worker sees the load the other workers put there), plus what
this router sent since the last poll, and never less than this router's own requests in
flight. A session whose engine runs `max_imbalance` requests more than the least-loaded
one moves (its prefix cache is lost, counted as a rebalance): stickiness is bounded.
Sessions are kept in a bounded LRU and released when the trajectory ends. An engine that
fails or does not answer in time is removed and its trajectories continue on another
engine (their prefix cache is lost, which is counted); nothing is dropped silently.
Control calls (pause, resume, weight updates) fan out to all engines at once."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from rollout.engine import EngineStats, Sampling, TokenOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

# Exception class names that mean "this engine is gone", matched by name so the router
# needs neither ray nor vllm: Ray's actor errors and vLLM's dead-engine error.
ENGINE_FAILURE_NAMES = ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                        "EngineDeadError", "EngineGenerateError")


class EngineClient(Protocol):
    """What the router needs from an engine: the in-process VLLMEngine or a Ray handle."""

    async def generate(self, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling) -> TokenOutput: ...
    async def abort(self, request_ids: list[str]) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights(self, version: int, blob: bytes | None = None,
                             path: str | None = None) -> None: ...
    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]: ...
    async def receive_weights(self, version: int, wire: list[dict]) -> None: ...
    async def reset_prefix_cache(self) -> None: ...
    async def checksum(self, names: list[str]) -> str: ...
    async def get_stats(self) -> EngineStats: ...


class NoEngineError(RuntimeError):
    """Every engine has failed; generation cannot continue."""


def is_engine_failure(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    return any(cls.__name__ in ENGINE_FAILURE_NAMES for cls in type(exc).__mro__)


@dataclass(frozen=True, slots=True)
class RoutedOutput:
    output: TokenOutput
    engine: str  # name of the engine that produced it
    rerouted: bool  # the session moved to another engine for this call (prefix cache lost)


@dataclass(frozen=True, slots=True)
class RouterStats:
    engines: tuple[str, ...]
    in_flight: tuple[int, ...]  # per engine, same order
    num_sessions: int
    num_reroutes: int  # session moves after an engine failure
    num_evicted_sessions: int  # sessions forgotten by the LRU bound
    failed_engines: tuple[str, ...]
    num_rebalanced: int = 0  # sessions moved off an engine over the imbalance bound


class Router:
    def __init__(self, engines: Mapping[str, EngineClient], max_sessions: int = 100_000,
                 request_timeout_s: float | None = None,
                 is_failure: Callable[[BaseException], bool] = is_engine_failure,
                 load_poll_s: float = 0.0, max_imbalance: int | None = None) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine (rollout.num_engines >= 1)")
        self._engines = dict(engines)
        self._in_flight = {name: 0 for name in engines}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions
        self._timeout_s = request_timeout_s
        self._is_failure = is_failure
        self._failed: list[str] = []
        self._num_reroutes = 0
        self._num_evicted = 0
        self._num_rebalanced = 0
        self._load_poll_s = load_poll_s  # 0: route on this router's own counts only
        self._max_imbalance = max_imbalance
        self._reported: dict[str, int] = {}  # engine -> running + waiting at the last poll
        self._sent_since_poll = {name: 0 for name in engines}
        self._poller: asyncio.Task | None = None
        self._rng = np.random.default_rng(id(self) % (1 << 32))

    @property
    def engines(self) -> dict[str, EngineClient]:
        """The live engines by name."""
        return dict(self._engines)

    @property
    def engine_names(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def load(self, name: str) -> int:
        """The engine's requests as best known: its own report plus what was sent since,
        never less than this router's requests in flight there."""
        return max(self._in_flight[name], self._reported.get(name, 0) + self._sent_since_poll[name])

    def _pick(self, session_id: str) -> tuple[str, bool]:
        """(engine, moved): the session's engine, or the least-loaded one for a new
        session, one whose engine failed or one over the imbalance bound (moved=True:
        its prefix cache is lost)."""
        name = self._sessions.get(session_id)
        if not self._engines:
            raise NoEngineError(f"all engines failed: {', '.join(self._failed)}")
        if name is not None and name in self._engines:
            if self._max_imbalance is None or self.load(name) - min(
                    self.load(n) for n in self._engines) <= self._max_imbalance:
                self._sessions.move_to_end(session_id)
                return name, False
            self._num_rebalanced += 1
        failed_over = name is not None and name not in self._engines
        moved = name is not None
        name = self._least_loaded()
        self._sessions[session_id] = name
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
            self._num_evicted += 1
        if failed_over:
            self._num_reroutes += 1
        return name, moved

    def _least_loaded(self) -> str:
        """With the engines' shared load: the less loaded of two engines drawn at random
        (every router reads the same stale report between polls; taking the global
        minimum would send them all to one engine at once). Without it: the minimum of
        this router's own counts."""
        names = list(self._engines)
        if not self._reported or len(names) < 3:
            return min(names, key=self.load)
        i, j = self._rng.choice(len(names), size=2, replace=False)
        return min((names[i], names[j]), key=lambda n: (self.load(n), self._in_flight[n]))

    async def generate(self, session_id: str, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling) -> RoutedOutput:
        """Generate on the session's engine; on engine failure retry on another engine."""
        if self._load_poll_s > 0 and self._poller is None:
            self._poller = asyncio.create_task(self._poll_load())
        rerouted = False
        attempt = 0
        while True:
            name, moved = self._pick(session_id)
            rerouted = rerouted or moved
            self._in_flight[name] += 1
            self._sent_since_poll[name] += 1
            try:
                call = self._engines[name].generate(f"{request_id}.{attempt}", prompt_ids, sampling)
                out = await (asyncio.wait_for(call, self._timeout_s) if self._timeout_s else call)
                return RoutedOutput(out, name, rerouted)
            except BaseException as exc:  # `is_failure` judges any error; cancellation goes on
                if isinstance(exc, asyncio.CancelledError) or not self._is_failure(exc):
                    raise
                self._remove(name, exc)
                attempt += 1
            finally:
                self._in_flight[name] -= 1

    async def refresh_load(self) -> None:
        """Take the engines' own load (running + waiting requests) as the new baseline."""
        stats = await self.engine_stats()
        for name, s in stats.items():
            self._reported[name] = s.num_running + s.num_waiting
            self._sent_since_poll[name] = 0

    async def _poll_load(self) -> None:
        while self._engines:
            try:
                await self.refresh_load()
            except Exception as exc:  # a failed poll leaves the last view in place
                log.debug("engine load poll failed: %s", exc)
            await asyncio.sleep(self._load_poll_s)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def remove(self, name: str, cause: BaseException) -> None:
        """Stop routing to an engine found failed elsewhere (a weight push); its sessions
        move on their next call."""
        self._remove(name, cause)

    def _remove(self, name: str, exc: BaseException) -> None:
        """Stop routing to a failed engine; its sessions move on their next call."""
        if name not in self._engines:
            return  # another coroutine removed it first
        log.error("engine %s failed (%s: %s); its sessions move to other engines",
                  name, type(exc).__name__, exc)
        del self._engines[name]
        self._failed.append(name)

    def release(self, session_id: str) -> None:
        """Forget a finished trajectory's session."""
        self._sessions.pop(session_id, None)

    async def _fan_out(self, call: Callable[[EngineClient], Awaitable[T]]) -> dict[str, T]:
        """Run `call` on every live engine concurrently; failed engines are removed."""
        names = list(self._engines)
        results = await asyncio.gather(*(call(self._engines[n]) for n in names),
                                       return_exceptions=True)
        out: dict[str, T] = {}
        for name, result in zip(names, results):
            if isinstance(result, BaseException):
                if not self._is_failure(result):
                    raise result
                self._remove(name, result)
            else:
                out[name] = result
        if not self._engines:
            raise NoEngineError(f"all engines failed: {', '.join(self._failed)}")
        return out

    async def update_weights_all(self, version: int, blob: bytes | None = None,
                                 path: str | None = None) -> None:
        await self._fan_out(lambda e: e.update_weights(version, blob=blob, path=path))

    async def checksum_all(self, names: list[str]) -> dict[str, str]:
        return await self._fan_out(lambda e: e.checksum(names))

    async def engine_stats(self) -> dict[str, EngineStats]:
        return await self._fan_out(lambda e: e.get_stats())

    def stats(self) -> RouterStats:
        names = tuple(self._engines)
        return RouterStats(names, tuple(self._in_flight[n] for n in names), len(self._sessions),
                           self._num_reroutes, self._num_evicted, tuple(self._failed),
                           self._num_rebalanced)
