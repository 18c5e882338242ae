"""The reward loop of one agent-loop worker: scores each trajectory the worker produced as
soon as it ends, on the worker's own node, with the task's reward function or the
recipe's, under a per-call timeout and a concurrency limit. The agent's final workspace
comes in beside the trajectory (never on it), so it never leaves the node.

Failures are per trajectory and never escape: a timeout scores 0 (component `timeout`);
an exception marks that one trajectory `error` (component `reward_error`, the message
in its termination detail), so the buffer's failure policy (mask, drop, resubmit)
decides what happens to the group, as for any other failed trajectory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from envs.types import Task, TerminationReason, Trajectory, WorkspaceChanges
from reward.base import (RewardContext, RewardFn, RewardResult, SandboxFactory, last_model_text,
                         load_reward_fn, model_text, reward_fn_name)
from reward.grading.hacking import with_findings
from reward.judge import JudgeClient

log = logging.getLogger(__name__)


class RewardLoop:
    def __init__(self, default_fn: str, decode: Callable[[list[int]], str], *, timeout_s: float,
                 max_concurrency: int, judge: JudgeClient | None = None,
                 create_sandbox: SandboxFactory | None = None, scope: str = "default",
                 hack_policy: str = "report") -> None:
        self.default_fn = default_fn
        self.hack_policy = hack_policy  # reward.hack_policy: report findings, or zero the reward
        self.scope = scope  # reward.fn_scope: "all" ignores the tasks' own reward_fn
        self.judge = judge  # the judge model client, handed to every RewardFn in its context
        self.create_sandbox = create_sandbox  # grading sandboxes (envs.sandbox_backend)
        self.decode = decode
        self.timeout_s = timeout_s
        self._fns: dict[str, RewardFn] = {default_fn: load_reward_fn(default_fn)}
        self._limit = asyncio.Semaphore(max_concurrency)
        self.num_timeouts = 0
        self.num_errors = 0

    def fn_name(self, task: Task) -> str:
        """The task's own reward function if it names one (unless reward.fn_scope=all),
        else the recipe's."""
        return self.default_fn if self.scope == "all" else reward_fn_name(task, self.default_fn)

    def fn_for(self, task: Task) -> RewardFn:
        """The RewardFn that scores `task`; resolved once per name."""
        name = self.fn_name(task)
        if name not in self._fns:
            self._fns[name] = load_reward_fn(name)
        return self._fns[name]

    async def compute(self, trajectory: Trajectory, task: Task,
                      workspace: WorkspaceChanges | None) -> RewardResult:
        """The RewardFn's result; a timeout is a 0 result, an exception propagates."""
        ctx = RewardContext(final_text=last_model_text(trajectory, self.decode),
                            workspace=workspace, create_sandbox=self.create_sandbox,
                            timeout_s=self.timeout_s, judge=self.judge,
                            transcript=model_text(trajectory, self.decode),
                            hack_policy=self.hack_policy)  # type: ignore[arg-type]
        async with self._limit:
            try:
                result = await asyncio.wait_for(self.fn_for(task)(trajectory, task, ctx),
                                                self.timeout_s)
                # Every reward gets the hacking findings of its diff and transcript, rule
                # and judge rewards too (HiddenTests adds those of its grading run).
                return with_findings(result, task, ctx)
            except TimeoutError:
                self.num_timeouts += 1
                return RewardResult(0.0, {"timeout": 1.0},
                                    f"reward exceeded reward.timeout_s={self.timeout_s:g}")

    async def score(self, trajectory: Trajectory, task: Task,
                    workspace: WorkspaceChanges | None = None) -> Trajectory:
        """`trajectory` with its reward; a failing RewardFn fails this trajectory only."""
        try:
            result = await self.compute(trajectory, task, workspace)
        except Exception as exc:  # the per-trajectory boundary of scoring
            self.num_errors += 1
            if self.num_errors & (self.num_errors - 1) == 0:  # 1, 2, 4, ...: not a line each
                log.warning("reward of %s/%s failed (%d so far on this worker): %s: %s",
                            trajectory.group_id, trajectory.index, self.num_errors,
                            type(exc).__name__, exc)
            detail = f"reward {self.fn_name(task)} raised {type(exc).__name__}: {exc}"
            if trajectory.termination_detail:  # the error first: its first line names a failure
                detail = f"{detail}\n(the trajectory had ended: {trajectory.termination_detail})"
            return dataclasses.replace(trajectory, reward=0.0, reward_components={"reward_error": 1.0},
                                       termination=TerminationReason.ERROR,
                                       termination_detail=detail)
        return dataclasses.replace(trajectory, reward=result.reward,
                                   reward_components=dict(result.components))
