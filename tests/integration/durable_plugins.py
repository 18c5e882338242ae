"""An agent loop for the whole-system check of durable trajectories (test_stop_and_resume):
six turns whatever the model says, each turn's python tool appending `turn-k` to log.txt
in the trajectory's sandbox (and taking a moment, so that trajectories are in flight when
the run is killed), the last one printing the file. A trajectory continued across a
restart shows each line once and in order only if its first turns were replayed and its
sandbox came back as they left it: a fresh sandbox would lose lines, turns run again
would repeat them."""

from __future__ import annotations

from envs.types import Task, TerminationReason, ToolCall, Trajectory
from rollout.agent_loop import AgentContext
from rollout.tool_parser import ParsedTurn

TURNS = 6
TURN_TOOL_S = 0.4


def tool_code(turn: int) -> str:
    if turn == TURNS:
        return "print(open('log.txt').read(), end='')"
    return f"import time\nopen('log.txt', 'a').write('turn-{turn}\\n')\ntime.sleep({TURN_TOOL_S})"


def expected_log() -> str:
    return "".join(f"turn-{k}\n" for k in range(1, TURNS))


class SixTurnLogLoop:
    durable = True  # it uses ctx.generate and ctx.run_tools only

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas or None))
        for turn in range(1, TURNS + 1):
            if (stop := rec.generation_stop()) is not None:
                return rec.finish(stop)
            out = await ctx.generate()
            outcome = await ctx.run_tools(ParsedTurn("", (ToolCall("python", {"code": tool_code(turn)}),), ()))
            obs = ctx.chat.observation_ids(outcome.messages, ctx.ended_with_stop(out))
            if (stop := rec.fits_observation(len(obs))) is not None:
                return rec.finish(stop, "the tool observation does not fit")
            rec.add_observation(obs, outcome.num_calls, outcome.num_errors, outcome.seconds,
                                outcome.num_timeouts, tools=outcome.tools, failed_tools=outcome.failed_tools)
        return rec.finish(TerminationReason.FINISHED)
