"""The pool plan is a pure function of the recipe; GPU counts vanish on cpu."""

from __future__ import annotations

from trainer.run.pools import format_pool_plan, plan_pools
from trainer.run.recipe import load_config


def test_cpu_plan_has_no_gpus_and_a_sandbox_pool():
    pools = {p.name: p for p in plan_pools(load_config("quickstart.yaml"))}
    assert set(pools) == {"rollout", "train", "sandbox"}
    assert all(p.total("GPU") == 0 for p in pools.values())
    assert pools["sandbox"].total("sandbox") == 1 and pools["sandbox"].strategy == "SPREAD"


def test_gpu_plan_sizes_pools_from_the_recipe():
    cfg = load_config("swe_grpo.yaml")
    pools = {p.name: p for p in plan_pools(cfg)}
    assert pools["rollout"].total("GPU") == 32
    assert pools["rollout"].bundles()[0] == {"CPU": 8.0, "GPU": 2.0}  # one engine's TP group per bundle
    assert pools["train"].total("GPU") == 16
    assert pools["judge"].total("GPU") == 8
    assert pools["sandbox"].num_bundles == 45
    table = format_pool_plan(tuple(pools.values()))
    assert "GPU=56" in table and "sandbox=45" in table


def test_judge_pool_only_when_enabled():
    cfg = load_config("swe_grpo.yaml", ["reward.judge.enabled=false"])
    assert "judge" not in {p.name for p in plan_pools(cfg)}


def test_custom_sandbox_resource_name():
    cfg = load_config("quickstart.yaml", ["cluster.sandbox_resource=cpu_box"])
    sandbox = [p for p in plan_pools(cfg) if p.name == "sandbox"][0]
    assert dict(sandbox.bundle)["cpu_box"] == 1
