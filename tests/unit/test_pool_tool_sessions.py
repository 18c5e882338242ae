"""Sandbox tools without a sandbox: observation truncation and rendering, and the
per-trajectory environment (envs.trajectory_env): one sandbox per trajectory shared by its
tools, opened once and released once with its final workspace captured (over a fake
in-memory provider)."""

from __future__ import annotations

import asyncio
import pickle
import re
from pathlib import Path

import pytest

from envs.pool import SANDBOX_FAULT_EXIT_CODE, SandboxLease
from envs.sandbox.base import ExecResult, SandboxSpec
from envs.tools.base import TOOLS, ToolResult, function_schema, load_tool_class
from envs.tools.sandbox_tools import (SandboxToolSettings, approx_token_count, render_exec_result,
                                      truncate_observation, workspace_relative)
from envs.trajectory_env import EnvBuilder, TrajectoryEnv, load_tool_classes
from envs.types import GradingSpec, Message, Task, WorkspaceChanges

MARKER = re.compile(r"\n\[\.\.\. (\d+) tokens cut \.\.\.\]\n")
TASK = Task("t", (Message("user", "fix it"),), tools=("bash", "read_file", "submit"))


def _result(stdout: str = "", stderr: str = "", code: int = 0, timed_out: bool = False) -> ExecResult:
    return ExecResult(exit_code=code, stdout=stdout, stderr=stderr, timed_out=timed_out,
                      oom_killed=False, output_truncated=False, duration_s=0.01)


def test_text_within_the_budget_is_unchanged() -> None:
    assert truncate_observation("short text", 10) == "short text"
    assert truncate_observation("", 1) == ""


def test_long_text_keeps_head_and_tail_and_counts_the_cut() -> None:
    text = "HEAD" + "x" * 10_000 + "TAIL"
    out = truncate_observation(text, 100)
    assert out.startswith("HEAD") and out.endswith("TAIL")
    assert approx_token_count(out) <= 100
    match = MARKER.search(out)
    assert match is not None
    head, tail = out[:match.start()], out[match.end():]
    assert int(match.group(1)) == approx_token_count(text) - approx_token_count(head) \
        - approx_token_count(tail)
    assert len(head) + len(tail) > 300  # most of the budget is content, not marker


def test_a_tokenizer_based_counter_is_respected() -> None:
    def count_words(text: str) -> int:
        return len(text.split())

    text = " ".join(f"w{i}" for i in range(1000))
    out = truncate_observation(text, 50, count_words)
    assert count_words(out) <= 50 and out.startswith("w0 w1") and out.endswith("w998 w999")
    match = MARKER.search(out)
    assert match is not None and 900 <= int(match.group(1)) <= 960


def test_a_budget_below_the_marker_keeps_only_the_marker() -> None:
    assert truncate_observation("y" * 1000, 1) == "[... 250 tokens cut ...]"
    with pytest.raises(ValueError, match="max_observation_tokens"):
        truncate_observation("x", 0)


def test_exec_results_render_in_a_fixed_format() -> None:
    assert render_exec_result(_result("hi\n"), 30, 100) == "exit code: 0\nstdout:\nhi\nstderr: (empty)"
    assert render_exec_result(_result("a\n\n", "e"), 30, 100) == \
        "exit code: 0\nstdout:\na\n\nstderr:\ne"
    timed_out = render_exec_result(_result(code=137, timed_out=True), 30, 100)
    assert timed_out.startswith("exit code: 137 (killed: timed out after 30 s)\n")
    fault = render_exec_result(_result(stderr="sandbox error: x", code=SANDBOX_FAULT_EXIT_CODE),
                               30, 100)
    assert fault.startswith("exit code: none (the sandbox failed, not the command)\n")


def test_a_long_stream_is_cut_and_a_short_one_kept_whole() -> None:
    rendered = render_exec_result(_result("o" * 40_000, "Traceback: the error\n", code=1), 30, 200)
    assert approx_token_count(rendered) <= 200
    assert rendered.endswith("stderr:\nTraceback: the error")
    assert MARKER.search(rendered) is not None


def test_workspace_paths_are_made_relative() -> None:
    assert workspace_relative("/workspace/src/a.py") == "src/a.py"
    assert workspace_relative("/workspace") == "."
    assert workspace_relative("src/a.py") == "src/a.py"
    assert workspace_relative("/etc/passwd") == "/etc/passwd"  # the sandbox refuses it


