"""rollout.num_agent_workers=0 (auto) resolves before start to processes per sandbox node =
ceil(trajectories in flight per node / rollout.trajectories_per_agent_worker), at least 1,
capped on a local cluster by the CPUs the other pools leave; a positive count is kept.
Expected values are computed by hand from the recipes' numbers."""

from __future__ import annotations

import pytest

from trainer.run.pools import plan_pools
from trainer.run.recipe import load_config
from trainer.run.sizing import compute_in_flight_trajectories, resolve_agent_workers

# The quickstart: eta 1, 4 groups x G=8, 1 sandbox worker with 32 sandboxes; a local
# cluster of 8 CPUs of which the engine (1), the train rank (1) and the sandbox worker (1)
# reserve 3; auto by default.
QUICK = "quickstart.yaml"


def test_in_flight_is_the_staleness_bound_capped_by_the_sandboxes():
    assert compute_in_flight_trajectories(1, 4, 8, 32) == 32  # (1+1) x 32 = 64 > 32 sandboxes
    assert compute_in_flight_trajectories(2, 500, 8, 1800) == 1800
    assert compute_in_flight_trajectories(0, 4, 8, 64) == 32  # bound first
    assert compute_in_flight_trajectories(3, 2, 4, 0) == 32  # no sandboxes: no cap


def test_the_quickstart_gets_one_process_on_its_one_node():
    cfg = load_config(QUICK)
    assert cfg.rollout.num_agent_workers == 0  # auto
    count = resolve_agent_workers(cfg)
    assert (count.total, count.per_node, count.auto) == (1, 1, True)  # ceil(32 / 128) = 1
    assert "32 trajectories in flight per node" in count.reason


def test_auto_rounds_up_per_node():
    count = resolve_agent_workers(load_config(QUICK, ["rollout.trajectories_per_agent_worker=10"]))
    # ceil(32 / 10) = 4 per node; 4 x 0.5 CPUs fit the 8 - 3 = 5 left
    assert (count.total, count.per_node) == (4, 4)


def test_auto_spreads_in_flight_over_the_sandbox_nodes():
    cfg = load_config(QUICK, ["cluster.address=auto", "envs.num_sandbox_workers=2",
                              "rollout.trajectories_per_agent_worker=10"])
    # min((1+1) x 32, 2 x 32) = 64 in flight, 32 per node, ceil(32 / 10) = 4 per node
    count = resolve_agent_workers(cfg)
    assert (count.total, count.per_node) == (8, 4)
    sandbox = {p.name: p for p in plan_pools(cfg)}["sandbox"]
    assert dict(sandbox.bundle)["CPU"] == 1 + 4 * 0.5  # the sandbox worker + its node's 4
    assert "4 AgentLoopWorkers" in sandbox.role


def test_sync_holds_one_step_in_flight():
    cfg = load_config(QUICK, ["cluster.address=auto", "train.mode=sync",
                              "envs.sandboxes_per_worker=64", "rollout.trajectories_per_agent_worker=10"])
    # eta is 0 in sync: 1 x 32 = 32 in flight (< 64 sandboxes), ceil(32 / 10) = 4
    assert resolve_agent_workers(cfg).total == 4


def test_auto_is_capped_by_what_the_local_cluster_can_place():
    cfg = load_config(QUICK, ["cluster.local_num_cpus=4", "rollout.trajectories_per_agent_worker=4"])
    # ceil(32 / 4) = 8 wanted; 4 - 3 = 1 CPU left / 0.5 per worker = 2
    count = resolve_agent_workers(cfg)
    assert (count.total, count.auto) == (2, True)
    assert "capped from 8 at 2" in count.reason and "cluster.local_num_cpus" in count.reason
    assert dict({p.name: p for p in plan_pools(cfg)}["sandbox"].bundle)["CPU"] == 1 + 2 * 0.5


def test_the_cap_keeps_one_process_per_node_and_a_joined_cluster_is_not_capped():
    tight = load_config(QUICK, ["cluster.local_num_cpus=3", "rollout.trajectories_per_agent_worker=4"])
    assert resolve_agent_workers(tight).total == 1  # nothing left: still one (placement says why)
    joined = load_config(QUICK, ["cluster.address=auto", "cluster.local_num_cpus=3",
                                 "rollout.trajectories_per_agent_worker=4"])
    assert resolve_agent_workers(joined).total == 8  # its size is known only once connected


def test_an_explicit_count_is_kept():
    cfg = load_config(QUICK, ["rollout.num_agent_workers=3", "cluster.local_num_cpus=3"])
    count = resolve_agent_workers(cfg)
    assert (count.total, count.per_node, count.auto) == (3, 3, False)  # not capped either
    assert "3 AgentLoopWorkers" in {p.name: p for p in plan_pools(cfg)}["sandbox"].role


def test_the_seed_scale_recipe_gets_one_process_per_node():
    cfg = load_config("swe_grpo.yaml")
    assert cfg.rollout.num_agent_workers == 0
    # min((2+1) x 500 x 8, 45 x 40) = 1,800 in flight, 40 per node: one process each
    count = resolve_agent_workers(cfg)
    assert (count.total, count.per_node) == (45, 1)
    assert "45 AgentLoopWorker processes (1 per sandbox node x 45; auto" in count.describe()


@pytest.mark.parametrize("override, words", [
    ("rollout.num_agent_workers=-1", "rollout.num_agent_workers: must be >= 0"),
    ("rollout.trajectories_per_agent_worker=0", "rollout.trajectories_per_agent_worker: must be >= 1"),
])
def test_negative_counts_are_config_errors(override, words):
    with pytest.raises(ValueError, match=words):
        load_config(QUICK, [override])
