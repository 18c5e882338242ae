"""Benchmark (by hand, never in CI): how many concurrent trajectories one AgentLoopWorker
process drives, and what the orchestration costs per turn; with `--processes`, the same
trajectories split over several worker processes (what rollout.num_agent_workers does on a
sandbox node).

The engine and the tool are STAND-INS that only sleep (0.05 s generate, 0.2 s tool): this
measures sluice's own per-turn overhead (gate, router, recorder, tool-call parsing,
continuity ids, tool dispatch), not a model. Tokenization uses the real tiny tokenizer.
The ideal wall clock is what the stand-ins alone take: turns x (0.05 + 0.2) s.

    .venv/bin/python tests/bench/bench_agent_worker.py [--trajectories 4000] [--turns 20]
    .venv/bin/python tests/bench/bench_agent_worker.py --processes 1,2,4 [--rounds 2]

`--processes 1,2,4`: for each count N, N OS processes (multiprocessing spawn), each with
its own AgentLoopWorker, stand-ins and event loop, run trajectories / N each, released
together once all have started; the counts alternate within each round. Reported per count:
wall clock and wall / ideal, orchestration CPU per turn (the processes' CPU summed over
all turns), peak RSS per process (each child's getrusage), turns per second. Each process
first runs one unmeasured group (its first trajectory's lazy imports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import resource
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from envs.trajectory_env import EnvBuilder
from reward.loop import RewardLoop
from envs.tools.base import ToolResult, function_schema
from trainer.run.tiny_model import ensure_tiny_model
from rollout.agent_loop import LoopSettings
from rollout.chat import build_continuity_builder
from rollout.engine import TokenOutput
from rollout.recorder import Budgets
from rollout.router import Router
from envs.types import Message, Task, TerminationReason
from rollout.worker import AgentLoopWorker

GENERATE_S, TOOL_S = 0.05, 0.2


class SleepingStandInEngine:
    """Stand-in engine: sleeps GENERATE_S and returns a fixed tool call (pre-tokenized)."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply = np.asarray(reply_ids, np.int32)
        self.logprobs = np.full(len(reply_ids), -0.5, np.float32)
        self.versions = np.zeros(len(reply_ids), np.int32)

    async def generate(self, request_id, prompt_ids, sampling):
        await asyncio.sleep(GENERATE_S)
        return TokenOutput(self.reply, self.logprobs, self.versions, "stop", len(prompt_ids), 0)


class SleepingStandInTool:
    name = "run"
    schema = function_schema("run", "Run a command.", {"cmd": {"type": "string"}}, ("cmd",))

    def __init__(self, env=None) -> None:
        pass

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
        await asyncio.sleep(TOOL_S)
        return ToolResult("ok")


class ZeroReward:
    async def __call__(self, trajectory, task, ctx):
        from reward.base import RewardResult

        return RewardResult(0.0)


