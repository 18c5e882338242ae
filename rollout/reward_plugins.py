"""The reward plug-in point as the rollout side hosts it. The agent-loop worker runs the
reward loop on the groups it produced (`rollout.worker` -> `reward.loop`), so `reward.fn`
and a task row's `reward_fn` are plug-ins of the worker: the run's config checks and its
start-up validation reach them here, and the trainer never imports `reward` directly
(tests/unit/test_layering.py). The table and the contract check themselves live with the
Protocol, in `reward.base`."""

from __future__ import annotations

from reward.base import REWARD_FNS, check_reward_fn

__all__ = ["REWARD_FNS", "check_reward_fn"]
