"""Plug-ins for test_multinode.py (not a test), importable by the Ray workers of a
multi-node cluster on one machine (the test puts this folder on their PYTHONPATH):

- `BigWorkspaceLoop`: writes a 1 MiB file into the trajectory's sandbox with the real
  write_file tool, then lets the model answer once (the untrained tiny model calls no
  tools by itself);
- `WhereGraded`: a RewardFn that records, per trajectory, the Ray node it was scored on,
  the node of the sandbox pool, how many workspace bytes it was handed and how the
  trajectory ended."""

from __future__ import annotations

import json
import os

from envs.types import TerminationReason, ToolCall
from reward.base import RewardResult
from rollout.tool_parser import ParsedTurn

BIG_FILE_BYTES = 1 << 20
LOG_ENV = "SLUICE_TEST_GRADING_LOG"


class BigWorkspaceLoop:
    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas))
        call = ToolCall("write_file", {"path": "big.bin", "content": "x" * BIG_FILE_BYTES})
        outcome = await ctx.run_tools(ParsedTurn("", (call,), ()))
        assert "Wrote" in outcome.messages[0].content, outcome.messages[0].content
        await ctx.generate()
        return rec.finish(TerminationReason.FINISHED)


class WhereGraded:
    async def __call__(self, trajectory, task, ctx):
        import ray

        size = ctx.workspace.num_bytes if ctx.workspace is not None else 0
        row = {"group": trajectory.group_id, "index": trajectory.index,
               "node": ray.get_runtime_context().get_node_id(), "workspace_bytes": size,
               "termination": trajectory.termination.value}
        with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return RewardResult(float(size == BIG_FILE_BYTES) * (trajectory.index % 2),
                            {"workspace_mib": size / 2**20})