async def run(num_trajectories: int, turns: int, group_size: int,
              start: Callable[[], Awaitable[None]] | None = None) -> dict[str, float]:
    """Build one worker and its stand-ins, await `start` (if given), then run the groups;
    only the runs are measured."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    chat = build_continuity_builder(tokenizer, "tiny")
    call = '<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest -q"}}\n</tool_call>'
    reply = tokenizer.encode(call, add_special_tokens=False) + [chat.end_of_turn_id]
    settings = LoopSettings(budgets=Budgets(1 << 20, 1 << 20, 256), max_turns=turns,
                            max_tool_calls_per_turn=4, tool_timeout_s=60)
    worker = AgentLoopWorker(default_loop="rollout.agent_loop:ToolAgentLoop", settings=settings,
                             chat=chat, tokenizer=tokenizer,
                             router=Router({"stand-in": SleepingStandInEngine(reply)}),
                             envs=EnvBuilder({"run": SleepingStandInTool}),
                             rewards=RewardLoop(f"{__name__}:ZeroReward", tokenizer.decode,
                                                timeout_s=60, max_concurrency=1 << 16),
                             trajectory_timeout_s=3600)
    tasks = [Task(f"t{i}", (Message("user", f"Fix bug {i}."),), tools=("run",))
             for i in range(num_trajectories // group_size)]
    if start is not None:
        # One group first, unmeasured: the lazy imports of a worker's first trajectory (its
        # scoring's) cost each process about a second of CPU once, not per turn.
        await worker.run_group(Task("warm-up", (Message("user", "Warm up."),), tools=("run",)),
                               "warm-up", group_size)
        await start()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu0, wall0 = time.process_time(), time.monotonic()
    groups = await asyncio.gather(*(worker.run_group(t, f"g{i}", group_size) for i, t in enumerate(tasks)))
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trajs = [t for g in groups for t in g.trajectories]
    assert all(t.termination is TerminationReason.MAX_TURNS for t in trajs)
    total_turns = sum(len(t.turns) for t in trajs)
    return {"trajectories": len(trajs), "turns": total_turns, "wall_s": wall,
            "ideal_s": turns * (GENERATE_S + TOOL_S), "cpu_s": cpu,
            "cpu_ms_per_turn": 1000 * cpu / total_turns,
            "peak_rss_mb": rss1 / 1024, "rss_growth_kb_per_traj": (rss1 - rss0) / len(trajs),
            "tokens_per_traj": float(np.mean([len(t.input_ids()) for t in trajs])),
            # tools the loop watchdog found blocking (then run on a thread): 0 with sleeping stand-ins
            "loop_stalls": worker.stats().num_loop_stalls}


def _child(num_trajectories: int, turns: int, group_size: int, ready: Any, go: Any,
           results: Any) -> None:
    """One worker process: set up, say so, wait for the common start, run, report."""

    async def start() -> None:
        ready.release()
        await asyncio.to_thread(go.wait)

    result = asyncio.run(run(num_trajectories, turns, group_size, start))
    results.put(result)


def run_processes(num_processes: int, num_trajectories: int, turns: int,
                  group_size: int) -> dict[str, float]:
    """`num_trajectories` (whole groups) over `num_processes` spawned worker processes,
    released together; the wall clock is the parent's, from release to the last result."""
    ctx = mp.get_context("spawn")
    num_groups = num_trajectories // group_size
    shares = [num_groups // num_processes + (i < num_groups % num_processes)
              for i in range(num_processes)]
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=_child, args=(n * group_size, turns, group_size, ready, go, results))
                for n in shares if n]
    for c in children:
        c.start()
    for _ in children:
        ready.acquire()
    wall0 = time.monotonic()
    go.set()
    parts = [results.get() for _ in children]
    wall = time.monotonic() - wall0
    for c in children:
        c.join()
    total_turns = sum(p["turns"] for p in parts)
    cpu = sum(p["cpu_s"] for p in parts)
    return {"processes": len(children), "trajectories": sum(p["trajectories"] for p in parts),
            "turns": total_turns, "wall_s": wall, "ideal_s": turns * (GENERATE_S + TOOL_S),
            "cpu_s": cpu, "cpu_ms_per_turn": 1000 * cpu / total_turns,
            "peak_rss_mb_max": max(p["peak_rss_mb"] for p in parts),
            "peak_rss_mb_mean": sum(p["peak_rss_mb"] for p in parts) / len(parts),
            "turns_per_s": total_turns / wall, "loop_stalls": sum(p["loop_stalls"] for p in parts)}


def machine_line() -> str:
    return (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.2f} at start, python {platform.python_version()}; "
            f"stand-in engine {GENERATE_S}s, stand-in tool {TOOL_S}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--processes", default="",
                        help="comma-separated process counts, e.g. 1,2,4 (alternating); "
                             "empty: one in-process worker, as before")
    parser.add_argument("--rounds", type=int, default=1, help="with --processes: rounds of all counts")
    args = parser.parse_args()
    if not args.processes:
        result = asyncio.run(run(args.trajectories, args.turns, args.group_size))
        print(machine_line())
        print(f"{'metric':<24} value")
        for key, value in result.items():
            print(f"{key:<24} {value:.3f}" if isinstance(value, float) else f"{key:<24} {value}")
        print(f"{'wall / ideal':<24} {result['wall_s'] / result['ideal_s']:.2f}x")
        print(json.dumps(result))
        return
    counts = [int(n) for n in args.processes.split(",")]
    print(machine_line())
    print(f"{args.trajectories} trajectories x {args.turns} turns, groups of {args.group_size}; "
          f"ideal {args.turns * (GENERATE_S + TOOL_S):.2f} s")
    print(f"{'round':>5} {'procs':>5} {'wall_s':>8} {'wall/ideal':>10} {'cpu_ms/turn':>11} "
          f"{'rss_mb max':>10} {'rss_mb mean':>11} {'turns/s':>8} {'stalls':>6} {'load':>5}")
    rows = []
    for r in range(args.rounds):
        for n in counts:
            res = run_processes(n, args.trajectories, args.turns, args.group_size)
            rows.append(res)
            print(f"{r + 1:>5} {n:>5} {res['wall_s']:>8.2f} {res['wall_s'] / res['ideal_s']:>9.2f}x "
                  f"{res['cpu_ms_per_turn']:>11.3f} {res['peak_rss_mb_max']:>10.0f} "
                  f"{res['peak_rss_mb_mean']:>11.0f} {res['turns_per_s']:>8.0f} {res['loop_stalls']:>6} "
                  f"{os.getloadavg()[0]:>5.2f}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
