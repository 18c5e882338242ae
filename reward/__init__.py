"""Rewards: rule verifiers, hidden-test grading, generative judge.

A reward function is named by import string (`reward.fn` in the recipe, or
`Task.reward_fn`) and resolved once by `load_reward_fn`; see `reward.base` for the
protocol and `BUILTIN_REWARDS` for the built-ins.
"""

from reward.base import (BUILTIN_REWARDS, RewardContext, RewardFn, RewardResult, last_model_text,
                         load_reward_fn, model_text, reward_fn_name)
from reward.workspace import WorkspaceChanges

__all__ = ["BUILTIN_REWARDS", "RewardContext", "RewardFn", "RewardResult", "WorkspaceChanges",
           "last_model_text", "load_reward_fn", "model_text", "reward_fn_name"]
