"""The virtual-clock simulator (launch.simulate): the real controller, buffer, router and
gate against simulated parts. Deterministic under a seed; with zero latencies the
accounting identity and the admission bound hold; where the planner's assumptions hold
(no tail, sync steps, enough sandboxes) its numbers agree with the planner's."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from launch.plan import build_plan, compute_account, compute_train_s, load_recipe_and_profile
from launch.simulate import SimOptions, double_in_flight, main, run_simulation

pytest.importorskip("looptime")

# A small SWE-like workload: 2 engines, 8 groups of 4 per step, 5 turns of 400 + 1,600.
SMALL = ["plan.model_params_b=8", "plan.kv_bytes_per_token=131072", "plan.prompt_tokens=0",
         "rollout.num_engines=2", "rollout.tp_size=1", "plan.train_gpus=4",
         "train.groups_per_step=8", "train.group_size=4", "envs.num_sandbox_workers=1",
         "envs.sandboxes_per_worker=64", "plan.turns=5", "rollout.num_agent_workers=1",
         "eval.tasks=null"]


def _cfg(mode: str = "async", steps: int = 3, extra: tuple[str, ...] = ()):
    """(recipe, workload profile) of SMALL, as the simulator's command line splits them."""
    return load_recipe_and_profile("swe_grpo.yaml", [*SMALL, f"train.mode={mode}",
                                                     f"train.num_steps={steps}", *extra], None)


def test_the_same_seed_gives_the_same_run():
    opts = SimOptions(tail="seed", seed=3)
    first, trace_a = run_simulation(*_cfg(), opts)
    second, trace_b = run_simulation(*_cfg(), opts)
    assert dataclasses.replace(first, wall_s=0) == dataclasses.replace(second, wall_s=0)
    assert trace_a == trace_b and len(trace_a) == first.turns > 0
    other, _ = run_simulation(*_cfg(), dataclasses.replace(opts, seed=4))
    assert other.step_s != first.step_s  # the seed drives the exec-time draws


def test_with_zero_latency_accounting_and_admission_hold():
    cfg, profile = _cfg(steps=4)
    profile = dataclasses.replace(profile, exec_s=0.0, gen_s=1.0, gpu_flops=math.inf,
                                  hbm_bytes_per_s=math.inf)
    r, _ = run_simulation(cfg, profile, SimOptions(push_latency_s=0.0, push_bytes_per_s=math.inf))
    assert r.virtual_s == 0.0 and r.step_s == (0.0,) * 4
    groups = r.trajectories_trained // 4
    assert groups == 4 * 8
    # every admitted group is trained, dropped, in flight or buffered
    assert r.admitted == groups + sum(r.dropped.values()) + r.running + r.buffered
    eta = cfg.buffer.max_staleness
    assert r.admitted <= (4 + eta + 1) * 8  # AReaL's bound: (version + eta + 1) x B
    assert r.staleness_max <= eta


def test_sync_steps_agree_with_the_planner_where_its_assumptions_hold():
    cfg, profile = _cfg(mode="sync", steps=2)
    r, trace = run_simulation(cfg, profile, SimOptions(tail="none", push_latency_s=0.0,
                                                       push_bytes_per_s=math.inf))
    p = build_plan(cfg, profile).inputs
    a = compute_account(p)
    # One version per step: every token of a trained trajectory is of the trainer's version.
    assert r.staleness_max == 0
    # Sync steps start on an empty, freshly reset cache and a roomy pool (32 trajectories,
    # 6 GB of 112 GB): every turn prefills only what is new, as the cached bound assumes.
    # What is new is less than the bound counts: the generated tokens' KV is written by
    # decode (the bound prefills them again), and a trajectory ends without a last
    # observation. So: the first prompt (1 id = 100 tokens here) + 4 observations, plus
    # the partial block recomputed each turn (under 16 tokens).
    prefilled_per_traj = 100 + (p.turns - 1) * p.obs_tokens
    assert r.prefill_s_per_step == pytest.approx(
        a.prefill_cached_s * prefilled_per_traj / a.final_context_tokens, rel=0.02)
    # Training sees exactly the trajectories' tokens: the planner's formula on them.
    tokens = 32 * (100 + p.turns * p.gen_tokens + (p.turns - 1) * p.obs_tokens)
    step_train_s = compute_train_s(8e9, tokens, 4, p.gpu_flops, p.mfu_train)
    turns = {}
    for e in trace:
        turns.setdefault(e["traj"], []).append(e)
    assert len(turns) == 2 * 32 and all(len(t) == p.turns for t in turns.values())
    # A sync step: the slowest trajectory of the batch, then training (push time is 0).
    first = max(t[-1]["gen_end_s"] for k, t in turns.items() if t[0]["version"] == 0)
    assert r.step_s[0] == pytest.approx(first + step_train_s, abs=2e-3)  # trace: ms
    # The controller's own timings follow the virtual clock: its steps are the pushes'.
    assert r.logged_step_s == pytest.approx(r.step_s, abs=1e-6)
    # Sync: the trainer waits for the whole batch, then trains (push time 0 here).
    assert r.logged_trainer_idle_ratio[0] == pytest.approx(first / r.step_s[0], abs=1e-5)  # trace: ms
    # Each trajectory's wall clock: its (turns - 1) execs of exactly exec_s, and its turns.
    for t in turns.values():
        gaps = [b["gate_s"] - a["gen_end_s"] for a, b in zip(t, t[1:])]
        assert gaps == pytest.approx([p.exec_s] * (p.turns - 1), abs=1e-3)


