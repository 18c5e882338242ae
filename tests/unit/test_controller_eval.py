"""The controller's held-out evaluation, with stand-in workers (no Ray): the mean reward of
one version over every sampled trajectory, failed groups reported instead of ending the
run, and tokens of another version refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.types import Group, Message, Task, Trajectory
from trainer.config import SluiceConfig
from trainer.controller import Controller
from trainer.metrics import MetricsLogger
from trainer.recipe import build_config

TASKS = [Task(f"e{i}", (Message("user", f"q{i}"),), answer=str(i)) for i in range(4)]


def trajectory(task_id: str, group_id: str, index: int, version: int) -> Trajectory:
    return Trajectory(task_id, group_id, index, [1, 2], [3, 4], [1, 1], [-0.5, -0.5],
                      [version, version], "finished")


class RemoteCall:
    def __init__(self, fn):
        self.remote = fn


class StandInWorker:
    """Answers run_group like an AgentWorkerActor handle; tasks in `broken` raise."""

    def __init__(self, version: int = 0, broken: tuple[str, ...] = ()) -> None:
        async def run_group(task: Task, group_id: str, size: int) -> Group:
            if task.id in broken:
                raise RuntimeError("worker lost")
            return Group(task.id, group_id, tuple(trajectory(task.id, group_id, i, version)
                                                  for i in range(size)))
        self.run_group = RemoteCall(run_group)


async def score(group: Group, task: Task) -> Group:
    """Reward 1 for even task numbers."""
    import dataclasses

    reward = float(int(task.id[1:]) % 2 == 0)
    return dataclasses.replace(group, trajectories=tuple(
        dataclasses.replace(t, reward=reward) for t in group.trajectories))


def controller(worker: StandInWorker, tmp_path: Path) -> Controller:
    cfg: SluiceConfig = build_config({"eval": {"tasks": "toy_arithmetic_easy_heldout",
                                               "samples_per_task": 3}})
    return Controller(cfg, tasks=TASKS, workers=[worker], router=None, trainer=None,
                      score_group=score, logger=MetricsLogger([]), run_dir=tmp_path,
                      eval_tasks=TASKS)


async def test_eval_is_the_mean_reward_of_one_version(tmp_path):
    ctl = controller(StandInWorker(), tmp_path)
    metrics = await ctl._evaluate()
    assert metrics["eval/reward_mean"] == 0.5 and metrics["eval/num_trajectories"] == 12
    assert metrics["eval/failed_groups"] == 0 and ctl.eval_rewards == {0: 0.5}


async def test_a_failed_eval_group_is_reported_not_fatal(tmp_path):
    ctl = controller(StandInWorker(broken=("e1",)), tmp_path)
    metrics = await ctl._evaluate()
    assert metrics["eval/failed_groups"] == 1
    assert metrics["eval/reward_mean"] == pytest.approx(2 / 3)  # e0, e2 right; e3 wrong


async def test_tokens_of_another_version_are_refused(tmp_path):
    ctl = controller(StandInWorker(version=1), tmp_path)
    with pytest.raises(RuntimeError, match="a weight push landed during evaluation"):
        await ctl._evaluate()
