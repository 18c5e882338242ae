"""`ShopReward`: 1 for the right total, 0.1 for a well-formed answer that is wrong, else 0.

A RewardFn is a class built once (without arguments) in each agent-loop worker and called
once per finished trajectory. It gets the trajectory (token ids, turns, termination),
the task (its `answer` here) and a RewardContext: the final assistant text, the agent's
final workspace for sandbox tasks, a grading-sandbox factory and the judge client.
Components are logged as `reward/<name>` (their mean per step).
"""

from __future__ import annotations

import re

from rollout.api import RewardContext, RewardResult, Task, Trajectory

ANSWER = re.compile(r"Answer:\s*(-?\d+)")


class ShopReward:
    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult:
        found = ANSWER.findall(ctx.final_text)
        correct = bool(found) and task.answer is not None and found[-1] == task.answer.strip()
        used_tools = any(turn.num_tool_calls for turn in trajectory.turns)
        reward = 1.0 if correct else 0.1 if found else 0.0
        return RewardResult(reward, {"correct": float(correct), "answered": float(bool(found)),
                                     "used_tools": float(used_tools)},
                            detail=f"answers {found} vs {task.answer}")
