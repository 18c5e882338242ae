"""Router and turn gate logic with fake engines (unit level; the real engine is tested in
tests/integration)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout.engine import EngineStats, Sampling, TokenOutput
from rollout.gate import TurnGate
from rollout.router import NoEngineError, Router


class EngineDeadError(RuntimeError):
    """Named like vLLM's dead-engine error, which the router recognises by name."""


class FakeEngine:
    """Sleeps instead of generating; can be told to die."""

    def __init__(self, name: str, delay_s: float = 0.01) -> None:
        self.name, self.delay_s = name, delay_s
        self.calls: list[str] = []
        self.dead = False
        self.paused = False
        self.version = 0

    async def generate(self, request_id, prompt_ids, sampling):
        self.calls.append(request_id)
        await asyncio.sleep(self.delay_s)
        if self.dead:
            raise EngineDeadError(f"{self.name} died")
        return TokenOutput(np.array([7], np.int32), np.array([-0.5], np.float32),
                           np.array([self.version], np.int32), "stop", len(prompt_ids), 0)

    async def abort(self, request_ids):
        pass

    async def pause(self):
        if self.dead:
            raise EngineDeadError(self.name)
        self.paused = True

    async def resume(self):
        self.paused = False

    async def update_weights(self, version, blob=None, path=None):
        if self.dead:
            raise EngineDeadError(self.name)
        self.version = version

    async def reset_prefix_cache(self):
        pass

    async def get_stats(self):
        return EngineStats(self.version, 0, 0, 0, 0.0, 0, 0, self.paused)


SAMPLING = Sampling(max_new_tokens=4)


async def test_first_turn_goes_to_least_loaded_then_sticks():
    a, b = FakeEngine("a", 0.05), FakeEngine("b", 0.05)
    router = Router({"a": a, "b": b})
    first = await asyncio.gather(*(router.generate(f"s{i}", f"r{i}", [1], SAMPLING) for i in range(4)))
    assert sorted(o.engine for o in first) == ["a", "a", "b", "b"]  # spread by load
    again = [await router.generate(f"s{i}", f"r{i}b", [1, 2], SAMPLING) for i in range(4)]
    assert [o.engine for o in again] == [o.engine for o in first]  # sticky
    assert not any(o.rerouted for o in again)


async def test_dead_engine_moves_its_sessions_and_loses_nothing():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router({"a": a, "b": b})
    owners = {f"s{i}": (await router.generate(f"s{i}", f"r{i}", [1], SAMPLING)).engine
              for i in range(6)}
    a.dead = True
    outs = await asyncio.gather(*(router.generate(s, f"{s}-2", [1, 2], SAMPLING) for s in owners))
    assert all(o.engine == "b" for o in outs)
    moved = [o for s, o in zip(owners, outs) if owners[s] == "a"]
    assert moved and all(o.rerouted for o in moved)
    stats = router.stats()
    assert stats.failed_engines == ("a",) and stats.num_reroutes == len(moved)
    b.dead = True
    with pytest.raises(NoEngineError):
        await router.generate("s0", "last", [1], SAMPLING)


async def test_non_engine_errors_propagate_without_removing_the_engine():
    class Rejecting(FakeEngine):
        async def generate(self, request_id, prompt_ids, sampling):
            raise ValueError("prompt too long")

    router = Router({"a": Rejecting("a")})
    with pytest.raises(ValueError, match="prompt too long"):
        await router.generate("s", "r", [1], SAMPLING)
    assert router.stats().engines == ("a",)


async def test_timeout_counts_as_engine_failure():
    slow, fast = FakeEngine("slow", 5.0), FakeEngine("fast", 0.0)
    router = Router({"slow": slow, "fast": fast}, request_timeout_s=0.2)
    router._sessions["s"] = "slow"  # pin the session to the hung engine
    out = await router.generate("s", "r", [1], SAMPLING)
    assert out.engine == "fast" and out.rerouted
    assert router.stats().failed_engines == ("slow",)


