"""The Tool protocol: one instance per trajectory, created, executed any number of times,
optionally scored, then released.

A tool describes itself with an OpenAI function schema (what the chat template shows the
model). `execute` returns a ToolResult; raising is allowed, the agent loop turns the
exception into an error observation, but expected failures should come back as results
with `is_error=True` and a message the model can act on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from envs.types import Task, WorkspaceChanges


@dataclass(frozen=True, slots=True)
class ToolResult:
    text: str  # the observation shown to the model
    is_error: bool = False
    ends_trajectory: bool = False  # e.g. `submit`: the trajectory finishes after this turn


class Tool(Protocol):
    """One trajectory's instance of a tool."""

    name: str

    @property
    def schema(self) -> Mapping[str, Any]:
        """OpenAI function schema: {"type": "function", "function": {name, description, parameters}}."""
        ...

    async def create(self, task: Task) -> None: ...

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult: ...

    async def calc_reward(self) -> float | None: ...

    async def release(self) -> None: ...


@runtime_checkable
class WorkspaceTool(Protocol):
    """A tool that works in the trajectory's sandbox and captures its final workspace when
    released (the sandbox tools). Optional: the worker looks for it after releasing a
    trajectory's tools and puts the capture on the Trajectory for grading."""

    @property
    def final_workspace(self) -> WorkspaceChanges | None:
        """The changes against the task source once released; None if no sandbox was used."""
        ...


def final_workspace(tools: Iterable[Tool]) -> WorkspaceChanges | None:
    """The workspace captured by the released `tools` of one trajectory, if any (its
    sandbox tools share one sandbox, so they all report the same capture)."""
    for tool in tools:
        if isinstance(tool, WorkspaceTool) and (found := tool.final_workspace) is not None:
            return found
    return None


# Builds a fresh Tool for one trajectory.
ToolFactory = Callable[[], Tool]


def function_schema(name: str, description: str, properties: Mapping[str, Any],
                    required: tuple[str, ...] = ()) -> dict[str, Any]:
    """An OpenAI function schema with a closed set of arguments."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties),
                       "required": list(required), "additionalProperties": False}}}