def test_a_small_pool_recomputes_like_the_planners_uncached_bound():
    # 1.5 GB of KV per engine (715 blocks): one whole trajectory (626 blocks) fits, two do not.
    cfg, profile = _cfg(mode="sync", steps=1, extra=("plan.kv_pool_gb_per_gpu=1.5",))
    r, _ = run_simulation(cfg, profile, SimOptions(push_latency_s=0.0))
    a, turns = compute_account(build_plan(cfg, profile).inputs), 5
    assert r.prefix_cache_hit_rate < 0.05
    # Sum over turns of the context (i x 2,000 tokens, i < turns) vs the planner's
    # turns x final / 2: (turns - 1) / turns of it, with the prompt at 0.
    assert r.prefill_s_per_step == pytest.approx(a.prefill_uncached_s * (turns - 1) / turns,
                                                 rel=0.03)


def test_cli_prints_the_comparison_and_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    assert main(["recipe=swe_grpo.yaml", *SMALL, "--steps", "1", "--mode", "sync",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "simulator" in out and "planner" in out and "prefix-cache hit rate" in out
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sum(e["kind"] == "turn" for e in events) == 32 * 5  # the run report's schema
    assert {e["kind"] for e in events} == {"turn", "push", "step"}
    assert main(["recipe=swe_grpo.yaml", *SMALL, "--mode", "later"]) == 2
    assert "--mode is sync or async" in capsys.readouterr().err
    assert main(["recipe=swe_grpo.yaml", *SMALL, "--worker", "real", "--sandboxes", "releasable"]) == 2
    assert "stateful sandboxes" in capsys.readouterr().err


def test_push_latency_is_a_flag_and_lengthens_each_step_by_its_change(capsys):
    # Sync steps without a tail repeat exactly: each push's fixed latency is part of the step.
    args = ["recipe=swe_grpo.yaml", *SMALL, "--steps", "2", "--mode", "sync", "--tail", "none", "--json"]
    steps = {}
    for latency in ("0", "5.5"):
        assert main([*args, "--push-latency-s", latency]) == 0
        steps[latency] = json.loads(capsys.readouterr().out)["step_s"]
    assert [b - a for a, b in zip(steps["0"], steps["5.5"])] == pytest.approx([5.5, 5.5])
    assert main([*args, "--push-latency-s", "soon"]) == 2
    assert "--push-latency-s takes seconds" in capsys.readouterr().err
    assert main([*args, "--push-latency-s", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_doubling_the_trajectories_in_flight_lowers_the_hit_rate(capsys):
    # The seed's experiment: 6 GB of KV per engine holds ~9 whole trajectories; 16 per
    # engine in flight already evict some, 32 evict most.
    cfg, profile = _cfg(mode="async", steps=2, extra=("plan.kv_pool_gb_per_gpu=6",))
    base, _ = run_simulation(cfg, profile, SimOptions())
    doubled, _ = run_simulation(double_in_flight(cfg), profile, SimOptions())
    assert doubled.trajectories_trained == 2 * base.trajectories_trained
    assert doubled.prefix_cache_hit_rate < base.prefix_cache_hit_rate
    per_traj = [r.prefill_s_per_step / r.trajectories_trained for r in (base, doubled)]
    assert per_traj[1] > per_traj[0]
    assert main(["recipe=swe_grpo.yaml", *SMALL, "plan.kv_pool_gb_per_gpu=6", "--steps", "1",
                 "--double-in-flight"]) == 0
    assert "2x in flight" in capsys.readouterr().out


def test_a_group_deadline_is_counted_in_the_report_with_its_length_bias():
    """The seed's long tail under a group deadline that catches it (partial): the report
    carries the buffer's deadline totals, cuts by turns and length included."""
    cfg, profile = _cfg(steps=2, extra=("buffer.group_deadline_s=200",
                                        "buffer.straggler_policy=partial"))
    r, _ = run_simulation(cfg, profile, SimOptions(tail="seed", seed=1))
    assert r.deadline["cut_samples"] == r.end_reasons["deadline"] > 0
    assert r.deadline["partial_groups"] > 0
    assert sum(v for k, v in r.deadline.items() if k.startswith("cut_by_turns/")) == \
        r.deadline["cut_samples"]
    none, _ = run_simulation(*_cfg(steps=2), SimOptions(tail="seed", seed=1))
    assert none.deadline == {} and "deadline" not in none.end_reasons
