"""The `reward` section of the recipe: the reward function, grading and the judge pool.
The trainer composes it into the one schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from envs.knobs import knob, mapping_knob, section

# What reward-hacking findings (reward.grading.hacking) do: "report" records them as hack_*
# components and metrics only; "zero" also sets the trajectory's reward to 0.
HackPolicy = Literal["report", "zero"]
HACK_POLICIES: tuple[HackPolicy, ...] = ("report", "zero")


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    enabled: bool = knob(False, "Serve a generative reward model on the judge pool.")
    model_path: str = knob("", "Judge model folder, required with `enabled` ('tiny': the local "
                           "test model); never synced with the policy.")
    num_engines: int = knob(1, "vLLM engines in the judge pool.")
    tp_size: int = knob(1, "Tensor-parallel GPUs per judge engine (1 on cpu).")
    cpus_per_engine: float = knob(1.0, "Ray CPUs reserved per judge engine.")
    kv_cache_memory_bytes: int | None = knob(None, "Explicit judge KV-cache size; None: as "
                                             "rollout.kv_cache_memory_bytes.")
    max_new_tokens: int = knob(256, "Judge verdict length limit.")
    max_model_len: int | None = knob(None, "Judge engines' context in tokens (judge prompt + "
                                     "verdict), checked against the judge's positions (with "
                                     "reward.judge.rope_scaling); None: model.max_context_tokens.")
    rope_scaling: dict[str, float | str] = mapping_knob(
        "RoPE scaling of the judge in its engines, as model.rope_scaling (which is the "
        "policy's and never reaches the judge), e.g. {rope_type: yarn, factor: 2.0} to judge "
        "trajectories past the judge's own positions. Empty: the judge's config.json as is.")


@dataclass(frozen=True, slots=True)
class RewardConfig:
    fn: str = knob("reward.rules:ExactMatch", "RewardFn as an import string 'package.module:Class'.")
    fn_scope: Literal["default", "all"] = knob(
        "default", "default: reward.fn scores the tasks that name no reward_fn of their own (a "
        "task row's reward_fn wins); all: reward.fn scores every task, whatever its rows say.")
    max_concurrency: int = knob(64, "Rewards computed at once per agent-loop worker (each "
                                "worker scores the groups it produced, on its own node).")
    timeout_s: float = knob(300.0, "Limit of one reward computation; a timeout scores as failure.")
    hack_policy: Literal["report", "zero"] = knob(
        "report", "Reward-hacking findings (hack_* components, reward/hack_* metrics): 'report' "
        "only records them; 'zero' also sets the trajectory's reward to 0. Tampering that the "
        "grading run itself detects scores 0 either way.")
    judge: JudgeConfig = section(JudgeConfig, "Generative judge served on its own GPU pool.")
