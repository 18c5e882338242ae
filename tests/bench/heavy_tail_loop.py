"""An AgentLoop for bench_sync_vs_async.py: the real ToolAgentLoop (real sandboxed tools)
whose commands take a heavy-tailed time, the way repository builds and test runs do.

`HEAVY_TAIL_WHERE=sandbox` (the default): each `python`/`bash` call the model makes is
prefixed with a `sleep` of a drawn length that runs in the trajectory's own sandbox, so the
sandbox is held, `envs.exec_timeout_s` kills a command that runs past it (a hang becomes a
real timeout observation), and the tool's own timing is the real one. The draw is the
simulator's `--tail seed` exec-time model (launch.sim.sandbox_model.seed_tail) with mean
`HEAVY_TAIL_EXEC_S`, hangs sized for `HEAVY_TAIL_TURNS` commands per trajectory and cut at
`HEAVY_TAIL_TIMEOUT_S` (the bench's envs.exec_timeout_s), so `python -m launch.simulate
... plan.exec_s=.. plan.turns=.. agent.tool_timeout_s=.. --tail seed` has the same tail.

`HEAVY_TAIL_WHERE=loop`: the old sleep-only mode (the tools run as the model wrote them,
then the loop sleeps: most turns `HEAVY_TAIL_BASE_S`, a fraction `HEAVY_TAIL_SLOW_FRACTION`
`HEAVY_TAIL_SLOWDOWN` times that); no sandbox is held for the delay.

Settings come from environment variables so that Ray worker processes see the bench's
choice."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random

from launch.sim.sandbox_model import seed_tail
from rollout.agent_loop import AgentContext, ToolAgentLoop, ToolOutcome
from rollout.tool_parser import ParsedTurn
from envs.types import ToolCall

# How a sleep is put in front of the model's command, per sandbox tool.
SLEEP_PREFIX = {
    "python": ("code", lambda s: f"import time; time.sleep({s:.3f})\n"),
    "bash": ("command", lambda s: f"sleep {s:.3f}; "),
}


def delayed_call(call: ToolCall, seconds: float) -> ToolCall:
    """The call with a `seconds` sleep in front of its command, run in the sandbox; a call
    of a tool that runs no command (or malformed arguments) unchanged."""
    key, prefix = SLEEP_PREFIX.get(call.name, (None, None))
    if key is None or prefix is None or not isinstance(call.arguments.get(key), str):
        return call
    return ToolCall(call.name, {**call.arguments, key: prefix(seconds) + str(call.arguments[key])})


class HeavyTailToolLoop(ToolAgentLoop):
    def __init__(self) -> None:
        env = os.environ.get
        self.where = env("HEAVY_TAIL_WHERE", "sandbox")
        if self.where not in ("sandbox", "loop"):
            raise ValueError(f"HEAVY_TAIL_WHERE={self.where!r}: use sandbox or loop")
        self.base_s = float(env("HEAVY_TAIL_BASE_S", "0.2"))
        self.slow_fraction = float(env("HEAVY_TAIL_SLOW_FRACTION", "0.1"))
        self.slowdown = float(env("HEAVY_TAIL_SLOWDOWN", "10"))
        self.timeout_s = float(env("HEAVY_TAIL_TIMEOUT_S", "8"))
        self.exec_model = seed_tail(float(env("HEAVY_TAIL_EXEC_S", "1.0")),
                                    int(env("HEAVY_TAIL_TURNS", "2")), self.timeout_s)
        self.seed = env("HEAVY_TAIL_SEED", "0")
        self.rng = random.Random()  # the loop mode's draws

    def draw_exec_s(self, key: str) -> float:
        """The run time in the sandbox of the command named `key`; a hang (or a body draw
        cut at the timeout) sleeps well past `timeout_s`, so the sandbox's own limit ends
        it. Drawn from `key` (group id, sample, turn; group ids follow the seeded task
        order), so sync and async runs meet the same tail on the same commands: the
        comparison is not left to which mode happened to draw more hangs."""
        sample = self.exec_model.sample(random.Random(f"{self.seed}/{key}"))
        return self.timeout_s + 60 if sample.timed_out else sample.seconds

    async def run_tools(self, parsed: ParsedTurn, ctx: AgentContext) -> ToolOutcome:
        if self.where == "sandbox":
            turn = len(ctx.recorder.turns) if ctx.recorder is not None else 0
            delay = self.draw_exec_s(f"{ctx.group_id}/{ctx.index}/{turn}")
            calls = tuple(delayed_call(c, delay) for c in parsed.calls)
            return await ctx.run_tools(dataclasses.replace(parsed, calls=calls))
        outcome = await super().run_tools(parsed, ctx)
        delay = self.base_s * (self.slowdown if self.rng.random() < self.slow_fraction else 1.0)
        await asyncio.sleep(delay)
        return dataclasses.replace(outcome, seconds=outcome.seconds + delay)
