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
Control calls (pause, resume, weight updates) fan out to all engines at once.

With a residency view (rollout.routing=residency, rollout.kv_residency) each turn goes to
the engine that holds most of its prompt, less `load_penalty_tokens` per request of load
above the least loaded engine: a trajectory follows its KV, and a group's samples follow
their shared prompt (the view takes the blocks of a prompt as held as soon as it is sent).
Where no engine holds a block of the prompt, the sticky rule above decides."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from envs.types import TrajectoryImage
from rollout.engine import EngineStats, Sampling, TokenOutput
from rollout.kv_residency import KvResidencyDelta, ResidencyView, block_keys

log = logging.getLogger(__name__)
T = TypeVar("T")

# Exception class names that mean "this engine is gone", matched by name so the router
# needs neither ray nor vllm: Ray's actor errors and vLLM's dead-engine error.
ENGINE_FAILURE_NAMES = ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                        "EngineDeadError", "EngineGenerateError")


class EngineClient(Protocol):
    """What the router needs from an engine: the in-process VLLMEngine or a Ray handle."""

    async def generate(self, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling) -> TokenOutput:
        """Token-in generation. A client that serves a vision-language model also takes
        `images=` (the context's TrajectoryImage runs, rollout.vision); text requests never
        pass it, so a client of text models needs only these three arguments."""
        ...
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
    async def kv_residency(self, since: int) -> KvResidencyDelta: ...


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
    # With a residency view: calls routed, prompt tokens the view said the chosen engine
    # held, sessions moved to an engine holding more of their prompt, event gaps seen.
    num_routed: int = 0
    view_held_tokens: int = 0
    num_residency_moves: int = 0
    num_kv_events_lost: int = 0


