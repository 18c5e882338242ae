"""Sandbox tools over a SandboxPool of real LocalSandboxes: one trajectory using every
tool, the errors the model gets back, isolation between trajectories, nothing left on
the host after release, and the real AgentLoopWorker giving each trajectory its own
environment (envs.trajectory_env)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from envs.pool import SandboxPool
from envs.sandbox.base import SandboxLimits, SandboxSpec
from envs.tools.sandbox_tools import SandboxToolSettings
from envs.trajectory_env import EnvBuilder, load_tool_classes
from envs.types import GradingSpec, Message, Task, TerminationReason

SMALL = SandboxLimits(memory_mb=256, max_processes=64)
# A command's timeout far above what any command here takes on a loaded 2-core machine (a
# unittest run took over 1 s beside a busy suite); the timeout case has its own 5 s.
SETTINGS = SandboxToolSettings(limits=SMALL, exec_timeout_s=60.0, max_observation_tokens=1500)
SHORT_TIMEOUT = dataclasses.replace(SETTINGS, exec_timeout_s=5.0)
ALL_TOOLS = ("bash", "python", "read_file", "write_file", "str_replace", "run_tests", "submit")


class Recording:
    def __init__(self) -> None:
        from envs.sandbox.local import LocalSandbox

        self.made: list[LocalSandbox] = []

        async def create(spec: SandboxSpec) -> LocalSandbox:
            sandbox = await LocalSandbox.create(spec)
            self.made.append(sandbox)
            return sandbox

        self.pool = SandboxPool(create, max_sandboxes=4, num_warm=0, snapshot_interval_s=5.0)

    def leftovers(self) -> list[str]:
        return [p for sb in self.made for p in sb.host_paths() if os.path.lexists(p)]


@pytest.fixture
async def recording() -> AsyncIterator[Recording]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    recording = Recording()
    yield recording
    await recording.pool.close()
    assert recording.leftovers() == []


@pytest.fixture
def task(tmp_path: Path) -> Task:
    source, visible, hidden = tmp_path / "source", tmp_path / "visible", tmp_path / "hidden"
    for folder in (source, visible, hidden):
        folder.mkdir()
    (source / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    # A TestCase: the sandbox's python may lack pytest, and unittest only collects these.
    (visible / "test_calc.py").write_text(
        "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    (hidden / "test_hidden_secret.py").write_text("SECRET_HIDDEN = 1\n")
    return Task("fix-add", (Message("user", "Fix add."),), tools=ALL_TOOLS,
                source_dir=str(source), visible_tests=str(visible),
                grading=GradingSpec(hidden_tests=str(hidden)))


async def test_one_trajectory_uses_every_tool_in_one_workspace(recording: Recording,
                                                               task: Task) -> None:
    env = EnvBuilder(load_tool_classes(), recording.pool, SETTINGS).build(task)
    await env.open()
    tools = env.tools
    try:
        failing = await tools["run_tests"].execute({})
        assert not failing.is_error and failing.text.startswith("exit code: 1\n")
        assert "AssertionError: -1 != 5" in failing.text
        written = await tools["write_file"].execute({"path": "notes/plan.txt", "content": "a + b\n"})
        assert written.text == "Wrote 6 bytes to notes/plan.txt."
        edited = await tools["str_replace"].execute(
            {"path": "/workspace/calc.py", "old": "return a - b", "new": "return a + b"})
        assert edited.text.startswith("Edited calc.py: replaced 1 occurrence at line 2.")
        ran = await tools["python"].execute(
            {"code": "from calc import add\nprint(add(2, 3), open('notes/plan.txt').read())"})
        assert ran.text == "exit code: 0\nstdout:\n5 a + b\n\nstderr: (empty)"  # print's newline
        shown = await tools["read_file"].execute({"path": "calc.py", "start_line": 2, "end_line": 2})
        assert shown.text == "     2\t    return a + b"
        passing = await tools["run_tests"].execute({})
        assert passing.text.startswith("exit code: 0\n") and "OK" in passing.text
        listing = await tools["bash"].execute({"command": "ls -R; grep -rl SECRET_HIDDEN . || true"})
        assert "test_calc.py" in listing.text and "hidden" not in listing.text
        submitted = await tools["submit"].execute({})
        assert submitted.ends_trajectory
    finally:
        await env.release()
    assert recording.pool.stats().num_in_use == 0 and recording.leftovers() == []


async def test_tool_mistakes_come_back_as_error_results(recording: Recording, task: Task) -> None:
    env = EnvBuilder(load_tool_classes(), recording.pool, SHORT_TIMEOUT).build(task)
    await env.open()
    tools = env.tools
    try:
        await tools["write_file"].execute({"path": "twice.py", "content": "x = 1\nx = 1\n"})
        cases = [
            ("read_file", {"path": "missing.py"}, "no file 'missing.py'"),
            ("read_file", {"path": "../etc/passwd"}, "leaves the workspace"),
            ("read_file", {"path": "calc.py", "start_line": 9}, "past the end of calc.py"),
            ("write_file", {"path": "/etc/evil", "content": "x"}, "is absolute"),
            ("str_replace", {"path": "calc.py", "old": "nope", "new": "x"}, "was not found"),
            ("str_replace", {"path": "twice.py", "old": "x = 1", "new": "x = 2"},
             "occurs 2 times in twice.py (lines 1, 2)"),
            ("str_replace", {"path": "missing.py", "old": "a", "new": "b"}, "no file"),
            ("bash", {"command": "sleep 60"}, "timed out after 5 s"),
        ]
        for name, arguments, expected in cases:
            result = await tools[name].execute(arguments)
            assert result.is_error, (name, arguments, result.text)
            assert expected in result.text, (name, result.text)
        assert (await tools["read_file"].execute({"path": "twice.py"})).text.count("x = 1") == 2
        crashed = await tools["python"].execute({"code": "raise SystemExit('bad input')"})
        assert not crashed.is_error and crashed.text.startswith("exit code: 1\n")
        assert "bad input" in crashed.text
    finally:
        await env.release()


async def test_two_trajectories_never_see_each_others_files(recording: Recording,
                                                            task: Task) -> None:
    envs = EnvBuilder(load_tool_classes(), recording.pool, SETTINGS)

    async def trajectory(secret: str) -> str:
        env = envs.build(task)
        await env.open()
        try:
            await env.tools["write_file"].execute({"path": f"{secret}.txt", "content": secret})
            await asyncio.sleep(0.2)  # both have written before either looks
            return (await env.tools["bash"].execute({"command": "ls *.txt; cat *.txt"})).text
        finally:
            await env.release()

    first, second = await asyncio.gather(trajectory("alpha"), trajectory("beta"))
    assert "alpha" in first and "beta" not in first
    assert "beta" in second and "alpha" not in second
    assert len(recording.made) == 2 and recording.leftovers() == []


class ScriptedEngine:
    """Stand-in engine: each session's k-th turn gets script[k], then the stop token."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns: dict[str, int] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        from rollout.engine import TokenOutput

        session = request_id.split("#")[0]
        k = self.turns[session] = self.turns.get(session, -1) + 1
        ids = self.tokenizer.encode(self.script[min(k, len(self.script) - 1)],
                                    add_special_tokens=False) + [self.eos]
        n = len(ids)
        return TokenOutput(np.array(ids, np.int32), np.full(n, -0.5, np.float32),
                           np.zeros(n, np.int32), "stop", len(prompt_ids), 0)