class FakeProvider:
    """In-memory SandboxProvider: a dict of files per lease; `bash` prints the file names."""

    def __init__(self, fail_acquire: bool = False, fail_capture: bool = False) -> None:
        self.fail_acquire = fail_acquire
        self.fail_capture = fail_capture
        self.files: dict[str, dict[str, bytes]] = {}
        self.num_acquires = 0
        self.num_releases = 0
        self.num_checkpoints = 0

    async def acquire(self, spec: SandboxSpec) -> SandboxLease:
        await asyncio.sleep(0.01)  # concurrent creates overlap here
        if self.fail_acquire:
            raise OSError("no sandbox for you")
        self.num_acquires += 1
        lease = SandboxLease("fake", f"fake/{self.num_acquires}", False, 0.0)
        self.files[lease.sandbox_id] = {}
        return lease

    async def release(self, lease: SandboxLease) -> None:
        self.num_releases += 1
        del self.files[lease.sandbox_id]

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        return _result(" ".join(sorted(self.files[lease.sandbox_id])))

    async def read_file(self, lease: SandboxLease, path: str) -> bytes:
        return self.files[lease.sandbox_id][path]

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None:
        self.files[lease.sandbox_id][path] = data

    async def checkpoint(self, lease: SandboxLease) -> None:
        self.num_checkpoints += 1

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        data = pickle.dumps(self.files[lease.sandbox_id])
        Path(path).write_bytes(data)
        return len(data)

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        self.files[lease.sandbox_id] = pickle.loads(Path(path).read_bytes())

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        if self.fail_capture:
            raise ConnectionError("the pool actor is gone")
        files = self.files[lease.sandbox_id]  # KeyError once released: capture must come first
        if sum(map(len, files.values())) > max_bytes:
            return WorkspaceChanges(problem="over the cap")
        return WorkspaceChanges(written=dict(files))


def builder(provider: "FakeProvider | None", settings: SandboxToolSettings | None = None,
            extra: dict[str, str] | None = None) -> EnvBuilder:
    return EnvBuilder(load_tool_classes(extra), provider, settings or SandboxToolSettings())


async def run_like_the_worker(envs: EnvBuilder, task: Task, marker: str) -> str:
    """What AgentLoopWorker.run_trajectory does with a trajectory's environment."""
    env = envs.build(task)
    await env.open()
    try:
        await env.tools["write_file"].execute({"path": marker, "content": marker})
        return (await env.tools["bash"].execute({"command": "ls"})).text
    finally:
        await env.release()


async def test_concurrent_trajectories_get_one_sandbox_each_shared_by_their_tools() -> None:
    provider = FakeProvider()
    task = Task("t", TASK.messages, tools=("bash", "write_file", "read_file", "submit"))
    outputs = await asyncio.gather(*(run_like_the_worker(builder(provider), task, f"m{i}")
                                     for i in range(5)))
    # Each trajectory's bash sees exactly the file its own write_file wrote.
    assert outputs == [f"exit code: 0\nstdout:\nm{i}\nstderr: (empty)" for i in range(5)]
    assert (provider.num_acquires, provider.num_releases) == (5, 5)


async def test_trajectories_one_after_another_get_their_own_sandbox() -> None:
    provider = FakeProvider()
    envs = builder(provider)
    task = Task("t", TASK.messages, tools=("bash", "write_file"))
    first = await run_like_the_worker(envs, task, "first")
    second = await run_like_the_worker(envs, task, "second")
    assert first.endswith("stdout:\nfirst\nstderr: (empty)")
    assert second.endswith("stdout:\nsecond\nstderr: (empty)")
    assert (provider.num_acquires, provider.num_releases) == (2, 2)


async def test_release_captures_the_workspace_once_and_returns_the_sandbox_once() -> None:
    provider = FakeProvider()
    env = builder(provider).build(Task("t", TASK.messages, tools=("write_file", "bash", "submit")))
    await env.open()
    await env.tools["write_file"].execute({"path": "fix.txt", "content": "done"})
    captured = await env.release()
    assert captured is not None and captured.written == {"fix.txt": b"done"} and not captured.problem
    assert await env.release() is captured  # a second release changes nothing
    assert (provider.num_acquires, provider.num_releases) == (1, 1)
    result = await env.tools["bash"].execute({"command": "ls"})
    assert result.is_error and "not open" in result.text  # the sandbox is gone for good


async def test_a_failed_capture_is_recorded_and_the_sandbox_still_released() -> None:
    provider = FakeProvider(fail_capture=True)
    env = builder(provider).build(Task("t", TASK.messages, tools=("bash",)))
    await env.open()
    captured = await env.release()
    assert provider.num_releases == 1
    assert captured.written == {} and "ConnectionError: the pool actor is gone" in captured.problem


