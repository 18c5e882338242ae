"""Benchmark of SandboxPool over real LocalSandboxes, run by hand (needs root and
bubblewrap):

    .venv/bin/python tests/bench/bench_pool.py [--num-trajectories 64] [--num-commands 10]

Prints one table: warm acquire latency, create-from-source latency (acquire of a
per-task sandbox), creates per second with many creates in flight, many trajectories
running short commands at once, and the cost of one snapshot (what the pool's snapshot
policy trades against). Nothing is asserted; numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from envs.pool import SandboxPool
from envs.sandbox.base import SandboxLimits, SandboxSpec
from envs.sandbox.local import LocalSandbox
from sandbox_bench_inputs import make_source_tree, percentile

LIMITS = SandboxLimits(memory_mb=512, max_processes=64)
GENERIC = SandboxSpec(limits=LIMITS)


def build_pool(max_sandboxes: int, num_warm: int) -> SandboxPool:
    return SandboxPool(LocalSandbox.create, max_sandboxes=max_sandboxes, num_warm=num_warm,
                       warm_limits=LIMITS)


async def bench_warm_acquire(n: int) -> tuple[list[float], int]:
    """Acquire latency with a warm sandbox ready (the refill is awaited outside the timing)."""
    pool = build_pool(max_sandboxes=8, num_warm=4)
    await pool.start()
    latencies, num_warm = [], 0
    try:
        for _ in range(n):
            while pool.stats().num_warm < 4:
                await asyncio.sleep(0.005)
            start = time.perf_counter()
            lease = await pool.acquire(GENERIC)
            latencies.append(time.perf_counter() - start)
            num_warm += lease.warm
            await pool.release(lease)
    finally:
        await pool.close()
    return latencies, num_warm


async def bench_create_from_source(source: str, n: int) -> list[float]:
    pool = build_pool(max_sandboxes=4, num_warm=0)
    latencies = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            lease = await pool.acquire(SandboxSpec(source_dir=source, limits=LIMITS))
            latencies.append(time.perf_counter() - start)
            await pool.release(lease)
    finally:
        await pool.close()
    return latencies


async def bench_creates_per_second(source: str, n: int) -> float:
    pool = build_pool(max_sandboxes=n, num_warm=0)
    try:
        start = time.perf_counter()
        leases = await asyncio.gather(*(pool.acquire(SandboxSpec(source_dir=source, limits=LIMITS))
                                        for _ in range(n)))
        elapsed = time.perf_counter() - start
        await asyncio.gather(*(pool.release(lease) for lease in leases))
    finally:
        await pool.close()
    return n / elapsed


async def bench_trajectories(num_trajectories: int, num_commands: int) -> dict[str, float]:
    """`num_trajectories` at once, each acquiring a sandbox and running short commands."""
    pool = build_pool(max_sandboxes=num_trajectories, num_warm=8)
    await pool.start()
    peak = 0

    async def trajectory() -> None:
        nonlocal peak
        lease = await pool.acquire(GENERIC)
        try:
            peak = max(peak, pool.stats().num_in_use)
            for i in range(num_commands):
                await pool.exec(lease, f"echo {i} > out.txt && cat out.txt", 30)
        finally:
            await pool.release(lease)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(trajectory() for _ in range(num_trajectories)))
        elapsed = time.perf_counter() - start
        stats = pool.stats()
    finally:
        await pool.close()
    return {"wall_s": elapsed, "commands_per_s": num_trajectories * num_commands / elapsed,
            "exec_p50_s": stats.exec.p50_s, "exec_p99_s": stats.exec.p99_s, "peak": peak,
            "warm_hits": stats.num_warm_hits, "snapshots": stats.num_snapshots,
            "queue_p99_s": stats.queue_wait.p99_s}


async def bench_snapshot(source: str, n: int) -> list[float]:
    pool = build_pool(max_sandboxes=1, num_warm=0)
    lease = await pool.acquire(SandboxSpec(source_dir=source, limits=LIMITS))
    latencies = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            await pool.checkpoint(lease)
            latencies.append(time.perf_counter() - start)
    finally:
        await pool.close()
    return latencies


def row(name: str, values: list[float] | None = None, text: str = "") -> str:
    if values is not None:
        text = (f"p50 {percentile(values, 0.5) * 1e3:8.2f} ms   p99 {percentile(values, 0.99) * 1e3:8.2f}"
                f" ms   (n={len(values)})")
    return f"| {name:<44} | {text:<54} |"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-trajectories", type=int, default=64)
    parser.add_argument("--num-commands", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_source_tree(Path(tmp))
        warm, num_warm = await bench_warm_acquire(args.repeats)
        create = await bench_create_from_source(tmp, max(5, args.repeats // 5))
        creates_per_s = await bench_creates_per_second(tmp, 32)
        snapshot = await bench_snapshot(tmp, 10)
        load = await bench_trajectories(args.num_trajectories, args.num_commands)
    print(row("measure", text="result"))
    print(f"|{'-' * 46}|{'-' * 56}|")
    print(row(f"warm acquire ({num_warm}/{len(warm)} warm)", warm))
    print(row("acquire with create from source (200 files)", create))
    print(row("creates/s, 32 per-task creates at once", text=f"{creates_per_s:.1f}"))
    print(row("snapshot of that workspace (checkpoint)", snapshot))
    print(row(f"{args.num_trajectories} trajectories x {args.num_commands} commands",
              text=f"{load['wall_s']:.2f} s wall, {load['commands_per_s']:.0f} commands/s"))
    print(row("  exec p50 / p99 under that load",
              text=f"{load['exec_p50_s'] * 1e3:.1f} / {load['exec_p99_s'] * 1e3:.1f} ms"))
    print(row("  peak in use, warm hits, snapshots",
              text=f"{load['peak']:.0f}, {load['warm_hits']:.0f}, {load['snapshots']:.0f}"))
    print(row("  queue wait p99", text=f"{load['queue_p99_s'] * 1e3:.1f} ms"))


if __name__ == "__main__":
    asyncio.run(main())
