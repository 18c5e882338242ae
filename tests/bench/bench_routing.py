"""Bench: first-turn routing over 8 engines from 16 agent-loop workers, each with its own
Router (as in a run), choosing by each router's own requests in flight (before) or by
the engines' own load shared through polling plus the imbalance bound (after).

Stand-in engines (no model): a request's latency grows with the engine's running
requests (a batch shares the decode step), and each engine keeps an LRU prefix cache of
`--cache-sessions` sessions, so a turn hits when its session's context is still cached
there. Workers carry uneven load (worker w runs 4 + 2 (w % 5) concurrent trajectories of
heavy-tailed turn counts, with tool waits between turns), which per-worker choice cannot
see. Reported: the spread of running requests over engines (sampled every 10 ms:
(max - min) / mean, and max / mean), the prefix-cache hit rate, and the wall time.

    python tests/bench/bench_routing.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
from collections import OrderedDict

import numpy as np

from rollout.engine import EngineStats, Sampling, TokenOutput
from rollout.router import Router

SAMPLING = Sampling(max_new_tokens=8)


class StandInEngine:
    def __init__(self, cache_sessions: int) -> None:
        self.running = 0
        self.cache: OrderedDict[str, None] = OrderedDict()
        self.cache_sessions = cache_sessions
        self.queries = self.hits = 0

    async def generate(self, request_id, prompt_ids, sampling):
        session = request_id.split("#")[0]
        self.queries += 1
        if session in self.cache:
            self.hits += 1
            self.cache.move_to_end(session)
        else:
            self.cache[session] = None
            if len(self.cache) > self.cache_sessions:
                self.cache.popitem(last=False)
        self.running += 1
        try:
            await asyncio.sleep(0.02 * (1 + self.running / 8))  # batched decode slows down
        finally:
            self.running -= 1
        return TokenOutput(np.array([1], np.int32), np.array([-0.1], np.float32),
                           np.array([0], np.int32), "stop", len(prompt_ids), 0)

    async def get_stats(self):
        return EngineStats(0, self.running, self.running, 0, 0.0, 0, 0, False)


async def worker(router: Router, w: int, stop: float, rng: np.random.Generator) -> None:
    async def trajectory(k: int) -> None:
        while time.monotonic() < stop:
            sid = f"w{w}-t{k}-{rng.integers(1 << 30)}"
            for turn in range(int(min(40, rng.pareto(1.5) * 3 + 1))):
                await router.generate(sid, f"{sid}#{turn}", [1], SAMPLING)
                await asyncio.sleep(float(rng.exponential(0.02)))  # the tool call
            router.release(sid)
    await asyncio.gather(*(trajectory(k) for k in range(4 + 2 * (w % 5))))


async def run(shared: bool, seconds: float, cache_sessions: int) -> dict[str, float]:
    engines = {f"e{i}": StandInEngine(cache_sessions) for i in range(8)}
    routers = [Router(engines, load_poll_s=0.05 if shared else 0.0,
                      max_imbalance=16 if shared else None) for _ in range(16)]
    spreads, peaks = [], []
    stop = time.monotonic() + seconds

    async def sample() -> None:
        while time.monotonic() < stop:
            running = np.array([e.running for e in engines.values()], float)
            if running.mean() > 0:
                spreads.append((running.max() - running.min()) / running.mean())
                peaks.append(running.max() / running.mean())
            await asyncio.sleep(0.01)

    start = time.monotonic()
    await asyncio.gather(sample(), *(worker(r, w, stop, np.random.default_rng(w))
                                     for w, r in enumerate(routers)))
    for r in routers:
        r.close()
    queries = sum(e.queries for e in engines.values())
    return {"spread": float(np.mean(spreads)), "peak": float(np.mean(peaks)),
            "hit_rate": sum(e.hits for e in engines.values()) / queries,
            "turns_per_s": queries / (time.monotonic() - start)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--cache-sessions", type=int, default=8)
    args = parser.parse_args()
    print(f"machine: {platform.node()} | {platform.machine()} | python {platform.python_version()}")
    print(f"command: python tests/bench/bench_routing.py --seconds {args.seconds:g} "
          f"--cache-sessions {args.cache_sessions}")
    print("8 stand-in engines, 16 workers (own Router each), modes alternate, 2 rounds\n")
    print("| routing | running spread (max-min)/mean | max/mean | prefix hit rate | turns/s |")
    print("|---|---:|---:|---:|---:|")
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(2):
        for shared in (False, True):
            results[shared].append(asyncio.run(run(shared, args.seconds, args.cache_sessions)))
    for shared, name in ((False, "per-worker counts (before)"),
                         (True, "engines' own load + bound (after)")):
        rows = results[shared]
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        print(f"| {name} | {mean['spread']:.2f} | {mean['peak']:.2f} | {mean['hit_rate']:.3f} | "
              f"{mean['turns_per_s']:.0f} |")


if __name__ == "__main__":
    main()
