"""Sandbox tools without a sandbox: observation truncation and rendering, and how the
tools of one trajectory come to share one session (over a fake in-memory provider)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from envs.pool import SANDBOX_FAULT_EXIT_CODE, SandboxLease
from envs.sandbox.base import ExecResult, SandboxSpec
from envs.tools.sandbox_tools import (SANDBOX_TOOLS, SandboxToolSettings, approx_token_count,
                                      build_sandbox_tool_factories, build_sandbox_tools,
                                      load_sandbox_tool, render_exec_result, truncate_observation,
                                      workspace_relative)
from envs.types import Message, Task, WorkspaceChanges

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

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        if self.fail_capture:
            raise ConnectionError("the pool actor is gone")
        files = self.files[lease.sandbox_id]  # KeyError once released: capture must come first
        if sum(map(len, files.values())) > max_bytes:
            return WorkspaceChanges(problem="over the cap")
        return WorkspaceChanges(written=dict(files))


async def run_like_the_worker(factories: dict, task: Task, marker: str) -> str:
    """What AgentLoopWorker.run_trajectory does with tools, in the caller's task."""
    tools = {name: factories[name]() for name in task.tools}
    await asyncio.gather(*(t.create(task) for t in tools.values()))
    try:
        await tools["write_file"].execute({"path": marker, "content": marker})
        return (await tools["bash"].execute({"command": "ls"})).text
    finally:
        await asyncio.gather(*(t.release() for t in tools.values()))


async def test_concurrent_trajectories_get_one_sandbox_each_shared_by_their_tools() -> None:
    provider = FakeProvider()
    factories = build_sandbox_tool_factories(provider, SandboxToolSettings())
    task = Task("t", TASK.messages, tools=("bash", "write_file", "read_file", "submit"))
    outputs = await asyncio.gather(*(run_like_the_worker(factories, task, f"m{i}")
                                     for i in range(5)))
    # Each trajectory's bash sees exactly the file its own write_file wrote.
    assert outputs == [f"exit code: 0\nstdout:\nm{i}\nstderr: (empty)" for i in range(5)]
    assert (provider.num_acquires, provider.num_releases) == (5, 5)


async def test_concurrent_trajectories_with_disjoint_tools_do_not_share() -> None:
    # Built back to back before either opens: only the per-task ContextVar tells them apart.
    provider = FakeProvider()
    factories = build_sandbox_tool_factories(provider, SandboxToolSettings())

    async def trajectory(names: tuple[str, ...]) -> None:
        task = Task("t", TASK.messages, tools=names)
        tools = {name: factories[name]() for name in task.tools}
        await asyncio.gather(*(t.create(task) for t in tools.values()))
        await asyncio.gather(*(t.release() for t in tools.values()))

    await asyncio.gather(trajectory(("bash", "python")), trajectory(("read_file", "write_file")))
    assert (provider.num_acquires, provider.num_releases) == (2, 2)


async def test_trajectories_run_one_after_another_in_one_task_do_not_share() -> None:
    provider = FakeProvider()
    factories = build_sandbox_tool_factories(provider, SandboxToolSettings())
    task = Task("t", TASK.messages, tools=("bash", "write_file"))
    first = await run_like_the_worker(factories, task, "first")
    second = await run_like_the_worker(factories, task, "second")
    assert first.endswith("stdout:\nfirst\nstderr: (empty)")
    assert second.endswith("stdout:\nsecond\nstderr: (empty)")
    assert (provider.num_acquires, provider.num_releases) == (2, 2)


async def test_the_sandbox_is_released_with_the_last_tool() -> None:
    provider = FakeProvider()
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["bash", "read_file"])
    await asyncio.gather(*(t.create(TASK) for t in tools.values()))
    await tools["bash"].release()
    assert provider.num_releases == 0
    await tools["read_file"].release()
    assert (provider.num_acquires, provider.num_releases) == (1, 1)


