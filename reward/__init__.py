"""Reward: scoring a finished trajectory, run inside the agent-loop worker that produced it.

The RewardFn plug-in point (`base`: the protocol, what a reward fn receives and returns,
its built-ins `REWARD_FNS` and contract check `check_reward_fn`); the per-worker reward
loop that scores each trajectory as it ends, beside the worker's sandbox pool (`loop`);
rule verifiers (`rules`), the generative judge (`judge`), and the trusted grading path of
test-graded tasks (`grading/`: hidden tests in a fresh sandbox, sentinels, cross-checks,
reward-hacking findings; `tests` and `validate` are shims that keep the older import string
and `python -m reward.validate`). A reward function is named by import string or built-in name
(`reward.fn` in the recipe, or `Task.reward_fn`) and resolved once. Its recipe section is
`reward.*` (`reward.config`).
"""

from reward.base import (REWARD_FNS, RewardContext, RewardFn, RewardResult, check_reward_fn,
                         last_model_text, load_reward_fn, model_text, reward_fn_name)
from reward.workspace import WorkspaceChanges

__all__ = ["REWARD_FNS", "RewardContext", "RewardFn", "RewardResult", "WorkspaceChanges",
           "check_reward_fn", "last_model_text", "load_reward_fn", "model_text", "reward_fn_name"]
