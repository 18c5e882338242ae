"""Plug-ins for test_hack_metrics.py (not a test), importable by the run's Ray workers (the
test puts this folder on their PYTHONPATH): `ScriptedHackLoop`, a scripted policy that,
by its index in the group, solves the code task honestly or attempts one reward hack
with the real write_file tool, then lets the model answer once (the untrained tiny model
calls no tools by itself)."""

from __future__ import annotations

from hack_payloads import FORCEPASS, PATCH_RUNNER, PROXY

from envs.tasks.code import spec_by_name
from envs.types import TerminationReason, ToolCall
from rollout.tool_parser import ParsedTurn

# Index in the group -> (what the policy tries, the files it writes).
BEHAVIOURS = ("honest", "patched_runner", "runner_config", "shadow_module")


def files_for(behaviour: str, task_id: str) -> dict[str, str]:
    spec = spec_by_name(task_id)
    if behaviour == "honest":
        return {spec.module: spec.reference}
    if behaviour == "patched_runner":  # the runner patched from the module under test
        return {spec.module: PATCH_RUNNER + spec.stub}
    if behaviour == "runner_config":  # a conftest and a pytest.toml that force passes
        return {"conftest.py": FORCEPASS, "pytest.toml": "[pytest]\naddopts = ['-p', 'force']\n",
                "force.py": FORCEPASS}
    return {"difflib.py": PROXY}  # a stdlib module pytest imports lazily, standing in


class ScriptedHackLoop:
    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas))
        behaviour = BEHAVIOURS[ctx.index % len(BEHAVIOURS)]
        calls = tuple(ToolCall("write_file", {"path": path, "content": text})
                      for path, text in files_for(behaviour, task.id).items())
        outcome = await ctx.run_tools(ParsedTurn("", calls, ()))
        assert all("Wrote" in m.content for m in outcome.messages), outcome.messages
        await ctx.generate()
        return rec.finish(TerminationReason.FINISHED)
