"""A multi-node layout on one machine (ray.cluster_utils.Cluster): a head with no GPUs
and no sandboxes (the driver), a node with logical GPUs for the engine and the train
rank, and two CPU nodes offering the `sandbox` resource. A short real run (vLLM engine,
DeepSpeed rank, real sandboxes) whose trajectories each write a 1 MiB file shows that
the agent-loop workers and the grading run on the sandbox nodes, that every workspace
was graded where it was made, and counts the bytes the driver received: scored groups,
never workspaces. Weights go the cluster way: train rank 0 broadcasts them to the engine
across nodes (sync.transport=gloo, the NCCL path over gloo), never through the driver."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from cluster_plugins import BIG_FILE_BYTES, LOG_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local sandbox backend needs root and bubblewrap")
    from ray.cluster_utils import Cluster

    # The workers import the test plug-ins; every node's processes inherit this.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "grading.jsonl"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    gpu_node = cluster.add_node(num_cpus=3, num_gpus=2, resources={"gpu_node": 1})
    # Room for a sandbox bundle even if an engine or train bundle lands there (cpu device:
    # no GPU pins those to the GPU node).
    sandbox_nodes = [cluster.add_node(num_cpus=3, resources={"sandbox": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, gpu_node, sandbox_nodes
    import ray

    ray.shutdown()
    cluster.shutdown()


def test_workers_and_grading_run_on_sandbox_nodes_and_no_workspace_reaches_the_driver(
        cluster, tmp_path):
    from trainer.run.recipe import load_config
    from trainer.run.system import run

    ray_cluster, gpu_node, sandbox_nodes = cluster
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"w{i}", "prompt": f"Write file {i}.",
                                         "tools": ["write_file", "submit"], "answer": "1"}) + "\n"
                             for i in range(4)))
    cfg = load_config("quickstart.yaml", [
        f"cluster.address={ray_cluster.address}", "model.warm_start=null", "eval.tasks=null",
        f"envs.tasks={tasks}", "envs.num_sandbox_workers=2", "envs.num_warm_sandboxes=0",
        "envs.cpus_per_sandbox_worker=1", "rollout.num_agent_workers=2",
        "rollout.cpus_per_agent_worker=0.5", "envs.max_workspace_changes_mb=4",
        "agent.loop=cluster_plugins:BigWorkspaceLoop", "reward.fn=cluster_plugins:WhereGraded",
        "agent.max_new_tokens_per_turn=8", "train.num_steps=2", "train.group_size=2",
        "train.groups_per_step=2", f"logging.output_dir={tmp_path}", "logging.run_name=multi",
        "logging.wandb_mode=disabled", "logging.console=false", "cluster.pool_ready_timeout_s=60",
        "sync.transport=gloo"])
    summary, run_dir = asyncio.run(run(cfg, "multi"))
    assert summary.steps == 2

    sandbox_ids = {n.node_id for n in sandbox_nodes}
    graded = [json.loads(line) for line in Path(os.environ[LOG_ENV]).read_text().splitlines()]
    # A trajectory still running when the run ends can fail as its sandbox pool closes
    # (its write_file errors) and is scored as an error: only finished ones wrote the file.
    finished = [g for g in graded if g["termination"] == "finished"]
    assert len(finished) >= 2 * 2 * 2  # every trajectory of every trained group was graded
    assert {g["node"] for g in graded} <= sandbox_ids  # grading ran on sandbox nodes only
    assert len({g["node"] for g in graded}) == 2  # ... on both of them
    assert all(g["workspace_bytes"] == BIG_FILE_BYTES for g in finished)  # whole, where made

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    received = max(r.get("driver/bytes_received", 0) for r in rows)
    groups_received = summary.admitted - summary.running
    workspace_bytes = len(finished) * BIG_FILE_BYTES
    print(f"driver received {received} bytes for {groups_received} groups "
          f"({received / max(groups_received, 1):.0f} per group); the workspaces held "
          f"{workspace_bytes} bytes")
    assert 0 < received < 64 * 1024 * groups_received  # scored trajectories: kilobytes a group
    assert received < workspace_bytes / 50  # the workspaces stayed on the sandbox nodes
