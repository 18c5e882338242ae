"""Plug-ins for test_multinode.py (not a test), importable by the Ray workers of a
multi-node cluster on one machine (the test puts this folder on their PYTHONPATH):

- `BigWorkspaceHackLoop`: the scripted hacking policy of hack_plugins (by its index in
  the group: the honest solution or one reward hack, written with the real write_file
  tool), plus a 1 MiB file in the trajectory's sandbox, then one model answer (the
  untrained tiny model calls no tools by itself);
- `WhereGraded`: hidden-test grading (reward.grading.hidden_tests) that also records, per
  trajectory, the Ray node it was scored on, how many workspace bytes it was handed and
  how the trajectory ended."""

from __future__ import annotations

import json
import os

from hack_plugins import BEHAVIOURS, files_for

from envs.types import TerminationReason, ToolCall
from reward.grading.hidden_tests import HiddenTests
from rollout.tool_parser import ParsedTurn

BIG_FILE_BYTES = 1 << 20
LOG_ENV = "SLUICE_TEST_GRADING_LOG"


class BigWorkspaceHackLoop:
    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas))
        files = {**files_for(BEHAVIOURS[ctx.index % len(BEHAVIOURS)], task.id),
                 "big.bin": "x" * BIG_FILE_BYTES}
        calls = tuple(ToolCall("write_file", {"path": path, "content": text})
                      for path, text in files.items())
        outcome = await ctx.run_tools(ParsedTurn("", calls, ()))
        assert all("Wrote" in m.content for m in outcome.messages), outcome.messages
        await ctx.generate()
        return rec.finish(TerminationReason.FINISHED)


class WhereGraded(HiddenTests):
    async def __call__(self, trajectory, task, ctx):
        import ray

        result = await super().__call__(trajectory, task, ctx)
        size = ctx.workspace.num_bytes if ctx.workspace is not None else 0
        row = {"group": trajectory.group_id, "index": trajectory.index,
               "node": ray.get_runtime_context().get_node_id(), "workspace_bytes": size,
               "termination": trajectory.termination.value}
        with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return result