class WorkspaceWritten:
    """A RewardFn: 1 when the final workspace holds log.txt with two lines."""

    async def __call__(self, trajectory, task, ctx):
        from reward.base import RewardResult

        written = ctx.workspace.written if ctx.workspace is not None else {}
        return RewardResult(float(written.get("log.txt") == b"one\ntwo\n"))


def scripted_worker(tokenizer, script: list[str], pool: SandboxPool, settings: SandboxToolSettings,
                    tool_timeout_s: float):
    """The real AgentLoopWorker (ToolAgentLoop, real tools over `pool`, WorkspaceWritten
    scored on the worker) driven by a ScriptedEngine playing `script`."""
    from rollout.agent_loop import LoopSettings
    from rollout.chat import build_continuity_builder
    from rollout.recorder import Budgets
    from rollout.router import Router
    from reward.loop import RewardLoop
    from rollout.worker import AgentLoopWorker

    return AgentLoopWorker(
        default_loop="rollout.agent_loop:ToolAgentLoop",
        settings=LoopSettings(budgets=Budgets(32768, 30000, 256), max_turns=5,
                              max_tool_calls_per_turn=2, tool_timeout_s=tool_timeout_s),
        chat=build_continuity_builder(tokenizer, "tiny"), tokenizer=tokenizer,
        router=Router({"e0": ScriptedEngine(tokenizer, script)}),
        envs=EnvBuilder(load_tool_classes(), pool, settings),
        rewards=RewardLoop(f"{__name__}:WorkspaceWritten", tokenizer.decode, timeout_s=30.0,
                           max_concurrency=4),
        trajectory_timeout_s=60.0)