class Router:
    def __init__(self, engines: Mapping[str, EngineClient], max_sessions: int = 100_000,
                 request_timeout_s: float | None = None,
                 is_failure: Callable[[BaseException], bool] = is_engine_failure,
                 load_poll_s: float = 0.0, max_imbalance: int | None = None,
                 residency: ResidencyView | None = None, load_penalty_tokens: int = 256) -> None:
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
        self._view = residency
        self._penalty = load_penalty_tokens
        # session -> (block size, salt, prompt ids the keys cover, keys): a turn's prompt
        # extends the last one, so only its new blocks are hashed
        self._keys: dict[str, tuple[int, str | None, np.ndarray, list[int]]] = {}
        self._num_routed = 0
        self._view_held_tokens = 0
        self._num_residency_moves = 0

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

    def _pick(self, session_id: str, prompt_ids: np.ndarray | None = None) -> tuple[str, bool]:
        """(engine, moved): with a residency view, the engine holding most of the prompt
        (less the load penalty); otherwise, or where no engine holds a block of it, the
        session's engine, or the least-loaded one for a new session, one whose engine
        failed or one over the imbalance bound (moved=True: its prefix cache is lost)."""
        if not self._engines:
            raise NoEngineError(f"all engines failed: {', '.join(self._failed)}")
        if self._view is not None and prompt_ids is not None:
            resident = self._pick_resident(session_id, prompt_ids)
            if resident is not None:
                return resident, False
        name = self._sessions.get(session_id)
        if name is not None and name in self._engines:
            if self._max_imbalance is None or self.load(name) - min(
                    self.load(n) for n in self._engines) <= self._max_imbalance:
                self._sessions.move_to_end(session_id)
                return name, False
            self._num_rebalanced += 1
        failed_over = name is not None and name not in self._engines
        moved = name is not None
        name = self._least_loaded()
        self._assign(session_id, name)
        if failed_over:
            self._num_reroutes += 1
        return name, moved

    def _assign(self, session_id: str, name: str) -> None:
        """The session's engine is `name` now; past `max_sessions` the least recent
        session is forgotten."""
        self._sessions[session_id] = name
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self._max_sessions:
            evicted, _ = self._sessions.popitem(last=False)
            self._keys.pop(evicted, None)
            self._num_evicted += 1

    def _pick_resident(self, session_id: str, prompt_ids: np.ndarray) -> str | None:
        """The engine whose held prefix of the prompt, in tokens, less the load penalty,
        is largest (ties: the session's engine, then the less loaded), among the engines
        within `max_imbalance` of the least loaded (the bound sticky routing keeps: a cache
        is no reason to pile requests onto one engine); None when none of them holds a
        block of it."""
        view = self._view
        assert view is not None
        low = min(self.load(n) for n in self._engines)
        bound = self._max_imbalance
        eligible = [n for n in self._engines if bound is None or self.load(n) - low <= bound]
        held = {n: view.held_blocks(n, self._prompt_keys(session_id, prompt_ids, n)) * view.block_size(n)
                for n in eligible if view.knows(n)}
        if not held or max(held.values()) == 0:
            return None
        current = self._sessions.get(session_id)
        best = max(eligible, key=lambda n: (held.get(n, 0) - self._penalty * (self.load(n) - low),
                                            n == current, -self.load(n)))
        if current is not None and best != current:
            self._num_residency_moves += 1
        self._num_routed += 1
        self._view_held_tokens += held.get(best, 0)
        self._assign(session_id, best)
        return best

    def _prompt_keys(self, session_id: str, ids: np.ndarray, engine: str) -> list[int]:
        """The block keys of `ids` as `engine` hashes them (its block size and salt), from
        the session's last keys where `ids` extends the prompt they were made for."""
        view = self._view
        assert view is not None
        size, salt = view.block_size(engine), view.salt(engine)
        cached = self._keys.get(session_id)
        known: list[int] = []
        if cached is not None and cached[:2] == (size, salt):
            covered = cached[2]
            if len(covered) <= len(ids) and np.array_equal(covered, ids[:len(covered)]):
                known = cached[3]
        keys = block_keys(ids, size, salt, known)
        self._keys[session_id] = (size, salt, ids[:len(keys) * size], keys)
        return keys

    def _note_sent(self, session_id: str, engine: str, ids: np.ndarray, skip: int = 0) -> int:
        """The blocks of `ids` (a prompt just sent, or it with its output) are held by
        `engine` once its prefill runs: the view says so now, not a poll later. The first
        `skip` blocks are there already; returns how many blocks `ids` has."""
        if self._view is None or not self._view.knows(engine):
            return 0
        keys = self._prompt_keys(session_id, ids, engine)
        self._view.add(engine, keys[skip:])
        return len(keys)

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
                       sampling: Sampling, images: tuple[TrajectoryImage, ...] = ()) -> RoutedOutput:
        """Generate on the session's engine; on engine failure retry on another engine.
        `images`: the context's images (rollout.vision.for_engine), for a vision-language model."""
        if self._load_poll_s > 0 and self._poller is None:
            self._poller = asyncio.create_task(self._poll_load())
        rerouted = False
        attempt = 0
        ids = np.asarray(prompt_ids) if self._view is not None else None
        while True:
            name, moved = self._pick(session_id, ids)
            rerouted = rerouted or moved
            self._in_flight[name] += 1
            self._sent_since_poll[name] += 1
            sent = self._note_sent(session_id, name, ids) if ids is not None else 0
            try:
                engine, rid = self._engines[name], f"{request_id}.{attempt}"
                call = (engine.generate(rid, prompt_ids, sampling, images=images) if images  # pyrefly: ignore[unexpected-keyword]
                        else engine.generate(rid, prompt_ids, sampling))
                out = await (asyncio.wait_for(call, self._timeout_s) if self._timeout_s else call)
                if ids is not None:  # its output's full blocks are cached too
                    self._note_sent(session_id, name, np.concatenate([ids, out.token_ids.astype(ids.dtype)]),
                                    skip=sent)
                return RoutedOutput(out, name, rerouted)
            except BaseException as exc:  # `is_failure` judges any error; cancellation goes on
                if isinstance(exc, asyncio.CancelledError) or not self._is_failure(exc):
                    raise
                self._remove(name, exc)
                attempt += 1
            finally:
                self._in_flight[name] -= 1

    async def refresh_load(self) -> None:
        """Take the engines' own load (running + waiting requests) as the new baseline,
        and with a residency view, the blocks each engine stored and removed since."""
        stats = await self.engine_stats()
        for name, s in stats.items():
            self._reported[name] = s.num_running + s.num_waiting
            self._sent_since_poll[name] = 0
        if self._view is not None:
            await self.refresh_residency()

    async def refresh_residency(self) -> None:
        """Apply each engine's KV events since this router's last read to its view."""
        view = self._view
        assert view is not None
        deltas = await self._fan_out_named(lambda n, e: e.kv_residency(view.seq(n)))
        for name, delta in deltas.items():
            view.apply(name, delta)

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
        if self._view is not None:
            self._view.drop(name)

    def release(self, session_id: str) -> None:
        """Forget a finished trajectory's session."""
        self._sessions.pop(session_id, None)
        self._keys.pop(session_id, None)

    async def _fan_out(self, call: Callable[[EngineClient], Awaitable[T]]) -> dict[str, T]:
        """Run `call` on every live engine concurrently; failed engines are removed."""
        return await self._fan_out_named(lambda _, engine: call(engine))

    async def _fan_out_named(self, call: Callable[[str, EngineClient], Awaitable[T]]) -> dict[str, T]:
        """`_fan_out` of a call that also takes the engine's name."""
        names = list(self._engines)
        results = await asyncio.gather(*(call(n, self._engines[n]) for n in names),
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
                           self._num_rebalanced, self._num_routed, self._view_held_tokens,
                           self._num_residency_moves,
                           self._view.num_lost if self._view is not None else 0)
