"""Test plug-ins for the SWE mini run: `GoldPatchLoop` applies the row's gold patch in the
trajectory's sandbox with the real write_file and bash tools, then lets the model answer
once. The gold patch comes from the task file named by GOLD_ROWS_ENV, read by the test
only: the Task itself never carries it (that is what makes this a test-only loop)."""

from __future__ import annotations

import json
import os

from envs.types import TerminationReason, ToolCall
from rollout.tool_parser import ParsedTurn

GOLD_ROWS_ENV = "SLUICE_TEST_GOLD_ROWS"


def gold_patch(task_id: str) -> str:
    with open(os.environ[GOLD_ROWS_ENV], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return next(r["patch"] for r in rows if r["instance_id"] == task_id)


class GoldPatchLoop:
    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas))
        calls = (ToolCall("write_file", {"path": "gold.diff", "content": gold_patch(task.id)}),
                 ToolCall("bash", {"command": "git apply gold.diff && rm gold.diff && "
                                              "pwd && git status --short"}))
        outcome = await ctx.run_tools(ParsedTurn("", calls, ()))
        assert "Wrote" in outcome.messages[0].content, outcome.messages[0].content
        with open(os.environ[GOLD_ROWS_ENV] + ".tool_log", "a", encoding="utf-8") as f:
            f.write(json.dumps({"task": task.id, "outputs": [m.content for m in outcome.messages]})
                    + "\n")
        await ctx.generate()
        return rec.finish(TerminationReason.FINISHED)
