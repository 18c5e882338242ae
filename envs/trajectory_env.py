"""The per-trajectory environment: one object per trajectory owns its tools, its sandbox
lease and its final workspace. It is made once (`EnvBuilder.build`), opened once before
the first turn, and released once when the trajectory ends, whatever the ending; the
final workspace it captured stays with the worker that ran the trajectory and goes to
grading there, never into the Trajectory.

    EnvBuilder(tool classes, sandbox provider, settings)
        .check_task(task)      unknown tools / sandbox tools without a provider -> ValueError
        .build(task) -> TrajectoryEnv
    env.open()                 opens the sandbox if any of the task's tools needs one
    env.tools                  name -> Tool, each built as cls(env)
    env.save_state(path) / env.restore_state(path)   the sandbox's workspace kept on this
                               node, and put back (a durable trajectory, rollout.durable)
    env.release() -> WorkspaceChanges | None   capture + return the sandbox, exactly once
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from envs.pool import SandboxProvider
from envs.tools.base import TOOLS, Tool, ToolClass, load_tool_class, needs_sandbox
from envs.tools.sandbox_tools import SandboxSession, SandboxToolSettings
from envs.types import JsonValue, Task, WorkspaceChanges

log = logging.getLogger(__name__)


def load_tool_classes(extra: Mapping[str, str] | None = None) -> dict[str, ToolClass]:
    """Every built-in tool plus `extra` (envs.tools: name -> built-in name or import string),
    each resolved and checked against the tool contract; ValueError names the bad entry."""
    names = {**{n: n for n in TOOLS.builtins}, **dict(extra or {})}
    out: dict[str, ToolClass] = {}
    for name, ref in names.items():
        try:
            out[name] = load_tool_class(name, ref)
        except ValueError as exc:
            raise ValueError(f"envs.tools.{name}: {exc}") from exc
    return out


class TrajectoryEnv:
    """One trajectory's tools, sandbox and final workspace (see the module docstring)."""

    def __init__(self, task: Task, tool_classes: Mapping[str, ToolClass],
                 sandbox: SandboxSession | None) -> None:
        self.task = task
        self.sandbox = sandbox  # None: none of the task's tools works in a sandbox
        self.final_workspace: WorkspaceChanges | None = None
        self._tool_classes = dict(tool_classes)
        self.tools: dict[str, Tool] = {}
        self._opened = self._released = False

    async def open(self) -> None:
        """Open the sandbox (if any) and build the tools; once."""
        if self._opened:
            raise RuntimeError("a trajectory's environment is opened once")
        self._opened = True
        if self.sandbox is not None:
            await self.sandbox.open(self.task)
        self.tools = {name: cls(self) for name, cls in self._tool_classes.items()}

    @property
    def tool_schemas(self) -> list[Mapping[str, JsonValue]]:
        return [t.schema for t in self.tools.values()]

    async def save_state(self, path: str) -> int:
        """The sandbox's workspace now, kept at `path`; 0 without a sandbox (the tools'
        effects then live in no state the environment holds)."""
        return await self.sandbox.save_state(path) if self.sandbox is not None else 0

    async def restore_state(self, path: str) -> None:
        if self.sandbox is None:
            raise ValueError("this trajectory's environment has no sandbox to restore")
        await self.sandbox.restore_state(path)

    async def release(self) -> WorkspaceChanges | None:
        """Capture the final workspace and return the sandbox. Safe to call after a failed
        open or twice: the sandbox is released exactly once, the capture kept."""
        if self._released:
            return self.final_workspace
        self._released = True
        if self.sandbox is not None:
            self.final_workspace = await self.sandbox.close()
        return self.final_workspace


class EnvBuilder:
    """Makes the TrajectoryEnv of each trajectory of one worker."""

    def __init__(self, tool_classes: Mapping[str, ToolClass], provider: SandboxProvider | None = None,
                 settings: SandboxToolSettings | None = None) -> None:
        self.tool_classes = dict(tool_classes)
        self.provider = provider
        self.settings = settings or SandboxToolSettings()

    def check_task(self, task: Task) -> None:
        """ValueError, before any trajectory runs, for a task this worker cannot serve."""
        unknown = [t for t in task.tools if t not in self.tool_classes]
        if unknown:
            raise ValueError(f"task {task.id!r} names unknown tools {unknown}; registered: "
                             f"{sorted(self.tool_classes)} (add yours under envs.tools)")
        if self.provider is None:
            boxed = [t for t in task.tools if needs_sandbox(self.tool_classes[t])]
            if boxed:
                raise ValueError(f"task {task.id!r} uses sandbox tools {boxed} but this worker "
                                 "has no sandbox pool (envs.num_sandbox_workers)")

    def build(self, task: Task) -> TrajectoryEnv:
        self.check_task(task)
        classes = {name: self.tool_classes[name] for name in task.tools}
        session = None
        if self.provider is not None and any(needs_sandbox(c) for c in classes.values()):
            session = SandboxSession(self.provider, self.settings)
        return TrajectoryEnv(task, classes, session)
