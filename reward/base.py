"""The RewardFn plug-in point: what a reward function receives (trajectory, task, context),
what it returns (RewardResult), and the import-string resolution with the built-ins.

A RewardFn scores one terminal trajectory. It never sees the agent's live sandbox: the
caller hands over the final assistant text and the agent's final workspace as values
(RewardContext), so grading can run anywhere and the agent cannot act on it any more.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from envs.plugins import PluginPoint, signature_problem
from envs.sandbox.base import Sandbox, SandboxSpec
from envs.types import Task, Trajectory
from reward.config import HACK_POLICIES, HackPolicy
from reward.workspace import WorkspaceChanges

if TYPE_CHECKING:
    from reward.judge import JudgeClient

# Creates a fresh sandbox for grading (e.g. `LocalSandbox.create` or a pool's factory).
SandboxFactory = Callable[[SandboxSpec], Awaitable[Sandbox]]


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A score: the scalar GRPO trains on, named parts for metrics, and a human-readable
    account of how it was reached (for transcripts; never parsed)."""

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"RewardResult.reward must be a finite number, got {self.reward!r}")
        components = {k: float(v) for k, v in dict(self.components).items()}
        bad = [k for k, v in components.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"RewardResult components {bad} are not finite")
        object.__setattr__(self, "reward", float(self.reward))
        object.__setattr__(self, "components", components)


@dataclass(frozen=True, slots=True)
class RewardContext:
    """What the caller hands a RewardFn besides the trajectory and the task."""

    final_text: str = ""  # the last assistant turn as text (see `last_model_text`)
    workspace: WorkspaceChanges | None = None  # the agent's final workspace vs task.source_dir
    create_sandbox: SandboxFactory | None = None  # grading sandboxes; None: LocalSandbox.create
    timeout_s: float = 300.0  # reward.timeout_s: the whole computation must fit in it
    judge: JudgeClient | None = None  # the judge model (reward.judge.enabled); None: no judge
    # Everything the model wrote in the trajectory (`model_text`): its commands and tool
    # calls, read by the hacking detector; '' falls back to final_text.
    transcript: str = ""
    hack_policy: HackPolicy = "report"  # reward.hack_policy: what hacking findings do

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"RewardContext.timeout_s must be > 0, got {self.timeout_s}")
        if self.hack_policy not in HACK_POLICIES:
            raise ValueError(f"RewardContext.hack_policy={self.hack_policy!r} is not one of "
                             f"{HACK_POLICIES}; set reward.hack_policy to 'report' or 'zero'")


@runtime_checkable
class RewardFn(Protocol):
    """Scores one trajectory. Expected failures of the agent (no answer, tests failing, a
    crashed grading run) are results with reward 0 and a detail; exceptions are left for
    broken tasks or configuration (the reward loop counts them)."""

    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult: ...


# The reward-fn plug-in point: the built-ins by short name.
REWARD_FNS = PluginPoint("reward fn", "reward.fn (or a task's reward_fn)", {
    "exact_match": "reward.rules:ExactMatch",  # the final answer equals Task.answer
    "numeric_match": "reward.rules:NumericMatch",  # within tolerance of Task.answer
    "hidden_tests": "reward.grading.hidden_tests:HiddenTests",  # hidden / fail_to_pass / pass_to_pass pass
    "judge": "reward.judge:GenerativeJudge",  # the judge model's SCORE for the answer
})


def load_reward_fn(import_string: str) -> RewardFn:
    """An instance of the RewardFn named by a built-in name or `package.module:Class` (a
    class or a factory taking no arguments); ValueError says what is wrong and how to fix it."""
    obj = REWARD_FNS.resolve(import_string)
    if not callable(obj):
        raise ValueError(f"reward fn {import_string!r} is not a class or factory")
    try:
        instance = obj()
    except TypeError as exc:
        raise ValueError(f"reward fn {import_string!r} cannot be built without arguments "
                         f"({exc}); give its parameters defaults or name a factory") from exc
    if not callable(instance) or not inspect.iscoroutinefunction(instance.__call__):
        raise ValueError(f"reward fn {import_string!r} must define "
                         "`async def __call__(self, trajectory, task, ctx) -> RewardResult`")
    return instance


def check_reward_fn(import_string: str) -> None:
    """The RewardFn contract, checked without scoring anything: it builds with no
    arguments and its `async __call__` takes (trajectory, task, ctx). ValueError says what
    to change."""
    problem = signature_problem(load_reward_fn(import_string).__call__,
                                ("trajectory", "task", "ctx"))
    if problem:
        raise ValueError(f"reward fn {import_string!r}: __call__{problem}")


def reward_fn_name(task: Task, default: str) -> str:
    """The import string that scores `task`: its own `reward_fn`, else the recipe's."""
    return task.reward_fn or default


def last_model_text(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """The text of the trajectory's last run of model-sampled tokens (its final assistant
    turn), decoded by `decode` (e.g. a tokenizer's decode with skip_special_tokens=True).
    Tool observations and the prompt never count: only what the model itself wrote."""
    mask = trajectory.response_mask
    model = np.flatnonzero(mask == 1)
    if len(model) == 0:
        return ""
    end = int(model[-1]) + 1
    start = end
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    return decode(trajectory.response_ids[start:end].tolist())


def model_text(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """Every run of model-sampled tokens of the trajectory, decoded and joined by newlines:
    all the model wrote (its tool calls and commands included), never the tool output or
    the prompt. The hacking detector reads it (RewardContext.transcript)."""
    mask = trajectory.response_mask
    model = np.flatnonzero(mask == 1)
    if len(model) == 0:
        return ""
    # Starts of runs: model positions whose predecessor is not a model position.
    breaks = np.flatnonzero(np.diff(model) != 1) + 1
    runs = np.split(model, breaks)
    ids = trajectory.response_ids
    return "\n".join(decode(ids[r[0]:r[-1] + 1].tolist()) for r in runs)
