"""Bench: what durable trajectories (rollout.durable) cost per turn, run by hand (the
sandbox part needs root and bubblewrap):

    .venv/bin/python tests/bench/bench_durable.py [--turns 200] [--repeats 5]

  journal:  the two records one live turn appends (the generation with its ids, logprobs
            and versions; the tool calls with their observation), each an open + write +
            close of the trajectory's file, for generations of several lengths; the median
            over `--repeats` rounds of `--turns` turns;
  state:    saving the sandbox's workspace after a turn's tools (the pool's snapshot, hard
            linked beside the journal), with one file changed by the turn, for workspaces of
            several sizes on real LocalSandboxes; beside it the pool's own snapshot of the
            same workspace, which the save is made of;
  replay:   opening a 30-turn journal and replaying it (what a continued trajectory does
            before its first live turn, without the agent loop's own work).

Nothing is asserted; numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from sandbox_bench_inputs import make_source_tree, percentile

from rollout.engine import TokenOutput
from rollout.durable import DurableTrajectory, ToolsRan, TurnGenerated, open_replay

LOOP = "bench:Loop"
OBSERVATION = "stdout:\n" + "x" * 400  # a tool's output of about 100 tokens


def generation(n: int, context: int) -> TurnGenerated:
    out = TokenOutput(np.arange(n, dtype=np.int32), np.full(n, -0.1, np.float32), np.full(n, 3, np.int32),
                      "stop", context, context // 2)
    return TurnGenerated.of(out, 0.01, 0.2, "engine-0", 0.0, num_context_ids=context)


def ran() -> ToolsRan:
    return ToolsRan(('python {"code": "print(1)"}',), (OBSERVATION,), ("python",), 1, 0, 0, False, 0.05,
                    ("python",), ())


class NoSandbox:
    async def save_state(self, path: str) -> int:
        return 0

    async def restore_state(self, path: str) -> None:
        return None


async def bench_journal(folder: str, turns: int, repeats: int, generated: int) -> float:
    """Median µs per turn (its two records)."""
    rounds = []
    for r in range(repeats):
        path = os.path.join(folder, f"j-{generated}-{r}", "0.journal")
        durable = DurableTrajectory(path, "run", LOOP, has_sandbox=False)
        durable.begin("task", "g", 0, np.arange(2000, dtype=np.int32))
        start = time.perf_counter()
        for k in range(turns):
            await durable.record_generation(generation(generated, 2000 + k * (generated + 100)))
            await durable.record_tools(ran(), NoSandbox())
        rounds.append((time.perf_counter() - start) / turns * 1e6)
    return statistics.median(rounds)


async def bench_state(source: str, turns: int) -> tuple[list[float], list[float], int]:
    """Per turn: the save (snapshot + link) and, apart, the pool's snapshot alone (s)."""
    from envs.pool import SandboxPool
    from envs.sandbox.base import SandboxLimits, SandboxSpec
    from envs.sandbox.local import LocalSandbox

    limits = SandboxLimits(memory_mb=512, max_processes=64)
    pool = SandboxPool(LocalSandbox.create, max_sandboxes=1, num_warm=0, snapshot_interval_s=3600.0)
    lease = await pool.acquire(SandboxSpec(source_dir=source, limits=limits))
    saves, snapshots, size = [], [], 0
    with tempfile.TemporaryDirectory() as keep:
        try:
            for k in range(turns):
                await pool.write_file(lease, "edited.py", f"turn = {k}\n".encode())
                start = time.perf_counter()
                size = await pool.save_state(lease, os.path.join(keep, f"state{k}"))
                saves.append(time.perf_counter() - start)
                await pool.write_file(lease, "edited.py", f"turn = {k}.5\n".encode())
                start = time.perf_counter()
                await pool.checkpoint(lease)
                snapshots.append(time.perf_counter() - start)
                if k:
                    os.remove(os.path.join(keep, f"state{k - 1}"))  # only the newest is kept
        finally:
            await pool.close()
    return saves, snapshots, size


async def bench_replay(folder: str, repeats: int) -> float:
    """Median ms to open a 30-turn journal of 256-token turns and replay it."""
    path = os.path.join(folder, "replay", "0.journal")
    durable = DurableTrajectory(path, "run", LOOP, has_sandbox=False)
    prompt = np.arange(2000, dtype=np.int32)
    durable.begin("task", "g", 0, prompt)
    contexts = [2000 + k * 356 for k in range(30)]
    for context in contexts:
        await durable.record_generation(generation(256, context))
        await durable.record_tools(ran(), NoSandbox())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        replay = open_replay(path, "run", "task", "g", 0, LOOP, max_version=10).replay
        assert replay is not None
        replay.check_prompt(prompt)
        for context in contexts:
            assert replay.next_generation(context) is not None
            assert replay.next_tools(ran().calls) is not None
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def row(name: str, text: str) -> str:
    return f"| {name:<46} | {text:<52} |"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--state-turns", type=int, default=10)
    args = parser.parse_args()
    print(row("measure", "result"))
    print(f"|{'-' * 48}|{'-' * 54}|")
    with tempfile.TemporaryDirectory() as folder:
        for n in (64, 512, 2048):
            us = await bench_journal(folder, args.turns, args.repeats, n)
            print(row(f"journal, one turn ({n}-token generation)", f"{us:.0f} µs (median of {args.repeats})"))
        print(row("replay of a 30-turn journal (open + replay)",
                  f"{await bench_replay(folder, args.repeats):.1f} ms"))
    if os.geteuid() != 0:
        print(row("sandbox state", "skipped: needs root and bubblewrap"))
        return
    for label, files, size in (("200 files x 8 KiB", 200, 8192), ("2,000 files x 8 KiB", 2000, 8192),
                               ("50 files x 1 MiB", 50, 1 << 20)):
        with tempfile.TemporaryDirectory() as source:
            make_source_tree(Path(source), num_files=files, file_bytes=size)
            saves, snapshots, num_bytes = await bench_state(source, args.state_turns)
        print(row(f"state save per turn, {label}",
                  f"p50 {percentile(saves, 0.5) * 1e3:.1f} ms, p99 {percentile(saves, 0.99) * 1e3:.1f} ms, "
                  f"{num_bytes / 2**20:.1f} MiB"))
        print(row("  the pool's snapshot alone", f"p50 {percentile(snapshots, 0.5) * 1e3:.1f} ms"))


if __name__ == "__main__":
    asyncio.run(main())
