"""`TurnBudgetLoop`: the built-in tool loop, telling the model after every tool call how
many turns it has left.

An AgentLoop turns one task into one finished Trajectory (`async run(task, ctx)`). This
one extends `ToolAgentLoop` at its documented hook, `run_tools`: the tools run as usual
(`ctx.run_tools`), then each observation gets a note. Everything that makes a trajectory
trainable (token-exact prompts, masks, budgets, termination reasons) stays with the base
class and `ctx`. One instance serves every trajectory of a worker: per-trajectory state
lives in `ctx`, never on `self`.
"""

from __future__ import annotations

import dataclasses

from rollout.api import AgentContext, ParsedTurn, ToolAgentLoop, ToolOutcome


class TurnBudgetLoop(ToolAgentLoop):
    async def run_tools(self, parsed: ParsedTurn, ctx: AgentContext) -> ToolOutcome:
        outcome = await ctx.run_tools(parsed)
        assert ctx.recorder is not None  # ctx.start() ran before the first turn
        left = ctx.settings.max_turns - len(ctx.recorder.turns)
        note = f"\n[{left} turn{'s' if left != 1 else ''} left]"
        messages = tuple(dataclasses.replace(m, content=m.with_text(note))
                         for m in outcome.messages)
        return dataclasses.replace(outcome, messages=messages)
