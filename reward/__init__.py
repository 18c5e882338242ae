"""Rewards: rule verifiers, hidden-test grading, generative judge.

A reward function is named by import string (`reward.fn` in the recipe, or
`Task.reward_fn`) and resolved once by `load_reward_fn`; see `reward.base` for the
protocol, its built-ins (`REWARD_FNS`) and its contract check (`check_reward_fn`).
"""

from reward.base import (REWARD_FNS, RewardContext, RewardFn, RewardResult, check_reward_fn,
                         last_model_text, load_reward_fn, model_text, reward_fn_name)
from reward.workspace import WorkspaceChanges

__all__ = ["REWARD_FNS", "RewardContext", "RewardFn", "RewardResult", "WorkspaceChanges",
           "check_reward_fn", "last_model_text", "load_reward_fn", "model_text", "reward_fn_name"]
