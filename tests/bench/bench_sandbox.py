"""Benchmark of the local sandbox backend, run by hand (needs root and bubblewrap):

    .venv/bin/python tests/bench/bench_sandbox.py [--num-concurrent 64]

Prints one table: create-from-source latency, the cost a sandbox adds to a short
command over a bare subprocess, creates per second, and throughput with many short
commands in flight at once. Nothing is asserted; numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from envs.sandbox.base import SandboxLimits, SandboxSpec
from envs.sandbox.local import LocalSandbox
from sandbox_bench_inputs import make_source_tree, percentile

LIMITS = SandboxLimits(memory_mb=512, max_processes=64)
SHORT_COMMAND = ["python3", "-c", "pass"]


async def timed(fn: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - start)
    return out


async def bench_create(source: str, n: int) -> tuple[list[float], list[float]]:
    creates, releases = [], []
    for _ in range(n):
        start = time.perf_counter()
        sb = await LocalSandbox.create(SandboxSpec(source_dir=source, limits=LIMITS))
        creates.append(time.perf_counter() - start)
        start = time.perf_counter()
        await sb.release()
        releases.append(time.perf_counter() - start)
    return creates, releases


async def bench_exec(n: int) -> tuple[list[float], list[float]]:
    sb = await LocalSandbox.create(SandboxSpec(limits=LIMITS))
    try:
        await sb.exec(SHORT_COMMAND, 30)  # warm the page cache
        sandboxed = await timed(lambda: sb.exec(SHORT_COMMAND, 30), n)
    finally:
        await sb.release()

    async def bare() -> None:
        proc = await asyncio.create_subprocess_exec(
            "/usr/bin/python3", "-c", "pass", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        await proc.communicate()

    return sandboxed, await timed(bare, n)


async def bench_concurrent_creates(source: str, n: int) -> tuple[float, list[LocalSandbox]]:
    start = time.perf_counter()
    sandboxes = await asyncio.gather(*(LocalSandbox.create(SandboxSpec(source_dir=source,
                                                                       limits=LIMITS))
                                       for _ in range(n)))
    return n / (time.perf_counter() - start), list(sandboxes)


async def bench_in_flight(sandboxes: list[LocalSandbox], rounds: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    walls = []
    for _ in range(rounds):
        start = time.perf_counter()
        results = await asyncio.gather(*(sb.exec(SHORT_COMMAND, 120) for sb in sandboxes))
        walls.append(time.perf_counter() - start)
        failed = [r for r in results if r.exit_code != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} short commands failed, first: {failed[0]}")
        latencies += [r.duration_s for r in results]
    return len(sandboxes) * rounds / sum(walls), latencies


def row(name: str, values_s: list[float]) -> str:
    p50, p99 = percentile(values_s, 0.5) * 1e3, percentile(values_s, 0.99) * 1e3
    return f"| {name:<44} | {p50:>9.1f} | {p99:>9.1f} | {len(values_s):>5} |"


async def main(num_samples: int, num_concurrent: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_source_tree(Path(tmp))
        source_mb = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / 2**20
        creates, releases = await bench_create(tmp, num_samples)
        sandboxed, bare = await bench_exec(num_samples)
        creates_per_s, sandboxes = await bench_concurrent_creates(tmp, num_concurrent)
        try:
            commands_per_s, in_flight = await bench_in_flight(sandboxes, rounds=3)
        finally:
            await asyncio.gather(*(sb.release() for sb in sandboxes))
    caps = sandboxes[0].capabilities()
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True,
                                   text=True).stdout.strip()
    print(f"\nLocal sandbox benchmark: {os.cpu_count()} cores, {bwrap_version}, cgroup "
          f"v{caps.cgroup_version} {'+'.join(caps.cgroup_controllers) or 'none'}, "
          f"source tree {source_mb:.1f} MiB\n")
    print(f"| {'measure':<44} | {'p50 ms':>9} | {'p99 ms':>9} | {'n':>5} |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 11}|{'-' * 7}|")
    print(row("create from source (copy + chown + cgroups)", creates))
    print(row("release", releases))
    print(row("exec `python3 -c pass` in a sandbox", sandboxed))
    print(row("bare subprocess `python3 -c pass`", bare))
    extra_p50 = (percentile(sandboxed, 0.5) - percentile(bare, 0.5)) * 1e3
    extra_p99 = (percentile(sandboxed, 0.99) - percentile(bare, 0.99)) * 1e3
    print(f"| {'sandbox overhead per command':<44} | {extra_p50:>9.1f} | {extra_p99:>9.1f} | "
          f"{'':>5} |")
    print(row(f"exec latency, {num_concurrent} commands in flight", in_flight))
    print(f"\ncreates/s sequential: {1 / statistics.mean(creates):.1f}; "
          f"concurrent ({num_concurrent} at once): {creates_per_s:.1f}")
    print(f"short commands/s with {num_concurrent} sandboxes in flight: {commands_per_s:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=50)
    parser.add_argument("--num-concurrent", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(main(args.num_samples, args.num_concurrent))
