"""Benchmark (by hand, never in CI): how many concurrent trajectories one AgentLoopWorker
process drives, and what the orchestration costs per turn.

The engine and the tool are STAND-INS that only sleep (0.05 s generate, 0.2 s tool): this
measures sluice's own per-turn overhead (gate, router, recorder, tool-call parsing,
continuity ids, tool dispatch), not a model. Tokenization uses the real tiny tokenizer.

    .venv/bin/python tests/bench/bench_agent_worker.py [--trajectories 4000] [--turns 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import time
from collections.abc import Mapping
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


async def run(num_trajectories: int, turns: int, group_size: int) -> dict[str, float]:
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
            "tokens_per_traj": float(np.mean([len(t.input_ids()) for t in trajs]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=4000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    result = asyncio.run(run(args.trajectories, args.turns, args.group_size))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}; stand-in engine {GENERATE_S}s, stand-in tool {TOOL_S}s")
    print(f"{'metric':<24} value")
    for key, value in result.items():
        print(f"{key:<24} {value:.3f}" if isinstance(value, float) else f"{key:<24} {value}")
    print(f"{'wall / ideal':<24} {result['wall_s'] / result['ideal_s']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
