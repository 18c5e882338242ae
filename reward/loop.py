"""The reward loop: scores each terminal group as soon as it comes back from rollout (not
at the end of a training step), with the task's own reward function or the recipe's,
under a per-call timeout and a concurrency limit. A timeout scores as a failure (reward 0,
counted in the `timeout` component); an exception is left to the caller, which drops
and counts the group."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from reward.base import (RewardContext, RewardFn, RewardResult, SandboxFactory, last_model_text,
                         load_reward_fn, reward_fn_name)
from reward.judge import JudgeClient
from envs.types import Group, Task, Trajectory


class RewardLoop:
    def __init__(self, default_fn: str, decode: Callable[[list[int]], str], *, timeout_s: float,
                 max_concurrency: int, judge: JudgeClient | None = None,
                 create_sandbox: SandboxFactory | None = None) -> None:
        self.default_fn = default_fn
        self.judge = judge  # the judge model client, handed to every RewardFn in its context
        self.create_sandbox = create_sandbox  # grading sandboxes (envs.sandbox_backend)
        self.decode = decode
        self.timeout_s = timeout_s
        self._fns: dict[str, RewardFn] = {default_fn: load_reward_fn(default_fn)}
        self._limit = asyncio.Semaphore(max_concurrency)
        self.num_timeouts = 0

    def _fn_for(self, task: Task) -> RewardFn:
        name = reward_fn_name(task, self.default_fn)
        if name not in self._fns:
            self._fns[name] = load_reward_fn(name)
        return self._fns[name]

    async def score(self, trajectory: Trajectory, task: Task) -> RewardResult:
        ctx = RewardContext(final_text=last_model_text(trajectory, self.decode),
                            workspace=trajectory.workspace,
                            create_sandbox=self.create_sandbox, timeout_s=self.timeout_s,
                            judge=self.judge)
        async with self._limit:
            try:
                return await asyncio.wait_for(self._fn_for(task)(trajectory, task, ctx), self.timeout_s)
            except TimeoutError:
                self.num_timeouts += 1
                return RewardResult(0.0, {"timeout": 1.0},
                                    f"reward exceeded reward.timeout_s={self.timeout_s:g}")

    async def score_group(self, group: Group, task: Task) -> Group:
        results = await asyncio.gather(*(self.score(t, task) for t in group.trajectories))
        return Group(group.task_id, group.group_id, tuple(
            # The workspace served grading only; the buffer, trainer and checkpoints never carry it.
            dataclasses.replace(t, reward=r.reward, reward_components=dict(r.components),
                                workspace=None)
            for t, r in zip(group.trajectories, results)))
