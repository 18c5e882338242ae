"""Sandbox tools (bash, python, read_file, write_file, str_replace, run_tests, submit): the
tools an agent works with in its trajectory's sandbox, and `SandboxSession`, that sandbox.

One sandbox per trajectory, owned by the trajectory's environment
(`envs.trajectory_env.TrajectoryEnv`): it opens the session once before the first turn
(acquire from a SandboxProvider, the in-process SandboxPool or its Ray actor, and copy the
task's visible tests into `visible_tests/`, never the hidden ones) and closes it once when
the trajectory ends, which captures the final workspace (`SandboxProvider.
workspace_changes`, computed in the pool) and returns the sandbox. A capture that fails is
recorded as the changes' `problem` (graded 0), never raised, so the sandbox is always
returned. Tools are built as `cls(env)` and reach the session as `env.sandbox`.

Observations are cut to `max_observation_tokens` by `truncate_observation`, keeping head
and tail around a "[... N tokens cut ...]" marker; commands render as exit code, stdout
and stderr in a fixed format.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from envs.pool import (SANDBOX_FAULT_EXIT_CODE, SandboxLease, SandboxProvider,
                       SandboxUnavailableError)
from envs.sandbox.base import (WORKSPACE_MOUNT, ExecResult, SandboxLimits, SandboxSpec,
                               build_sandbox_limits)
from envs.sandbox.changes import MAX_CHANGED_BYTES
from envs.sandbox.images import task_source_dir
from envs.sandbox.output import split_budget
from envs.tools.base import ToolResult, function_schema
from envs.types import JsonObject, JsonValue, Task, WorkspaceChanges
from envs.config import EnvsConfig

if TYPE_CHECKING:
    from envs.trajectory_env import TrajectoryEnv

log = logging.getLogger(__name__)

# pytest where the sandbox's python has it, else unittest (which only collects TestCase
# classes); {tests} is the quoted folder of the visible tests.
DEFAULT_TEST_COMMAND = ("if python3 -c 'import pytest' 2>/dev/null; "
                        "then python3 -m pytest -q -p no:cacheprovider {tests}; "
                        "else python3 -m unittest discover -v -s {tests}; fi")
_MAX_FIT_ROUNDS = 32
_SNIPPET_CONTEXT_LINES = 3


def approx_token_count(text: str) -> int:
    """About 4 characters per token: the default when no tokenizer is passed in."""
    return (len(text) + 3) // 4


def _cut_marker(num_tokens: int) -> str:
    return f"\n[... {num_tokens} tokens cut ...]\n"


def truncate_observation(text: str, max_tokens: int,
                         count_tokens: Callable[[str], int] = approx_token_count) -> str:
    """`text` if it fits in `max_tokens`, else its head and tail around a marker naming
    the tokens cut, fitting in `max_tokens` (only the marker when even it does not)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}; raise "
                         "envs.max_observation_tokens")
    total = count_tokens(text)
    if total <= max_tokens:
        return text
    keep = len(text) * max_tokens // total  # characters kept, refined below
    for _ in range(_MAX_FIT_ROUNDS):
        if keep <= 0:
            break
        head, tail = text[:keep // 2], text[len(text) - (keep - keep // 2):]
        cut = max(0, total - count_tokens(head) - count_tokens(tail))
        out = head + _cut_marker(cut) + tail
        used = count_tokens(out)
        if used <= max_tokens:
            return out
        # Shrink in proportion to the overshoot, and always by something.
        keep = min(keep - 1, keep * max_tokens // used)
    return _cut_marker(total).strip("\n")


def render_exec_result(result: ExecResult, timeout_s: float, max_tokens: int,
                       count_tokens: Callable[[str], int] = approx_token_count) -> str:
    """The fixed format the model sees: a status line, then stdout and stderr, each cut
    to its share of `max_tokens` (what one stream does not need goes to the other)."""
    if result.exit_code == SANDBOX_FAULT_EXIT_CODE:
        status = "exit code: none (the sandbox failed, not the command)"
    else:
        status = f"exit code: {result.exit_code}"
    if result.timed_out:
        status += f" (killed: timed out after {timeout_s:g} s)"
    if result.oom_killed:
        status += " (a process was killed: out of memory)"
    header_tokens = count_tokens(f"{status}\nstdout:\n\nstderr:\n")
    budget = max(2, max_tokens - header_tokens)
    out_budget, err_budget = split_budget(
        (count_tokens(result.stdout), count_tokens(result.stderr)), budget)
    parts = [status]
    for label, text, tokens in (("stdout", result.stdout, out_budget),
                                ("stderr", result.stderr, err_budget)):
        if text:
            # One trailing newline is implied by the layout; more are shown as blank lines.
            cut = truncate_observation(text, max(1, tokens), count_tokens).removesuffix("\n")
            parts.append(f"{label}:\n{cut}")
        else:
            parts.append(f"{label}: (empty)")
    return "\n".join(parts)


@dataclass(frozen=True, slots=True)
class SandboxToolSettings:
    """What sandbox tools need from the recipe (`build_sandbox_tool_settings`)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)  # of per-task sandboxes
    exec_timeout_s: float = 30.0  # wall-clock limit of one bash/python/run_tests command
    max_observation_tokens: int = 1024  # of one tool result, marker included
    count_tokens: Callable[[str], int] = approx_token_count  # e.g. a tokenizer's length
    visible_tests_dir: str = "visible_tests"  # workspace folder the visible tests go to
    test_command: str = DEFAULT_TEST_COMMAND  # shell command of run_tests; {tests}: that folder
    max_workspace_changes_bytes: int = MAX_CHANGED_BYTES  # cap of the captured final workspace

    def __post_init__(self) -> None:
        if self.exec_timeout_s <= 0:
            raise ValueError(f"envs.exec_timeout_s={self.exec_timeout_s} must be > 0")
        if self.max_workspace_changes_bytes < 1:
            raise ValueError("envs.max_workspace_changes_mb must be >= 1")
        if self.max_observation_tokens < 16:
            raise ValueError(f"envs.max_observation_tokens={self.max_observation_tokens} leaves "
                             "no room for a command's output; use at least 16")


def build_sandbox_tool_settings(envs: EnvsConfig, count_tokens: Callable[[str], int] | None = None
                                ) -> SandboxToolSettings:
    return SandboxToolSettings(limits=build_sandbox_limits(envs),
                               exec_timeout_s=envs.exec_timeout_s,
                               max_observation_tokens=envs.max_observation_tokens,
                               count_tokens=count_tokens or approx_token_count,
                               max_workspace_changes_bytes=envs.max_workspace_changes_mb << 20)


class SandboxSession:
    """One trajectory's sandbox (see the module docstring): opened once, closed once."""

    def __init__(self, provider: SandboxProvider, settings: SandboxToolSettings) -> None:
        self.provider = provider
        self.settings = settings
        self.lease: SandboxLease | None = None
        self.has_visible_tests = False
        self.workdir = WORKSPACE_MOUNT  # where the workspace appears (the task's workdir)
        self._closed = False

    async def open(self, task: Task) -> None:
        """Acquire the sandbox for `task` and copy its visible tests in."""
        if self.lease is not None or self._closed:
            raise RuntimeError("a sandbox session is opened once per trajectory")
        self.workdir = task.workdir or WORKSPACE_MOUNT
        # An image-only task's workspace starts as the image's repository, read out here
        # (this worker's node is its sandbox pool's node).
        source = await asyncio.to_thread(task_source_dir, task)
        spec = SandboxSpec(source_dir=source, image=task.image, limits=self.settings.limits,
                           workdir=self.workdir)
        lease = await self.provider.acquire(spec)
        try:
            await self._copy_visible_tests(lease, task)
        except BaseException:  # cancellation too: the lease goes back before the error goes on
            await self.provider.release(lease)
            raise
        self.lease = lease

    async def _copy_visible_tests(self, lease: SandboxLease, task: Task) -> None:
        if task.visible_tests is None:
            return
        root = Path(task.visible_tests)
        if not root.is_dir():
            raise ValueError(f"task {task.id!r}: visible_tests={task.visible_tests!r} is not a "
                             "folder on this host; fix the task or drop the field")
        if task.grading.hidden_tests is not None:
            hidden = Path(task.grading.hidden_tests).resolve()
            if hidden == root.resolve() or root.resolve() in hidden.parents:
                raise ValueError(f"task {task.id!r}: hidden_tests lies inside visible_tests, so "
                                 "the agent would see them; keep the two folders apart")
        files = await asyncio.to_thread(_files_under, root)
        for path in files:
            data = await asyncio.to_thread(path.read_bytes)
            rel = path.relative_to(root).as_posix()
            await self.provider.write_file(lease, f"{self.settings.visible_tests_dir}/{rel}", data)
        # Taken now: a crash before the first snapshot would otherwise lose the tests.
        await self.provider.checkpoint(lease)
        self.has_visible_tests = True

    async def close(self) -> WorkspaceChanges | None:
        """Capture the final workspace and return the sandbox; None if it was never
        opened. Later calls return None: the sandbox is released exactly once."""
        self._closed = True
        lease, self.lease = self.lease, None
        if lease is None:
            return None
        try:
            return await self._capture(lease)
        finally:
            await self.provider.release(lease)

    async def _capture(self, lease: SandboxLease) -> WorkspaceChanges:
        try:
            return await self.provider.workspace_changes(
                lease, self.settings.max_workspace_changes_bytes)
        except Exception as exc:  # whatever broke, the trajectory ends graded 0, not lost
            # Whatever broke (the backend's snapshot, the pool actor), the trajectory is
            # over: record why its workspace is missing, so it is graded 0 and counted,
            # and still release the sandbox.
            log.warning("capturing the final workspace of %s failed: %s", lease.sandbox_id, exc)
            return WorkspaceChanges(problem=f"the final workspace could not be captured: "
                                    f"{type(exc).__name__}: {exc}")

    def _open_lease(self) -> SandboxLease:
        if self.lease is None:
            raise ValueError("the sandbox is not open (the trajectory's environment opens it "
                             "before the first turn, and closes it when the trajectory ends)")
        return self.lease

    async def exec(self, cmd: str | list[str], stdin: str | None = None) -> ExecResult:
        return await self.provider.exec(self._open_lease(), cmd, self.settings.exec_timeout_s,
                                        stdin)

    async def read_file(self, path: str) -> bytes:
        return await self.provider.read_file(self._open_lease(), path)

    async def write_file(self, path: str, data: bytes) -> None:
        await self.provider.write_file(self._open_lease(), path, data)
        if path.endswith(".py"):
            await self._forget_bytecode(path)

    async def save_state(self, path: str) -> int:
        """The workspace now, kept at `path` on this node (a durable trajectory's turn
        boundary, rollout.durable); its bytes."""
        return await self.provider.save_state(self._open_lease(), path)

    async def restore_state(self, path: str) -> None:
        """Put the workspace `save_state` kept at `path` back (a continued trajectory)."""
        await self.provider.restore_state(self._open_lease(), path)

    async def _forget_bytecode(self, path: str) -> None:
        """Delete the cached bytecode of an edited module. Python trusts a .pyc whose
        source has the same size and mtime second, so a same-size edit right after an
        import (a - b -> a + b) would otherwise keep running the old code."""
        folder, _, name = path.rpartition("/")
        script = 'rm -f -- "$1"/__pycache__/"$2".*.pyc'
        await self.exec(["sh", "-c", script, "sh", folder or ".", name.removesuffix(".py")])

    def observe(self, result: ExecResult) -> ToolResult:
        s = self.settings
        text = render_exec_result(result, s.exec_timeout_s, s.max_observation_tokens,
                                  s.count_tokens)
        return ToolResult(text, is_error=result.timed_out
                          or result.exit_code == SANDBOX_FAULT_EXIT_CODE)

    def truncate(self, text: str) -> str:
        return truncate_observation(text, self.settings.max_observation_tokens,
                                    self.settings.count_tokens)


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                  and "__pycache__" not in p.parts)


def workspace_relative(path: str, workdir: str = WORKSPACE_MOUNT) -> str:
    """Models often write /workspace/x (or /testbed/x, the task's workdir) for the
    workspace's x; the sandbox wants x."""
    if path == workdir:
        return "."
    prefix = workdir + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def _str_arg(arguments: JsonObject, key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ValueError(f"argument {key!r} must be a string")
    return value


def _int_arg(arguments: JsonObject, key: str) -> int | None:
    """An optional integer argument; a numeric string (as some models write) is read too."""
    value = arguments.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"argument {key!r} must be an integer, got {value!r}")


def _decode_text(data: bytes, path: str) -> str:
    if b"\0" in data:
        raise ValueError(f"{path} is a binary file ({len(data)} bytes); inspect it with bash")
    return data.decode("utf-8", errors="replace")


def _numbered(lines: Sequence[str], first_line: int) -> str:
    return "\n".join(f"{first_line + i:6}\t{line}" for i, line in enumerate(lines))


class _SandboxTool:
    """Shared base of the tools that work in the trajectory's sandbox; subclasses set
    `name` and `schema` and implement `_run`. Expected failures (bad paths, missing
    files, a sandbox that is gone) become error results the model can act on."""

    name: ClassVar[str]
    schema: ClassVar[dict[str, JsonValue]]
    needs_sandbox: ClassVar[bool] = True

    def __init__(self, env: "TrajectoryEnv") -> None:
        if env.sandbox is None:
            raise ValueError(f"tool {self.name!r} needs a sandbox, and this trajectory's "
                             "environment has none (no sandbox pool was given)")
        self.session = env.sandbox

    async def execute(self, arguments: JsonObject) -> ToolResult:
        try:
            return await self._run(arguments)
        except (ValueError, OSError, SandboxUnavailableError) as exc:
            return ToolResult(f"Error: {exc}", is_error=True)

    async def _run(self, arguments: JsonObject) -> ToolResult:
        raise NotImplementedError


class BashTool(_SandboxTool):
    name = "bash"
    schema = function_schema(
        "bash", "Run a bash command in the workspace (the repository folder the task names, "
        f"{WORKSPACE_MOUNT} unless it says otherwise). No network; files "
        "outside the workspace are read-only and /tmp is cleared after each command.",
        {"command": {"type": "string", "description": "The command, e.g. `ls -la`."}},
        required=("command",))

    async def _run(self, arguments: JsonObject) -> ToolResult:
        command = _str_arg(arguments, "command")
        return self.session.observe(await self.session.exec(["bash", "-c", command]))


class PythonTool(_SandboxTool):
    name = "python"
    schema = function_schema(
        "python", "Run a Python 3 program in the workspace and show its output; use print.",
        {"code": {"type": "string", "description": "The program's source code."}},
        required=("code",))

    async def _run(self, arguments: JsonObject) -> ToolResult:
        # Through stdin: no size limit of one argv entry, and no file left behind.
        result = await self.session.exec(["python3", "-"], stdin=_str_arg(arguments, "code"))
        return self.session.observe(result)


class ReadFileTool(_SandboxTool):
    name = "read_file"
    schema = function_schema(
        "read_file", "Show a text file of the workspace with line numbers, optionally only "
        "lines start_line..end_line (1-based, inclusive).",
        {"path": {"type": "string", "description": "Path relative to the workspace."},
         "start_line": {"type": "integer", "description": "First line to show (default 1)."},
         "end_line": {"type": "integer", "description": "Last line to show (default: the end)."}},
        required=("path",))

    async def _run(self, arguments: JsonObject) -> ToolResult:
        path = workspace_relative(_str_arg(arguments, "path"), self.session.workdir)
        lines = _decode_text(await self.session.read_file(path), path).splitlines()
        if not lines:
            return ToolResult(f"{path} is empty.")
        start, end = _line_range(arguments, len(lines), path)
        return ToolResult(self.session.truncate(_numbered(lines[start - 1:end], start)))


def _line_range(arguments: JsonObject, num_lines: int, path: str) -> tuple[int, int]:
    start = _int_arg(arguments, "start_line") or 1
    end = _int_arg(arguments, "end_line") or num_lines
    if start > num_lines:
        raise ValueError(f"start_line={start} is past the end of {path} ({num_lines} lines)")
    if start < 1 or end < start:
        raise ValueError(f"line range {start}..{end} is invalid; use 1 <= start_line <= end_line")
    return start, min(end, num_lines)


class WriteFileTool(_SandboxTool):
    name = "write_file"
    schema = function_schema(
        "write_file", "Create or overwrite a file of the workspace with the given content "
        "(folders are created as needed).",
        {"path": {"type": "string", "description": "Path relative to the workspace."},
         "content": {"type": "string", "description": "The complete new content."}},
        required=("path", "content"))

    async def _run(self, arguments: JsonObject) -> ToolResult:
        path = workspace_relative(_str_arg(arguments, "path"), self.session.workdir)
        data = _str_arg(arguments, "content").encode()
        await self.session.write_file(path, data)
        return ToolResult(f"Wrote {len(data)} bytes to {path}.")


class StrReplaceTool(_SandboxTool):
    name = "str_replace"
    schema = function_schema(
        "str_replace", "Replace the one occurrence of `old` in a file by `new`. `old` must "
        "match exactly once, whitespace and indentation included; add surrounding lines "
        "to make it unique.",
        {"path": {"type": "string", "description": "Path relative to the workspace."},
         "old": {"type": "string", "description": "Exact text to replace."},
         "new": {"type": "string", "description": "Replacement text."}},
        required=("path", "old", "new"))

    async def _run(self, arguments: JsonObject) -> ToolResult:
        path = workspace_relative(_str_arg(arguments, "path"), self.session.workdir)
        old, new = _str_arg(arguments, "old"), _str_arg(arguments, "new")
        if not old:
            raise ValueError("`old` is empty; give the exact text to replace (use write_file "
                             "to create a file)")
        if old == new:
            raise ValueError("`old` and `new` are identical; nothing would change")
        text = _decode_text(await self.session.read_file(path), path)
        starts = _occurrences(text, old)
        if not starts:
            raise ValueError(f"`old` was not found in {path}; nothing was changed. It must match "
                             "exactly, whitespace and indentation included; read_file shows "
                             "the current content")
        if len(starts) > 1:
            lines = ", ".join(str(text.count("\n", 0, s) + 1) for s in starts[:10])
            raise ValueError(f"`old` occurs {len(starts)} times in {path} (lines {lines}); "
                             "nothing was changed. Include more surrounding lines to make it "
                             "unique")
        edited = text[:starts[0]] + new + text[starts[0] + len(old):]
        await self.session.write_file(path, edited.encode())
        return ToolResult(self.session.truncate(_edit_snippet(edited, starts[0], new, path)))


def _occurrences(text: str, old: str) -> list[int]:
    """Start offsets of `old` in `text`, overlapping ones included (so "aa" in "aaa"
    counts twice: replacing either would be a guess)."""
    found, start = [], text.find(old)
    while start != -1:
        found.append(start)
        start = text.find(old, start + 1)
    return found


def _edit_snippet(edited: str, offset: int, new: str, path: str) -> str:
    lines = edited.splitlines()
    first = edited.count("\n", 0, offset) + 1
    last = first + new.count("\n")
    lo = max(1, first - _SNIPPET_CONTEXT_LINES)
    hi = min(len(lines), last + _SNIPPET_CONTEXT_LINES)
    return (f"Edited {path}: replaced 1 occurrence at line {first}. Lines {lo}-{hi} now read:\n"
            + _numbered(lines[lo - 1:hi], lo))


class RunTestsTool(_SandboxTool):
    name = "run_tests"
    schema = function_schema("run_tests", "Run the task's visible tests and show the results.",
                             {})

    async def _run(self, arguments: JsonObject) -> ToolResult:
        if not self.session.has_visible_tests:
            return ToolResult("Error: this task has no visible tests to run.", is_error=True)
        s = self.session.settings
        command = s.test_command.format(tests=shlex.quote(s.visible_tests_dir))
        return self.session.observe(await self.session.exec(["bash", "-c", command]))


class SubmitTool:
    """Ends the trajectory. Needs no sandbox, so a task offering only `submit` gets none."""

    name = "submit"
    schema = function_schema("submit", "Submit your work and end the task. Call it once you "
                             "are done; nothing can be changed afterwards.", {})

    def __init__(self, env: "TrajectoryEnv | None" = None) -> None:
        pass

    async def execute(self, arguments: JsonObject) -> ToolResult:
        return ToolResult("Submitted.", ends_trajectory=True)