async def test_sessions_are_bounded_and_released():
    router = Router({"a": FakeEngine("a", 0)}, max_sessions=3)
    for i in range(5):
        await router.generate(f"s{i}", "r", [1], SAMPLING)
    assert router.stats().num_sessions == 3 and router.stats().num_evicted_sessions == 2
    router.release("s4")
    assert router.stats().num_sessions == 2


async def test_control_calls_fan_out_and_drop_dead_engines():
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router({"a": a, "b": b})
    await router.update_weights_all(3)
    assert a.version == b.version == 3
    b.dead = True
    await router.update_weights_all(4)
    assert a.version == 4 and router.stats().engines == ("a",)
    assert set(await router.engine_stats()) == {"a"}


async def test_gate_close_waits_for_generating_turns_and_blocks_new_ones():
    gate = TurnGate()
    events: list[str] = []

    async def one_turn(name: str, hold_s: float):
        async with gate.turn():
            events.append(f"{name}-start")
            await asyncio.sleep(hold_s)
            events.append(f"{name}-end")

    running = asyncio.create_task(one_turn("a", 0.1))
    await asyncio.sleep(0.01)
    closing = asyncio.create_task(gate.close())
    await asyncio.sleep(0.01)
    late = asyncio.create_task(one_turn("b", 0.0))
    await closing
    assert events == ["a-start", "a-end"]  # drained; b waits at the gate
    assert gate.num_generating == 0 and not gate.is_open
    gate.open()
    await asyncio.gather(running, late)
    assert events[-2:] == ["b-start", "b-end"]
    assert gate.closed_s > 0


async def test_gate_reports_queue_wait():
    gate = TurnGate()
    await gate.close()
    asyncio.get_running_loop().call_later(0.05, gate.open)
    async with gate.turn() as waited_s:
        assert waited_s >= 0.04


class LoadedEngine(FakeEngine):
    """Reports its own running requests, from every router that sends to it."""

    def __init__(self, name: str, delay_s: float = 0.05) -> None:
        super().__init__(name, delay_s)
        self.running = 0

    async def generate(self, request_id, prompt_ids, sampling):
        self.running += 1
        try:
            return await super().generate(request_id, prompt_ids, sampling)
        finally:
            self.running -= 1

    async def get_stats(self):
        return EngineStats(self.version, self.running, self.running, 0, 0.0, 0, 0, False)


async def test_new_sessions_follow_the_engines_own_load_across_routers():
    engines = {"a": LoadedEngine("a"), "b": LoadedEngine("b")}
    busy = Router(engines)  # another worker's router put 6 long requests on engine a
    for i in range(6):
        busy._sessions[f"x{i}"] = "a"
    jobs = [asyncio.create_task(busy.generate(f"x{i}", f"x{i}#1", [1], SAMPLING)) for i in range(6)]
    await asyncio.sleep(0.01)
    blind, shared = Router(engines), Router(engines, load_poll_s=10.0)
    await shared.refresh_load()

    async def place(router: Router) -> list[str]:
        await asyncio.gather(*(router.generate(f"s{i}", f"s{i}#1", [1], SAMPLING) for i in range(4)))
        return [router._sessions[f"s{i}"] for i in range(4)]
    placed_blind, placed_shared = await asyncio.gather(place(blind), place(shared))
    assert placed_blind.count("a") == 2  # it sees only its own requests: half land on a
    assert placed_shared == ["b"] * 4  # a runs 6 requests, b none: b until it catches up
    await asyncio.gather(*jobs)
    shared.close()


async def test_stickiness_is_bounded_by_the_imbalance():
    engines = {"a": LoadedEngine("a"), "b": LoadedEngine("b")}
    router = Router(engines, max_imbalance=3)
    assert router._pick("s")[0] == "a"
    router._reported = {"a": 10, "b": 2}  # a got crowded by others since
    name, moved = router._pick("s")
    assert (name, moved) == ("b", True) and router.stats().num_rebalanced == 1
    assert router.stats().num_reroutes == 0  # not a failure
    router._reported = {"a": 4, "b": 2}
    assert router._pick("s") == ("b", False)  # within the bound: sticky