async def test_changes_over_the_cap_come_back_as_a_problem() -> None:
    provider = FakeProvider()
    env = builder(provider, SandboxToolSettings(max_workspace_changes_bytes=3)).build(
        Task("t", TASK.messages, tools=("write_file",)))
    await env.open()
    await env.tools["write_file"].execute({"path": "big.txt", "content": "four"})
    assert (await env.release()).problem == "over the cap"


async def test_a_failed_acquire_fails_the_open_and_leaks_nothing() -> None:
    provider = FakeProvider(fail_acquire=True)
    env = builder(provider).build(Task("t", TASK.messages, tools=("bash", "read_file")))
    with pytest.raises(OSError):
        await env.open()
    assert await env.release() is None  # no sandbox, nothing to grade
    assert provider.num_releases == 0


async def test_tools_without_a_sandbox_get_none() -> None:
    provider = FakeProvider()
    env = builder(provider).build(Task("t", TASK.messages, tools=("submit", "calculator")))
    await env.open()
    assert env.sandbox is None
    result = await env.tools["submit"].execute({})
    assert result.ends_trajectory and not result.is_error
    assert await env.release() is None and provider.num_acquires == 0


async def test_visible_tests_are_copied_and_checkpointed_but_hidden_ones_are_refused(
        tmp_path: Path) -> None:
    visible, hidden = tmp_path / "visible", tmp_path / "visible" / "hidden"
    hidden.mkdir(parents=True)
    (visible / "test_a.py").write_text("# visible\n")
    (hidden / "test_secret.py").write_text("# hidden\n")
    provider = FakeProvider()
    envs = builder(provider)
    leaky = Task("t", TASK.messages, tools=("run_tests",), visible_tests=str(visible),
                 grading=GradingSpec(hidden_tests=str(hidden)))
    with pytest.raises(ValueError, match="hidden_tests lies inside visible_tests"):
        await envs.build(leaky).open()
    (hidden / "test_secret.py").unlink()
    hidden.rmdir()
    env = envs.build(Task("t", TASK.messages, tools=("run_tests",), visible_tests=str(visible)))
    await env.open()
    lease_files = next(iter(provider.files.values()))
    assert lease_files == {"visible_tests/test_a.py": b"# visible\n"}
    assert provider.num_checkpoints == 1
    await env.release()
    assert provider.num_releases == 2  # the refused open gave its sandbox back too


def test_every_builtin_tool_meets_the_contract_under_its_name() -> None:
    for name, path in TOOLS.builtins.items():
        assert path.startswith("envs.tools.")  # each built-in lives in the package of its table
        cls = load_tool_class(name, path)
        assert cls.name == name and cls.schema["function"]["name"] == name
        assert cls.schema["function"]["parameters"]["additionalProperties"] is False


class ShoutTool:
    """A user tool: registered from a recipe (envs.tools), built per trajectory."""

    name = "shout"
    schema = function_schema("shout", "Upper-case a text.", {"text": {"type": "string"}}, ("text",))

    def __init__(self, env: TrajectoryEnv) -> None:
        self.task_id = env.task.id

    async def execute(self, arguments):
        return ToolResult(f"{self.task_id}: {arguments['text'].upper()}")


async def test_a_recipe_registers_its_own_tool_and_bad_entries_name_the_key() -> None:
    envs = builder(None, extra={"shout": f"{__name__}:ShoutTool"})
    env = envs.build(Task("t7", TASK.messages, tools=("shout", "calculator")))
    await env.open()
    assert (await env.tools["shout"].execute({"text": "hi"})).text == "t7: HI"
    with pytest.raises(ValueError, match=r"envs.tools.bad: .*cannot import 'no_such.module'"):
        load_tool_classes({"bad": "no_such.module:Tool"})
    with pytest.raises(ValueError, match=r"envs.tools.half: .*needs `async def execute"):
        load_tool_classes({"half": f"{__name__}:NotATool"})


class NotATool:
    name = "half"
    schema = function_schema("half", "x", {})

    def execute(self, arguments):  # not async
        return ToolResult("x")


def test_unknown_tools_and_sandbox_tools_without_a_pool_fail_before_any_trajectory() -> None:
    with pytest.raises(ValueError, match=r"unknown tools \['rm_rf'\].*envs.tools"):
        builder(FakeProvider()).check_task(Task("t", TASK.messages, tools=("bash", "rm_rf")))
    with pytest.raises(ValueError, match="uses sandbox tools \\['bash'\\] but this worker has no sandbox"):
        builder(None).check_task(Task("t", TASK.messages, tools=("bash", "submit")))
