"""AgentLoopWorker: runs one asyncio coroutine per trajectory and returns a Group once
all G trajectories of a task are terminal.

This is the one place where a trajectory's failure is caught: an exception anywhere in an
agent loop or its tools ends that trajectory with `error` (message kept), and the
wall-clock limit ends it with `timeout`; both keep what the trajectory produced so far.
The worker itself never fails because of a trajectory. A thin Ray actor hosts it.

Whatever the ending, the trajectory's tools are released afterwards; sandbox tools
capture the final workspace on release, and the worker puts it on the Trajectory
(`Trajectory.workspace`) for the reward loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envs.tools.base import ToolFactory, final_workspace
from rollout.agent_loop import AgentContext, LoopSettings, load_agent_loop
from rollout.chat import ContinuityBuilder
from rollout.gate import TurnGate
from rollout.router import Router
from envs.types import Group, Task, TerminationReason, Trajectory

from envs.plugins import resolve_plugin

if TYPE_CHECKING:
    from rollout.config import RolloutRecipe

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    num_running: int  # trajectories in flight
    num_finished: int
    end_reasons: Mapping[str, int]
    num_tool_errors: int
    num_continuity_divergences: int  # only counted with agent.continuity_check


class AgentLoopWorker:
    def __init__(self, *, default_loop: str, settings: LoopSettings, chat: ContinuityBuilder,
                 tokenizer: Any, router: Router, tool_factories: Mapping[str, ToolFactory],
                 trajectory_timeout_s: float, gate: TurnGate | None = None) -> None:
        self.settings = settings
        self.chat = chat
        self.tokenizer = tokenizer
        self.router = router
        self.tool_factories = dict(tool_factories)
        self.trajectory_timeout_s = trajectory_timeout_s
        self.gate = gate or TurnGate()
        self._default_loop = default_loop
        self._loops: dict[str, Any] = {default_loop: load_agent_loop(default_loop)()}
        self._num_running = 0
        self._end_reasons: Counter[str] = Counter()
        self._num_tool_errors = 0
        self._num_divergences = 0

    def loop_for(self, task: Task) -> Any:
        """The task's own loop class if it names one, else the recipe's; resolved once."""
        name = task.agent_loop or self._default_loop
        if name not in self._loops:
            self._loops[name] = load_agent_loop(name)()
        return self._loops[name]

    def check_task(self, task: Task) -> None:
        """Fail early (before any trajectory) on a task the worker cannot run."""
        self.loop_for(task)
        unknown = [t for t in task.tools if t not in self.tool_factories]
        if unknown:
            raise ValueError(f"task {task.id!r} names unknown tools {unknown}; "
                             f"registered: {sorted(self.tool_factories)}")

    async def run_group(self, task: Task, group_id: str, group_size: int) -> Group:
        self.check_task(task)
        trajectories = await asyncio.gather(
            *(self.run_trajectory(task, group_id, i) for i in range(group_size)))
        return Group(task.id, group_id, tuple(trajectories))

    async def run_trajectory(self, task: Task, group_id: str, index: int) -> Trajectory:
        tools = {name: self.tool_factories[name]() for name in task.tools}
        ctx = AgentContext(task=task, group_id=group_id, index=index, settings=self.settings,
                           chat=self.chat, tokenizer=self.tokenizer, tools=tools,
                           router=self.router, gate=self.gate)
        self._num_running += 1
        try:
            await asyncio.gather(*(t.create(task) for t in tools.values()))
            trajectory = await asyncio.wait_for(self.loop_for(task).run(task, ctx),
                                                self.trajectory_timeout_s)
            _check_result(trajectory, ctx)
        except TimeoutError:
            trajectory = self._salvage(ctx, TerminationReason.TIMEOUT,
                                       f"exceeded agent.trajectory_timeout_s={self.trajectory_timeout_s:g}")
        except Exception as exc:  # the per-trajectory boundary: nothing escapes to the worker
            log.warning("trajectory %s failed: %s", ctx.session_id, exc)
            detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            trajectory = self._salvage(ctx, TerminationReason.ERROR, detail)
        finally:
            self._num_running -= 1
            self.router.release(ctx.session_id)
            await self._release_tools(tools)
        workspace = final_workspace(tools.values())
        if workspace is not None:
            trajectory = dataclasses.replace(trajectory, workspace=workspace)
        self._end_reasons[trajectory.termination.value] += 1
        self._num_tool_errors += sum(t.num_tool_errors for t in trajectory.turns)
        self._num_divergences += ctx.continuity_divergence is not None
        return trajectory

    def _salvage(self, ctx: AgentContext, reason: TerminationReason, detail: str) -> Trajectory:
        """The partial trajectory of a failed loop (or a prompt-only one if it never started)."""
        if ctx.recorder is None:
            try:
                prompt = ctx.chat.initial_prompt_ids(ctx.task.messages, ctx.tool_schemas or None)
            except Exception as exc:  # the prompt itself cannot be rendered
                prompt = [ctx.chat.end_of_turn_id]  # a 1-token stand-in; the trajectory is an error
                detail += f"\n(prompt could not be rendered: {exc})"
            ctx.start(prompt)
        assert ctx.recorder is not None
        return ctx.recorder.finish(reason, detail)

    async def _release_tools(self, tools: Mapping[str, Any]) -> None:
        results = await asyncio.gather(*(t.release() for t in tools.values()), return_exceptions=True)
        for name, result in zip(tools, results):
            if isinstance(result, BaseException):
                log.warning("releasing tool %s failed: %s", name, result)

    def stats(self) -> WorkerStats:
        return WorkerStats(self._num_running, sum(self._end_reasons.values()),
                           dict(self._end_reasons), self._num_tool_errors, self._num_divergences)


def _check_result(trajectory: object, ctx: AgentContext) -> None:
    """A user loop must return the trajectory of this task, group and index."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"agent loop returned {type(trajectory).__name__}, not a Trajectory")
    if (trajectory.task_id, trajectory.group_id, trajectory.index) != (ctx.task.id, ctx.group_id, ctx.index):
        raise ValueError(f"agent loop returned trajectory {trajectory.task_id}/{trajectory.group_id}/"
                         f"{trajectory.index} for {ctx.task.id}/{ctx.group_id}/{ctx.index}")


