"""The agent's final workspace on its way to grading, without sandboxes: the capture's
size cap, the worker handing the capture straight to its reward function whatever the
ending (and nothing for tasks without a sandbox) without ever putting it on the
Trajectory, a failing reward function failing only its trajectory, and HiddenTests
scoring an uncaptured workspace 0.
The same path with real sandboxes and real grading: tests/integration/test_workspace_grading.py."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path

import pytest
from test_agent_loop import ScriptedEngine, call
from test_pool_tool_sessions import FakeProvider

from envs.sandbox.base import Snapshot
from envs.tools.sandbox_tools import SandboxToolSettings
from envs.trajectory_env import EnvBuilder, load_tool_classes
from reward.base import RewardContext, RewardResult
from reward.loop import RewardLoop
from reward.grading.hidden_tests import HiddenTests
from reward.workspace import WorkspaceChanges, changes_from_dir, changes_from_snapshot
from rollout.agent_loop import LoopSettings
from rollout.chat import build_continuity_builder
from rollout.recorder import Budgets
from rollout.router import Router
from envs.types import GradingSpec, Message, Task, TerminationReason, Trajectory
from rollout.worker import AgentLoopWorker


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


# --- the capture ------------------------------------------------------------------

def test_changes_over_the_cap_are_a_problem_not_an_error(tmp_path: Path) -> None:
    src, ws = tmp_path / "src", tmp_path / "ws"
    src.mkdir()
    ws.mkdir()
    (src / "same.py").write_text("x" * 100)
    (ws / "same.py").write_text("x" * 100)  # unchanged: never counts against the cap
    (ws / "a.py").write_text("a" * 6)
    assert changes_from_dir(str(ws), str(src), max_bytes=6).written == {"a.py": b"a" * 6}
    (ws / "b.py").write_text("b")
    over = changes_from_dir(str(ws), str(src), max_bytes=6)
    assert over.written == {} and over.deleted == ()
    assert "exceed 6 bytes" in over.problem and "envs.max_workspace_changes_mb" in over.problem

    tar_path = tmp_path / "snap.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("huge.bin")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"0" * 10))
    snapshot = Snapshot(str(tar_path), os.path.getsize(tar_path))
    assert "exceed 9 bytes" in changes_from_snapshot(snapshot, str(src), 9).problem
    assert changes_from_snapshot(snapshot, str(src), 10).written == {"huge.bin": b"0" * 10}


def test_a_problem_carries_no_files_and_reprs_stay_short() -> None:
    with pytest.raises(ValueError, match="carries no files"):
        WorkspaceChanges(written={"a.py": b"x"}, problem="too big")
    changes = WorkspaceChanges(written={"a.py": b"SECRET" * 1000}, deleted=("b.py",))
    assert "SECRET" not in repr(changes) and "6000 bytes" in repr(changes)


# --- the worker -------------------------------------------------------------------

class FailingEngine(ScriptedEngine):
    """Replies with the script, then fails (the trajectory ends with `error`) or hangs
    (it ends with `timeout`) instead of the given turn."""

    def __init__(self, tokenizer, script: list[str], fail_at: int, hang: bool = False) -> None:
        super().__init__(tokenizer, script)
        self.fail_at, self.hang = fail_at, hang

    async def generate(self, request_id, prompt_ids, sampling):
        if len(self.prompts.get(request_id.split("#")[0], [])) == self.fail_at:
            if self.hang:
                await asyncio.sleep(3600)
            raise ConnectionError("engine lost")
        return await super().generate(request_id, prompt_ids, sampling)


class RecordingReward:
    """A RewardFn that keeps the workspace it was handed (and can be told to raise)."""

    seen: list = []
    raise_for: set = set()

    async def __call__(self, trajectory, task, ctx: RewardContext) -> RewardResult:
        RecordingReward.seen.append(ctx.workspace)
        if trajectory.index in RecordingReward.raise_for:
            raise KeyError("reward bug")
        return RewardResult(1.0, {"graded": 1.0})


def sandbox_worker(tokenizer, engine, provider: FakeProvider,
                   timeout_s: float = 10.0) -> AgentLoopWorker:
    settings = LoopSettings(budgets=Budgets(4096, 3000, 160), max_turns=4,
                            max_tool_calls_per_turn=2, tool_timeout_s=5.0)
    rewards = RewardLoop(f"{__name__}:RecordingReward", lambda ids: "", timeout_s=30.0,
                         max_concurrency=4)
    return AgentLoopWorker(default_loop="rollout.agent_loop:ToolAgentLoop", settings=settings,
                           chat=build_continuity_builder(tokenizer, "tiny"), tokenizer=tokenizer,
                           router=Router({"e0": engine}),
                           envs=EnvBuilder(load_tool_classes(), provider, SandboxToolSettings()),
                           rewards=rewards, trajectory_timeout_s=timeout_s)


SANDBOX_TASK = Task("fix", (Message("user", "Fix it."),), tools=("write_file", "bash", "submit"))
WRITE = call("write_file", path="fix.py", content="ok")


@pytest.fixture(autouse=True)
def fresh_recording():
    RecordingReward.seen, RecordingReward.raise_for = [], set()


@pytest.mark.parametrize("ending", ["finished", "error", "timeout"])
async def test_the_worker_grades_the_final_workspace_whatever_the_ending(
        tokenizer, ending: str) -> None:
    provider = FakeProvider()
    if ending == "finished":
        engine = ScriptedEngine(tokenizer, [WRITE, call("submit")])
    else:
        engine = FailingEngine(tokenizer, [WRITE], fail_at=1, hang=ending == "timeout")
    worker = sandbox_worker(tokenizer, engine, provider, timeout_s=6.0)  # the hang ends it
    group = await worker.run_group(SANDBOX_TASK, "g", 2)
    for trajectory in group.trajectories:
        assert trajectory.termination.value == ending, trajectory.termination_detail
        assert trajectory.reward == 1.0
        assert not hasattr(trajectory, "workspace")  # never on the Trajectory
    assert [w.written for w in RecordingReward.seen] == [{"fix.py": b"ok"}] * 2
    assert (provider.num_acquires, provider.num_releases) == (2, 2)


async def test_trajectories_without_a_sandbox_are_graded_without_a_workspace(tokenizer) -> None:
    provider = FakeProvider()
    engine = ScriptedEngine(tokenizer, [call("submit")])  # submit alone opens no sandbox
    await sandbox_worker(tokenizer, engine, provider).run_group(
        Task("toy", (Message("user", "2+3?"),), tools=("submit",)), "g", 2)
    assert RecordingReward.seen == [None, None] and provider.num_acquires == 0


async def test_a_failing_reward_fails_its_trajectory_only(tokenizer) -> None:
    RecordingReward.raise_for = {1}
    engine = ScriptedEngine(tokenizer, [WRITE, call("submit")])
    group = await sandbox_worker(tokenizer, engine, FakeProvider()).run_group(SANDBOX_TASK, "g", 3)
    ends = [t.termination for t in group.trajectories]
    assert ends == [TerminationReason.FINISHED, TerminationReason.ERROR, TerminationReason.FINISHED]
    failed = group.trajectories[1]
    assert failed.reward == 0.0 and failed.reward_components == {"reward_error": 1.0}
    assert "RecordingReward raised KeyError: 'reward bug'" in failed.termination_detail


# --- HiddenTests ------------------------------------------------------------------

def trajectory(index: int) -> Trajectory:
    return Trajectory(task_id="fix", group_id="g", index=index, prompt_ids=[1],
                      response_ids=[2], response_mask=[1], logprobs=[-0.5], versions=[0],
                      termination=TerminationReason.FINISHED)


async def test_hidden_tests_score_an_uncaptured_workspace_zero_without_grading(
        tmp_path: Path) -> None:
    task = Task("fix", (Message("user", "Fix it."),), source_dir=str(tmp_path),
                grading=GradingSpec(fail_to_pass=("test_fix.py::test_it",)))

    async def no_sandbox(spec):
        raise AssertionError("an uncaptured workspace must not be graded")

    ctx = RewardContext(workspace=WorkspaceChanges(problem="over the cap"),
                        create_sandbox=no_sandbox)
    result = await HiddenTests()(trajectory(0), task, ctx)
    assert result.reward == 0.0 and result.components["workspace_error"] == 1.0
    assert "over the cap" in result.detail


async def test_the_reward_loop_passes_the_workspace_to_the_task_reward_fn(tmp_path: Path) -> None:
    task = Task("fix", (Message("user", "Fix it."),), source_dir=str(tmp_path),
                grading=GradingSpec(fail_to_pass=("test_fix.py::test_it",)),
                reward_fn="reward.grading.hidden_tests:HiddenTests")
    loop = RewardLoop("reward.rules:ExactMatch", lambda ids: "", timeout_s=30.0,
                      max_concurrency=2)
    # HiddenTests only answers without a grading sandbox when it was given this workspace.
    problem = WorkspaceChanges(problem="the final workspace could not be captured")
    scored = await loop.score(trajectory(0), task, problem)
    assert scored.reward == 0.0 and scored.reward_components["workspace_error"] == 1.0


def test_version_control_and_bytecode_caches_are_not_changes(tmp_path: Path) -> None:
    src, ws = tmp_path / "src", tmp_path / "ws"
    for root in (src, ws):
        (root / "pkg" / "__pycache__").mkdir(parents=True)
        (root / "pkg" / "a.py").write_text("A = 1\n")
    (src / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"old")  # gone in ws
    (ws / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"new")
    (ws / ".git").write_text("gitdir: elsewhere\n")
    (ws / "__pycache__.py").write_text("X = 1\n")  # a file of that name is a real change
    changes = changes_from_dir(str(ws), str(src))
    assert changes.written == {"__pycache__.py": b"X = 1\n"} and changes.deleted == ()


async def test_the_reward_loop_applies_hacking_findings_under_the_policy(tokenizer) -> None:
    """A right answer from a trajectory whose workspace planted a conftest.py: counted
    under hack_policy=report, and scored 0 under zero."""
    task = Task("fix", (Message("user", "2+3?"),), answer="5")
    ids = tokenizer.encode("Answer: 5", add_special_tokens=False)
    traj = Trajectory("fix", "g", 0, [1], ids, [1] * len(ids), [-0.5] * len(ids), [0] * len(ids),
                      TerminationReason.FINISHED)
    planted = WorkspaceChanges(written={"conftest.py": b"def pytest_runtest_call(item): pass\n"})
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    scores = {}
    for policy in ("report", "zero"):
        loop = RewardLoop("exact_match", decode, timeout_s=30.0, max_concurrency=1, hack_policy=policy)
        scores[policy] = await loop.score(traj, task, planted)
    hacks = {k for k in scores["report"].reward_components if k.startswith("hack_")}
    assert hacks and scores["report"].reward == 1.0
    assert scores["zero"].reward == 0.0 and hacks <= set(scores["zero"].reward_components)
