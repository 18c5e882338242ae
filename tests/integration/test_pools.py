"""Resource pools on a real local Ray with logical GPUs: placement, GPU visibility,
the sandbox custom resource, and a clear error (not a hang) when a pool cannot fit."""

from __future__ import annotations

import os
import time

import pytest

from trainer.run.pools import PoolPlacementError, build_pools, connect_cluster, plan_pools, release_pools
from trainer.run.recipe import load_config

# A miniature of the cluster layout: 4 logical GPUs, 1 node offering sandbox slots.
GPU_RECIPE = ["cluster.device=cuda", "cluster.local_num_cpus=8", "cluster.local_num_gpus=4",
              "cluster.local_num_sandbox_slots=2", "cluster.pool_ready_timeout_s=5",
              "rollout.num_engines=1", "rollout.tp_size=2", "train.num_ranks=1",
              "reward.judge.enabled=true", "reward.judge.num_engines=1",
              "envs.num_sandbox_workers=2", "envs.cpus_per_sandbox_worker=0.5",
              "rollout.num_agent_workers=2",
              "sync.transport=nccl"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    cfg = load_config("quickstart.yaml", GPU_RECIPE)
    connect_cluster(cfg)
    yield ray
    ray.shutdown()


def _bundle_env(ray, pg, index):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.01)
    def probe():
        return os.environ.get("CUDA_VISIBLE_DEVICES", ""), ray.get_runtime_context().get_node_id()

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
    bundle = pg.bundle_specs[index]
    return ray.get(probe.options(scheduling_strategy=strategy, num_gpus=bundle.get("GPU", 0)).remote())


def test_pools_are_placed_and_tasks_see_their_gpus(ray_cluster):
    ray = ray_cluster
    cfg = load_config("quickstart.yaml", GPU_RECIPE)
    placed = build_pools(cfg)
    try:
        assert set(placed) == {"rollout", "train", "judge", "sandbox"}
        rollout_gpus, _ = _bundle_env(ray, placed["rollout"], 0)
        train_gpus, _ = _bundle_env(ray, placed["train"], 0)
        judge_gpus, _ = _bundle_env(ray, placed["judge"], 0)
        assert len(rollout_gpus.split(",")) == 2 and len(train_gpus.split(",")) == 1
        used = rollout_gpus.split(",") + train_gpus.split(",") + judge_gpus.split(",")
        assert sorted(used) == ["0", "1", "2", "3"]  # disjoint: no pool shares a GPU
        assert ray.available_resources().get("GPU", 0) == 0
        sandbox_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("sandbox")}
        assert _bundle_env(ray, placed["sandbox"], 1)[1] in sandbox_nodes
    finally:
        release_pools(placed)
    time.sleep(0.5)
    assert ray.available_resources().get("GPU", 0) == 4


def test_unsatisfiable_pool_fails_fast_naming_pool_and_resources(ray_cluster):
    ray = ray_cluster
    cfg = load_config("quickstart.yaml", [*GPU_RECIPE, "rollout.num_engines=3"])
    start = time.monotonic()
    with pytest.raises(PoolPlacementError) as err:
        build_pools(cfg)
    assert time.monotonic() - start < 15
    message = str(err.value)
    assert "pool 'rollout'" in message and "GPU: needs 6" in message and "has 4 in all" in message
    assert "rollout.num_engines" in message
    time.sleep(0.5)
    assert ray.available_resources().get("GPU", 0) == 4  # nothing left reserved


def test_missing_sandbox_resource_is_named(ray_cluster):
    cfg = load_config("quickstart.yaml", [*GPU_RECIPE, "envs.num_sandbox_workers=3", "rollout.num_agent_workers=3"])
    with pytest.raises(PoolPlacementError, match=r"pool 'sandbox'.*sandbox: needs 3, the cluster has 2"):
        build_pools(cfg)


def test_cpu_recipe_places_with_zero_gpus(ray_cluster):
    cfg = load_config("quickstart.yaml", ["cluster.pool_ready_timeout_s=5"])
    assert all(p.total("GPU") == 0 for p in plan_pools(cfg))
    placed = build_pools(cfg)
    release_pools(placed)
    assert set(placed) == {"rollout", "train", "sandbox"}