def call(name: str, **arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def test_the_worker_gives_each_trajectory_its_own_shared_sandbox(
        recording: Recording, task: Task, tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    script = [call("write_file", path="log.txt", content="one\n"),
              call("bash", command="echo two >> log.txt; wc -l < log.txt"), call("submit")]
    worker = scripted_worker(tokenizer, script, recording.pool, SETTINGS, tool_timeout_s=30.0)
    group = await worker.run_group(task, "g0", 3)
    for trajectory in group.trajectories:
        assert trajectory.termination is TerminationReason.FINISHED, trajectory.termination_detail
        assert trajectory.reward == 1.0  # graded on the worker from the captured workspace
        text = tokenizer.decode(trajectory.response_ids.tolist())
        # write_file and bash met in one workspace, which no other trajectory touched.
        assert "stdout:\n2\n" in text, text
    stats = recording.pool.stats()
    assert (stats.num_acquires, stats.num_in_use) == (3, 0) and len(recording.made) == 3


async def test_a_tool_call_that_outlives_its_timeout_becomes_an_observation(
        recording: Recording, task: Task, tiny_model_path: Path) -> None:
    """agent.tool_timeout_s cuts a call the sandbox is still running: the model reads a
    timeout observation, the trajectory goes on to its next turn, the turn counts the
    timeout (rollout/tool_timeouts of the step's metrics), and the sandbox is released."""
    from transformers import AutoTokenizer

    from trainer.run.metrics import compute_batch_metrics

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    script = [call("python", code="import time\ntime.sleep(30)"), call("submit")]
    worker = scripted_worker(tokenizer, script, recording.pool,
                             SandboxToolSettings(limits=SMALL, exec_timeout_s=60.0), tool_timeout_s=0.5)
    group = await worker.run_group(task, "g0", 2)
    for trajectory in group.trajectories:
        assert trajectory.termination is TerminationReason.FINISHED, trajectory.termination_detail
        text = tokenizer.decode(trajectory.response_ids.tolist())
        assert "Timeout: python did not finish within 0.5 s." in text, text
        assert [u.num_tool_timeouts for u in trajectory.turns][:1] == [1]
    metrics = compute_batch_metrics([group], version=0)
    assert metrics["rollout/tool_timeouts"] == 2.0 <= metrics["rollout/tool_calls"]
    assert recording.pool.stats().num_in_use == 0


class HoldingEngine(ScriptedEngine):
    """The scripted engine, except that a session's call number `hold_at` (0-based) never
    returns: the trajectory is stopped there, as a Ctrl-C or a kill would find it."""

    def __init__(self, tokenizer, script: list[str], hold_at: int) -> None:
        super().__init__(tokenizer, script)
        self.hold_at, self.held = hold_at, asyncio.Event()

    async def generate(self, request_id, prompt_ids, sampling):
        if self.turns.get(request_id.split("#")[0], -1) + 1 == self.hold_at:
            self.held.set()
            await asyncio.Event().wait()
        return await super().generate(request_id, prompt_ids, sampling)


async def test_a_stopped_sandboxed_trajectory_continues_with_its_workspace(
        recording: Recording, task: Task, tiny_model_path: Path, tmp_path: Path) -> None:
    """Stopped while generating its 4th turn, a trajectory continues in a new worker from
    its journal (rollout.durable): its 3 turns are replayed byte for byte without the
    engine, its new sandbox holds the files written before the stop (the 4th turn's
    `cat` shows them, the final workspace is graded 1), and its journal folder is gone
    once the group is returned."""
    from transformers import AutoTokenizer

    from rollout.durable import CODEC, DurableSetup, ToolsRan, TurnGenerated, journal_file

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    script = [call("write_file", path="log.txt", content="one\n"),
              call("bash", command="echo two >> log.txt"), call("bash", command="wc -l < log.txt"),
              call("bash", command="cat log.txt"), call("submit")]
    setup = DurableSetup(str(tmp_path / "inflight"), "run-a")
    first = scripted_worker(tokenizer, script, recording.pool, SETTINGS, tool_timeout_s=30.0)
    first.durable = setup
    engine = first.router._engines["e0"] = HoldingEngine(tokenizer, script, hold_at=3)
    run = asyncio.create_task(first.run_group(task, "g3", 1))
    await asyncio.wait_for(engine.held.wait(), 120)
    path = journal_file(setup.folder, "g3", 0)
    async with asyncio.timeout(60):  # the 3rd turn's workspace is saved while the 4th generates
        while sum(isinstance(r, ToolsRan) for r in CODEC.read(path).records) < 3:
            await asyncio.sleep(0.05)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    before = [r for r in CODEC.read(path).records if isinstance(r, TurnGenerated)]
    assert len(before) == 3 and first.stats().durable.num_states == 3

    second = scripted_worker(tokenizer, script[3:], recording.pool, SETTINGS, tool_timeout_s=30.0)
    second.durable = setup
    (traj,) = (await second.run_group(task, "g3", 1)).trajectories
    assert traj.termination is TerminationReason.FINISHED, traj.termination_detail
    assert len(traj.turns) == 5 and second.router._engines["e0"].turns == {"g3/0": 1}  # 2 live calls
    model = np.flatnonzero(traj.response_mask == 1)
    for record, turn, start in zip(before, traj.turns, np.cumsum([0] + [u.num_generated for u in traj.turns])):
        assert traj.response_ids[model[start:start + turn.num_generated]].tolist() == record.token_ids.tolist()
    text = tokenizer.decode(traj.response_ids.tolist())
    assert "one\ntwo" in text.split("cat log.txt")[-1], text  # written before the stop, there after it
    assert traj.reward == 1.0  # graded from the continued sandbox's final workspace
    stats = second.stats().durable
    assert (stats.num_continued, stats.num_turns_replayed, stats.num_restarted) == (1, 3, 0)
    assert not os.path.exists(os.path.dirname(path))
