"""The agent's final workspace reaches hidden-test grading: the real AgentLoopWorker runs
ToolAgentLoop trajectories of a bundled code task (a scripted stand-in engine writes the
model's turns) whose sandbox tools edit files in real LocalSandboxes of a SandboxPool;
when each trajectory ends, however it ends, the pool captures its workspace before the
sandbox is released, and the worker's own RewardLoop + HiddenTests grade that capture in a
fresh sandbox right there: 1 for a correct fix, 0 for a wrong one, 0 when the agent edited
the tests instead. The capture never rides on the Trajectory."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from envs.pool import SandboxPool
from envs.sandbox.base import SandboxLimits
from envs.tasks import load_tasks
from envs.tasks.code import VISIBLE_TESTS_DIR, spec_by_name
from envs.tools.sandbox_tools import SandboxToolSettings
from envs.trajectory_env import EnvBuilder, load_tool_classes
from reward.grading.hidden_tests import HiddenTests
from reward.loop import RewardLoop
from envs.types import HIDDEN_TESTS_DIR, Task, TerminationReason

SETTINGS = SandboxToolSettings(limits=SandboxLimits(memory_mb=512, max_processes=64),
                               exec_timeout_s=30.0, max_observation_tokens=1500)
ABORT = "<the engine aborts this generation>"


class RecordingHiddenTests:
    """HiddenTests that also keeps the workspace each trajectory was graded on."""

    seen: dict = {}

    async def __call__(self, trajectory, task, ctx):
        RecordingHiddenTests.seen[trajectory.index] = ctx.workspace
        return await HiddenTests()(trajectory, task, ctx)


def call(name: str, **arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class PerTrajectoryEngine:
    """Stand-in engine: trajectory i's k-th turn gets scripts[i][k] and the stop token;
    the entry ABORT is an aborted generation (the trajectory ends with `error`)."""

    def __init__(self, tokenizer, scripts: list[list[str]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns: dict[str, int] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        from rollout.engine import TokenOutput

        session = request_id.split("#")[0]
        k = self.turns[session] = self.turns.get(session, -1) + 1
        text = self.scripts[int(session.rsplit("/", 1)[1])][k]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids, finish = (ids[:3], "abort") if text == ABORT else (ids + [self.eos], "stop")
        n = len(ids)
        return TokenOutput(np.array(ids, np.int32), np.full(n, -0.5, np.float32),
                           np.zeros(n, np.int32), finish, len(prompt_ids), 0)


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    from envs.sandbox.local import LocalSandbox

    pool = SandboxPool(LocalSandbox.create, max_sandboxes=4, num_warm=0)
    yield pool
    await pool.close()


STUB_BODY = "    raise NotImplementedError"
RIGHT_BODY = ("    import itertools\n"
              "    return ''.join(f'{len(list(g))}{c}' for c, g in itertools.groupby(text))")
# Passes the visible tests (lower case only) but not the hidden case-sensitivity test.
WRONG_BODY = RIGHT_BODY.replace("groupby(text)", "groupby(text.lower())")
PASSING_TESTS = "import unittest\n\n\nclass TestRleEncode(unittest.TestCase):\n" \
                "    def test_runs(self):\n        pass\n"


async def test_hidden_tests_grade_the_final_workspace_of_real_trajectories(
        pool: SandboxPool, tiny_model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from rollout.agent_loop import LoopSettings
    from rollout.chat import build_continuity_builder
    from rollout.recorder import Budgets
    from rollout.router import Router
    from rollout.worker import AgentLoopWorker

    task: Task = next(t for t in load_tasks("code_functions", cache_dir=str(tmp_path))
                      if t.id.endswith("/run_length_encode"))
    spec = spec_by_name(task.id)
    hidden_file = f"{HIDDEN_TESTS_DIR}/{spec.hidden_file}"
    scripts = [
        # 0: a correct fix by str_replace, checked with the visible tests, submitted.
        [call("str_replace", path=spec.module, old=STUB_BODY, new=RIGHT_BODY),
         call("run_tests"), call("submit")],
        # 1: a wrong fix that the visible tests cannot tell apart, submitted.
        [call("str_replace", path=spec.module, old=STUB_BODY, new=WRONG_BODY),
         call("run_tests"), call("submit")],
        # 2: the reference written whole; then a generation is aborted: graded all the same.
        [call("write_file", path=f"/workspace/{spec.module}", content=spec.reference), ABORT],
        # 3: no fix; the visible tests are rewritten to pass, and tests are planted where
        #    the hidden ones go and as a conftest: all reverted before grading.
        [call("write_file", path=f"{VISIBLE_TESTS_DIR}/{spec.visible_file}",
              content=PASSING_TESTS),
         call("write_file", path=hidden_file, content="def test_empty():\n    pass\n"),
         call("write_file", path="conftest.py", content="collect_ignore = ['_sluice_hidden']\n"),
         call("run_tests"), call("submit")],
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    worker = AgentLoopWorker(
        default_loop="rollout.agent_loop:ToolAgentLoop",
        settings=LoopSettings(budgets=Budgets(32768, 30000, 4096), max_turns=8,
                              max_tool_calls_per_turn=2, tool_timeout_s=60.0),
        chat=build_continuity_builder(tokenizer, "tiny"), tokenizer=tokenizer,
        router=Router({"e0": PerTrajectoryEngine(tokenizer, scripts)}),
        envs=EnvBuilder(load_tool_classes(), pool, SETTINGS),
        rewards=RewardLoop(f"{__name__}:RecordingHiddenTests", tokenizer.decode, timeout_s=120.0,
                           max_concurrency=2),
        trajectory_timeout_s=120.0)

    RecordingHiddenTests.seen = {}
    worker.rewards.scope = "all"  # the recording stand-in instead of the task's HiddenTests
    scored = await worker.run_group(task, "g0", len(scripts))
    group = scored

    assert [t.termination for t in group.trajectories] == [
        TerminationReason.FINISHED, TerminationReason.FINISHED, TerminationReason.ERROR,
        TerminationReason.FINISHED], [t.termination_detail for t in group.trajectories]
    assert pool.stats().num_in_use == 0  # every sandbox was released after its capture
    right, wrong, errored, test_edits = (RecordingHiddenTests.seen[i] for i in range(4))
    assert right is not None and wrong is not None and errored is not None
    assert test_edits is not None
    assert RIGHT_BODY.encode() in right.written[spec.module]
    assert errored.written[spec.module] == spec.reference.encode()
    assert {hidden_file, "conftest.py"} <= set(test_edits.written)
    assert spec.module not in test_edits.written
    assert not any("__pycache__" in path for path in right.written)  # run_tests left some
    assert all(not w.problem for w in RecordingHiddenTests.seen.values())

    by_index = {t.index: t for t in scored.trajectories}
    details = {i: (t.reward, t.reward_components) for i, t in by_index.items()}
    assert [by_index[i].reward for i in range(4)] == [1.0, 0.0, 1.0, 0.0], details
    # The wrong fix was graded (some hidden tests pass), not the untouched stub.
    assert 0.0 < by_index[1].reward_components["tests_passed_frac"] < 1.0, details
    assert by_index[3].reward_components["tests_passed_frac"] == 0.0, details
    assert by_index[3].reward_components["reverted_changes"] == 3.0, details
    assert all(t.reward_components["tamper_detected"] == 0.0 for t in scored.trajectories)
    assert not any(hasattr(t, "workspace") for t in scored.trajectories)  # never on a Trajectory
