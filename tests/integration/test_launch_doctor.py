"""`launch.doctor` on a multi-node Ray cluster on one machine (ray.cluster_utils.Cluster): a
head without GPUs, two nodes with logical GPUs, one node offering the `sandbox` resource. A
scaled-down recipe passes every check; breaking it (more engines than GPUs, a second sandbox
worker, a model folder nowhere, a task image absent) is reported as missing, by name. Also
the doctor's sandbox-node checks on fabricated probe reports (images, backend)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launch.doctor import (NodeProbe, check_sandbox_nodes, format_checks, live_nodes, main,
                           probe_collective, run_doctor)
from trainer.run.recipe import load_config


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=2)
    c.add_node(num_cpus=2, num_gpus=0, resources={"sandbox": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _recipe(tmp_path, *extra: str):
    return load_config("quickstart.yaml", [
        "cluster.device=cuda", "rollout.num_engines=1", "rollout.tp_size=2", "train.num_ranks=2",
        "rollout.cpus_per_engine=1", "train.cpus_per_rank=1", "envs.num_sandbox_workers=1",
        "envs.cpus_per_sandbox_worker=1", "rollout.num_agent_workers=1",
        "rollout.cpus_per_agent_worker=0.5", "sync.transport=nccl",
        f"logging.output_dir={tmp_path / 'runs'}", *extra])


def test_a_fitting_recipe_passes_every_check(cluster, tmp_path, capsys):
    checks = run_doctor(_recipe(tmp_path))
    assert all(c.ok for c in checks), format_checks(checks)
    whats = {c.what for c in checks}
    assert {"pool rollout", "pool train", "pool sandbox", "ports", "sandbox backend local",
            "logging.output_dir shared"} <= whats
    ports = next(c for c in checks if c.what == "ports")
    assert "2 pairs" in ports.detail  # the two GPU nodes, both ways
    # Logical GPUs: no driver, no NCCL here, and the doctor says what it would check.
    stack = next(c for c in checks if c.what == "gpu stack")
    assert stack.detail.startswith("skipped: no GPU (no NVIDIA driver on any of the 2 GPU nodes")
    # No driver answered on either GPU node: the collective is skipped without a rank started.
    collective = next(c for c in checks if c.what == "collective")
    assert collective.detail.startswith("skipped: no GPU (no NVIDIA driver on "), collective.detail
    assert "would check a nccl broadcast of 4 MiB" in collective.detail
    # Without the stacks, one rank per GPU node asks CUDA itself.
    [asked] = probe_collective(_recipe(tmp_path), live_nodes())
    assert asked.detail.startswith("skipped: no GPU (CUDA sees no device on "), asked.detail
    assert "would check a nccl broadcast of 4 MiB" in asked.detail


def test_the_weight_groups_own_broadcast_runs_between_the_nodes_that_join_it(cluster, tmp_path,
                                                                             monkeypatch):
    """On a CPU cluster (sync.transport=gloo) the check is real: one rank on each node
    without the sandbox resource (head and the two others), rollout.weight_group's join and
    bounded broadcast, the driver's gloo interface setting forwarded to them."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    cpu = _recipe(tmp_path, "cluster.device=cpu", "sync.transport=gloo", "sync.timeout_s=60")
    [check] = probe_collective(cpu, live_nodes())  # the doctor's own check, without the others
    assert check.ok and "every one of 3 nodes received it" in check.detail, check.detail
    assert "GLOO_SOCKET_IFNAME=lo" in check.detail
    # An interface that does not exist: the group cannot form, within the bound, and the
    # check says what to look at.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "sluice-no-such-if0")
    short = _recipe(tmp_path, "cluster.device=cpu", "sync.transport=gloo", "sync.timeout_s=10")
    [broken] = probe_collective(short, live_nodes())
    assert not broken.ok and "GLOO_SOCKET_IFNAME" in broken.detail, broken.detail


def test_what_is_missing_is_named(cluster, tmp_path):
    cfg = _recipe(tmp_path, "train.num_ranks=3", "envs.num_sandbox_workers=2",
                  "rollout.num_agent_workers=2", f"model.path={tmp_path / 'nowhere'}",
                  "model.warm_start=null")
    missing = {c.what: c.detail for c in run_doctor(cfg) if not c.ok}
    assert set(missing) == {"pool train", "pool sandbox", "model.path"}, missing
    assert "1 of 3 bundles {CPU=1, GPU=1}" in missing["pool train"]
    assert "train.num_ranks" in missing["pool train"]
    assert "1 of 2 bundles" in missing["pool sandbox"]
    assert "absent on 2 of 2 nodes" in missing["model.path"]  # the two GPU nodes


def test_cli_exit_status_says_whether_something_is_missing(cluster, tmp_path, capsys):
    base = ["recipe=quickstart.yaml", "cluster.device=cuda", "rollout.tp_size=2",
            "train.num_ranks=2", "rollout.cpus_per_engine=1", "train.cpus_per_rank=1",
            "envs.cpus_per_sandbox_worker=1", "rollout.cpus_per_agent_worker=0.5",
            "sync.transport=nccl", f"logging.output_dir={tmp_path / 'runs'}"]
    assert main(base) == 0
    assert main([*base, "train.num_ranks=5"]) == 1
    out = capsys.readouterr().out
    assert "MISSING  pool train" in out and "nothing missing" in out
    assert main(["recipe=quickstart.yaml", "train.nope=1"]) == 2


def test_sandbox_checks_name_absent_images_and_a_broken_backend():
    reports = {
        "10.0.0.1": NodeProbe(images={"swe/a:1": True, "swe/b:1": True}),
        "10.0.0.2": NodeProbe(images={"swe/a:1": True, "swe/b:1": False}),
        "10.0.0.3": NodeProbe(backend="podman is not installed; docker is not installed",
                              images={"swe/a:1": False, "swe/b:1": False}),
    }
    checks = {c.what: c for c in check_sandbox_nodes(reports, "container", "sandbox")}
    assert not checks["sandbox backend container"].ok
    assert "10.0.0.3: podman is not installed" in checks["sandbox backend container"].detail
    assert "absent on 2 of 3 sandbox nodes (10.0.0.2, 10.0.0.3)" in checks["image swe/b:1"].detail
    assert "absent on 1 of 3" in checks["image swe/a:1"].detail
    fine = {ip: NodeProbe(images={k: True for k in r.images}) for ip, r in reports.items()}
    assert all(c.ok for c in check_sandbox_nodes(fine, "container", "sandbox"))
    assert not check_sandbox_nodes({}, "container", "sandbox")[0].ok
    json.dumps({ip: dataclasses.asdict(r) for ip, r in reports.items()})  # plain data through Ray
