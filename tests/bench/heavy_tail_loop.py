"""An AgentLoop for bench_sync_vs_async.py: the real ToolAgentLoop (real sandboxed tools)
whose environment also takes a heavy-tailed time per tool turn, the way repository
builds and test runs do: most turns `HEAVY_TAIL_BASE_S`, a fraction
`HEAVY_TAIL_SLOW_FRACTION` `HEAVY_TAIL_SLOWDOWN` (default 10) times that. Settings come
from environment variables so that Ray worker processes see the bench's choice."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random

from rollout.agent_loop import AgentContext, ToolAgentLoop, ToolOutcome
from rollout.tool_parser import ParsedTurn

class HeavyTailToolLoop(ToolAgentLoop):
    def __init__(self) -> None:
        self.base_s = float(os.environ.get("HEAVY_TAIL_BASE_S", "0.2"))
        self.slow_fraction = float(os.environ.get("HEAVY_TAIL_SLOW_FRACTION", "0.1"))
        self.slowdown = float(os.environ.get("HEAVY_TAIL_SLOWDOWN", "10"))
        self.rng = random.Random()

    async def run_tools(self, parsed: ParsedTurn, ctx: AgentContext) -> ToolOutcome:
        outcome = await super().run_tools(parsed, ctx)
        delay = self.base_s * (self.slowdown if self.rng.random() < self.slow_fraction else 1.0)
        await asyncio.sleep(delay)
        return dataclasses.replace(outcome, seconds=outcome.seconds + delay)