async def test_the_last_release_captures_the_workspace_before_returning_the_sandbox() -> None:
    provider = FakeProvider()
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["write_file", "bash", "submit"])
    await asyncio.gather(*(t.create(TASK) for t in tools.values()))
    await tools["write_file"].execute({"path": "fix.txt", "content": "done"})
    await tools["write_file"].release()
    assert tools["bash"].final_workspace is None  # the sandbox is still in use
    await asyncio.gather(tools["bash"].release(), tools["submit"].release())
    assert provider.num_releases == 1
    captured = tools["bash"].final_workspace
    assert captured is tools["write_file"].final_workspace  # one capture per session
    assert captured.written == {"fix.txt": b"done"} and captured.problem == ""


async def test_a_failed_capture_is_recorded_and_the_sandbox_still_released() -> None:
    provider = FakeProvider(fail_capture=True)
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["bash"])
    await tools["bash"].create(TASK)
    await tools["bash"].release()
    assert provider.num_releases == 1
    captured = tools["bash"].final_workspace
    assert captured.written == {} and "ConnectionError: the pool actor is gone" in captured.problem


async def test_changes_over_the_cap_come_back_as_a_problem() -> None:
    provider = FakeProvider()
    tools = build_sandbox_tools(provider, SandboxToolSettings(max_workspace_changes_bytes=3),
                                ["write_file"])
    await tools["write_file"].create(TASK)
    await tools["write_file"].execute({"path": "big.txt", "content": "four"})
    await tools["write_file"].release()
    assert tools["write_file"].final_workspace.problem == "over the cap"


async def test_a_failed_acquire_fails_every_create_and_leaks_nothing() -> None:
    provider = FakeProvider(fail_acquire=True)
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["bash", "read_file"])
    results = await asyncio.gather(*(t.create(TASK) for t in tools.values()),
                                   return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)
    result = await tools["bash"].execute({"command": "ls"})
    assert result.is_error and "not open" in result.text
    await asyncio.gather(*(t.release() for t in tools.values()))
    assert provider.num_releases == 0
    assert tools["bash"].final_workspace is None  # no sandbox, nothing to grade


async def test_submit_alone_needs_no_sandbox_and_ends_the_trajectory() -> None:
    provider = FakeProvider()
    factories = build_sandbox_tool_factories(provider, SandboxToolSettings(), ["submit"])
    submit = factories["submit"]()
    await submit.create(TASK)
    result = await submit.execute({})
    assert result.ends_trajectory and not result.is_error
    await submit.release()
    assert provider.num_acquires == 0


async def test_visible_tests_are_copied_and_checkpointed_but_hidden_ones_are_refused(
        tmp_path: Path) -> None:
    visible, hidden = tmp_path / "visible", tmp_path / "visible" / "hidden"
    hidden.mkdir(parents=True)
    (visible / "test_a.py").write_text("# visible\n")
    (hidden / "test_secret.py").write_text("# hidden\n")
    provider = FakeProvider()
    leaky = Task("t", TASK.messages, visible_tests=str(visible), hidden_tests=str(hidden))
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["run_tests"])
    with pytest.raises(ValueError, match="hidden_tests lies inside visible_tests"):
        await tools["run_tests"].create(leaky)
    (hidden / "test_secret.py").unlink()
    hidden.rmdir()
    tools = build_sandbox_tools(provider, SandboxToolSettings(), ["run_tests"])
    await tools["run_tests"].create(Task("t", TASK.messages, visible_tests=str(visible)))
    lease_files = next(iter(provider.files.values()))
    assert lease_files == {"visible_tests/test_a.py": b"# visible\n"}
    assert provider.num_checkpoints == 1
    await tools["run_tests"].release()
    assert provider.num_releases == 2  # the refused session gave its sandbox back too


def test_the_registry_names_match_the_tools_and_unknown_names_fail() -> None:
    for name, path in SANDBOX_TOOLS.items():
        cls = load_sandbox_tool(path)
        assert cls.name == name and cls.schema["function"]["name"] == name
        assert cls.schema["function"]["parameters"]["additionalProperties"] is False
    with pytest.raises(ValueError, match="unknown sandbox tools"):
        build_sandbox_tool_factories(FakeProvider(), SandboxToolSettings(), ["bash", "rm_rf"])