BUILTIN_TOOLS = ("calculator",)  # in-process tools; the sandbox tools come with a provider


def build_agent_worker(cfg: "RolloutRecipe", model_path: str, engines: Mapping[str, Any],
                       tool_factories: Mapping[str, ToolFactory] | None = None,
                       sandbox_provider: Any | None = None) -> AgentLoopWorker:
    """An AgentLoopWorker for the recipe: tokenizer and continuity builder of the policy,
    a sticky router over `engines`, the in-process built-in tools, and the sandbox tools
    over `sandbox_provider` when one is given (unless `tool_factories` replaces them all)."""
    from transformers import AutoTokenizer

    from rollout.chat import build_continuity_builder

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chat = build_continuity_builder(tokenizer, cfg.agent.chat_family, cfg.agent.keep_thinking)
    if tool_factories is None:
        tool_factories = {name: load_tool(name) for name in BUILTIN_TOOLS}
        if sandbox_provider is not None:
            from envs.tools.sandbox_tools import (build_sandbox_tool_factories,
                                                  build_sandbox_tool_settings)

            count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
            settings = build_sandbox_tool_settings(cfg.envs, count_tokens=count)
            tool_factories = {**tool_factories,
                              **build_sandbox_tool_factories(sandbox_provider, settings)}
    router = Router(dict(engines), max_sessions=cfg.rollout.num_router_sessions,
                    request_timeout_s=cfg.rollout.request_timeout_s)
    return AgentLoopWorker(default_loop=cfg.agent.loop, settings=LoopSettings.from_config(cfg),
                           chat=chat, tokenizer=tokenizer, router=router,
                           tool_factories=tool_factories,
                           trajectory_timeout_s=cfg.agent.trajectory_timeout_s)


def load_tool(import_string: str) -> ToolFactory:
    factory = resolve_plugin("tool", import_string)
    if not callable(factory):
        raise ValueError(f"tool {import_string!r} is not a class or factory")
    return factory
