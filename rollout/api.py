"""The public API for plug-ins: what a user's own package imports to write an agent loop,
a tool or a reward function, in one place.

    from rollout.api import AgentContext, Message, RewardResult, Task, ToolResult, ...

Everything a plug-in needs is here (the names in `__all__`, snapshotted in
tests/unit/public_api.txt); docs/custom_agent.md and examples/ import only from this
module. The names keep working across releases: one that moves or is renamed stays
importable from here for at least one release, served through `__getattr__` from
`MOVED` with a DeprecationWarning, once, that names its new home. The modules these names
are defined in are internal and may be reorganised behind this one.

It lives in `rollout` because rollout is the lowest package that sees every piece
(shared types and tools from envs, rewards from reward, loops and parsing from rollout).
"""

from __future__ import annotations

import warnings

from envs.tools.base import Tool, ToolResult, function_schema
from envs.trajectory_env import TrajectoryEnv
from envs.types import (Content, GradingSpec, Group, Image, JsonObject, JsonValue, Message, Task,
                        TerminationReason, ToolCall, Trajectory, TrajectoryImage, Turn, WorkspaceChanges)
from reward.base import RewardContext, RewardFn, RewardResult
from reward.rules import extract_final_answer
from rollout.agent_loop import (AgentContext, AgentLoop, LoopSettings, SingleTurnLoop,
                                ToolAgentLoop, ToolOutcome)
from rollout.engine import TokenOutput
from rollout.parsers import parse_generation
from rollout.recorder import BudgetExhausted, TrajectoryRecorder
from rollout.tool_parser import ParsedTurn

__all__ = [
    # the shared types: tasks in, trajectories out
    "Task", "GradingSpec", "Message", "ToolCall", "Trajectory", "Turn", "Group",
    "TerminationReason", "WorkspaceChanges", "JsonObject", "JsonValue",
    # images: a message's content parts, and where a trajectory keeps each image
    "Image", "Content", "TrajectoryImage",
    # agent loops: the protocol, the built-ins to extend, and what a loop from scratch calls
    "AgentLoop", "AgentContext", "ToolAgentLoop", "SingleTurnLoop", "ToolOutcome",
    "LoopSettings", "TrajectoryRecorder", "BudgetExhausted", "TokenOutput", "ParsedTurn",
    "parse_generation",
    # tools
    "Tool", "ToolResult", "function_schema", "TrajectoryEnv",
    # rewards
    "RewardFn", "RewardResult", "RewardContext", "extract_final_answer",
]

# A public name that left this module: its new "module:name", served with a warning.
MOVED: dict[str, str] = {}
_warned: set[str] = set()


def __getattr__(name: str) -> object:
    if name not in MOVED:
        raise AttributeError(f"module 'rollout.api' has no attribute {name!r}")
    module, _, attr = MOVED[name].partition(":")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"rollout.api.{name} moved to {module}.{attr}; import it from there "
                      "(this alias goes in a later release)", DeprecationWarning, stacklevel=2)
    import importlib

    return getattr(importlib.import_module(module), attr)
