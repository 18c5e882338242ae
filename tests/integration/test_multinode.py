"""A multi-node layout on one machine (ray.cluster_utils.Cluster): a head with no GPUs
and no sandboxes (the driver), a node with logical GPUs for the engine and the train
rank, and two CPU nodes offering the `sandbox` resource. One short real run (vLLM engine,
DeepSpeed rank, real sandboxes, hidden-test grading in the agent-loop workers) of a
scripted policy (cluster_plugins.BigWorkspaceHackLoop) on the code tasks, whose
trajectories each write a 1 MiB file and, by their index in the group, solve the task
honestly or try one reward hack (patch the test runner from the module under test, plant
a conftest.py and a pytest.toml, or shadow a standard-library module). It shows:

- the agent-loop workers and the grading run on the sandbox nodes, every workspace was
  graded where it was made, and the driver received scored groups, never workspaces;
- weights go the cluster way: train rank 0 broadcasts them to the engine across nodes
  (sync.transport=gloo, the NCCL path over gloo), never through the driver;
- reward-hacking findings reach the run's metrics: `reward/hack_<finding>` counts in
  metrics.jsonl, and the transcripts name what each trajectory tried."""

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


GROUPS_PER_STEP = 2
GROUP_SIZE = 4  # one trajectory of each behaviour (hack_plugins.BEHAVIOURS) per group
NUM_STEPS = 2


def test_workers_and_grading_run_on_sandbox_nodes_and_hacks_are_counted(cluster, tmp_path):
    from trainer.run.recipe import load_config
    from trainer.run.system import run

    ray_cluster, gpu_node, sandbox_nodes = cluster
    cfg = load_config("quickstart.yaml", [
        f"cluster.address={ray_cluster.address}", "model.warm_start=null", "eval.tasks=null",
        "envs.tasks=code_functions", "envs.num_sandbox_workers=2", "envs.num_warm_sandboxes=0",
        "envs.cpus_per_sandbox_worker=1", "rollout.num_agent_workers=2",
        "rollout.cpus_per_agent_worker=0.5", "envs.max_workspace_changes_mb=4",
        "agent.loop=cluster_plugins:BigWorkspaceHackLoop", "reward.fn=cluster_plugins:WhereGraded",
        "reward.fn_scope=all",  # the code tasks name hidden_tests themselves
        "model.max_context_tokens=4096", "agent.max_new_tokens_per_turn=8",
        "agent.max_response_tokens=256", f"train.num_steps={NUM_STEPS}",
        f"train.group_size={GROUP_SIZE}", f"train.groups_per_step={GROUPS_PER_STEP}",
        "buffer.max_staleness=0", "reward.max_concurrency=2", f"logging.output_dir={tmp_path}",
        "logging.run_name=multi", "logging.wandb_mode=disabled", "logging.console=false",
        "logging.num_transcripts_per_step=64", "cluster.pool_ready_timeout_s=60",
        "sync.transport=gloo"])
    summary, run_dir = asyncio.run(run(cfg, "multi"))
    assert summary.steps == NUM_STEPS

    sandbox_ids = {n.node_id for n in sandbox_nodes}
    graded = [json.loads(line) for line in Path(os.environ[LOG_ENV]).read_text().splitlines()]
    # A trajectory still running when the run ends can fail as its sandbox pool closes
    # (its write_file errors) and is scored as an error: only finished ones wrote the file.
    finished = [g for g in graded if g["termination"] == "finished"]
    assert len(finished) >= NUM_STEPS * GROUPS_PER_STEP * GROUP_SIZE  # every trained one graded
    assert {g["node"] for g in graded} <= sandbox_ids  # grading ran on sandbox nodes only
    assert len({g["node"] for g in graded}) == 2  # ... on both of them
    # Whole, where made: the big file and the few kilobytes of the solution or the hack.
    assert all(BIG_FILE_BYTES <= g["workspace_bytes"] < BIG_FILE_BYTES + 64 * 1024 for g in finished)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    received = max(r.get("driver/bytes_received", 0) for r in rows)
    groups_received = summary.admitted - summary.running
    workspace_bytes = len(finished) * BIG_FILE_BYTES
    print(f"driver received {received} bytes for {groups_received} groups "
          f"({received / max(groups_received, 1):.0f} per group); the workspaces held "
          f"{workspace_bytes} bytes")
    assert 0 < received < 64 * 1024 * groups_received  # scored trajectories: kilobytes a group
    assert received < workspace_bytes / 50  # the workspaces stayed on the sandbox nodes

    # One trajectory of each kind per group: findings are counts.
    for row in rows:
        for finding in ("runner_config", "shadow_module", "sentinel_passed", "runner_bypassed"):
            assert row[f"reward/hack_{finding}"] == GROUPS_PER_STEP, row
        assert row["reward/hack_runner_internals"] >= GROUPS_PER_STEP, row
        # Scores are means: only the patched runner got to run (and was caught); the
        # honest quarter passes.
        assert row["reward/tamper_detected"] == pytest.approx(0.25), row
        assert row["reward/mean"] == pytest.approx(0.25), row
    transcripts = [json.loads(line) for line in
                   (run_dir / "transcripts.jsonl").read_text().splitlines()]
    by_behaviour = {t["index"] % GROUP_SIZE: t for t in transcripts}
    assert not any(k.startswith("hack_") and v for k, v in by_behaviour[0]["components"].items())
    assert by_behaviour[1]["components"]["hack_sentinel_passed"] == 1.0
    assert by_behaviour[2]["components"]["hack_runner_config"] == 1.0
    assert by_behaviour[3]["components"]["hack_shadow_module"] == 1.0
