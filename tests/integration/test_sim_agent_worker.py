"""The simulator with the real AgentLoopWorker and agent loop (`launch.simulate --worker
real`): the tiny model's tokenizer, chat template and tool parser, the real bash tool over
the sandbox pool model, ExactMatch rewards, the engine model behind the router. Its
trajectories end as scripted, its accounting holds, and its clock agrees with the
simulator's own trajectories on the same profile."""

from __future__ import annotations

import pytest

from launch.plan import load_recipe_and_profile
from launch.simulate import SimOptions, run_simulation

pytest.importorskip("looptime")

SMALL = ["plan.model_params_b=8", "plan.kv_bytes_per_token=131072", "plan.prompt_tokens=0",
         "rollout.num_engines=2", "rollout.tp_size=1", "plan.train_gpus=4",
         "train.groups_per_step=4", "train.group_size=4", "envs.num_sandbox_workers=1",
         "envs.sandboxes_per_worker=8", "plan.turns=3", "plan.gen_tokens=64",
         "plan.obs_tokens=200", "rollout.num_agent_workers=1", "eval.tasks=null",
         "train.mode=async", "train.num_steps=2"]


def test_the_real_worker_runs_the_scripted_trajectories():
    cfg, profile = load_recipe_and_profile("swe_grpo.yaml", SMALL, None)
    real, trace = run_simulation(cfg, profile, SimOptions(steps=2, worker="real", token_unit=1))
    # Every trajectory: 2 parsed bash calls (each runs 30 s in a simulated sandbox), then
    # the final answer; ExactMatch scores the even samples of a group 1, the odd ones 0.
    assert real.end_reasons == {"finished": len(trace)} and len(trace) >= 32
    assert {e["turns"] for e in trace} == {3} and real.turns == 3 * len(trace)
    assert sorted({(int(e["traj"].rsplit("/", 1)[1]) % 2, e["reward"]) for e in trace}) == \
        [(0, 1.0), (1, 0.0)]
    assert real.admitted == real.trajectories_trained // 4 + sum(real.dropped.values()) \
        + real.running + real.buffered
    # 8 sandboxes: admission keeps 2 groups of 4 in flight (envs.sandbox_oversubscription 1),
    # so a step of 4 groups takes two rounds of trajectories and nobody queues.
    assert real.sandboxes_peak == 8 and real.sandbox_wait_max_s == 0
    assert real.step_s[1] > 2 * real.trajectory_wall_mean_s
    assert real.prefix_cache_hit_rate > 0.3  # turns 2 and 3 hit their own prefix
    model, _ = run_simulation(cfg, profile, SimOptions(steps=2, token_unit=1))
    # The same profile through the simulator's own trajectories: the clock agrees (it is
    # the execs' 60 s plus decode; the real worker's contexts are its template's size).
    assert real.trajectory_wall_mean_s == pytest.approx(model.trajectory_wall_mean_s, rel=0.05)
    assert real.step_s == pytest.approx(model.step_s, rel=0.05)
