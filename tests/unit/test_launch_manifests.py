"""The launch files (launch/k8s, launch/slurm, launch/ray_start.sh) against the recipe they are
written for: parsed, every pool of recipes/swe_grpo.yaml packed onto the nodes they start
(with the doctor's own packing, launch.doctor.check_pool_resources), the sandbox resource
offered where the recipe needs it, the shared paths mounted, a memory volume at /dev/shm on
every GPU group, the NCCL/gloo settings' ConfigMap on the head and every GPU group, the
RayJob's cluster equal to the RayCluster. Each validator is also shown to fail on a broken copy."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from launch.doctor import Node, check_pool_resources
from trainer.run.pools import plan_pools
from trainer.run.recipe import load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"


@pytest.fixture(scope="module")
def swe():
    return load_config("swe_grpo.yaml")


def _load(name: str) -> dict:
    return yaml.safe_load((LAUNCH / "k8s" / name).read_text())


def _start_resources(params: dict, sandbox_resource: str) -> dict[str, float]:
    resources = {"CPU": float(params["num-cpus"]), "GPU": float(params.get("num-gpus", 0))}
    if "resources" in params:  # KubeRay passes it on as a quoted JSON string
        custom = json.loads(json.loads(params["resources"]))
        resources.update({k: float(v) for k, v in custom.items()})
    return resources


def _takes_collective_env(container: dict) -> bool:
    return any(e.get("configMapRef", {}) == {"name": "sluice-collectives", "optional": True}
               for e in container.get("envFrom", []))


def _mounts_memory_at_dev_shm(pod: dict, container: dict) -> bool:
    memory = {v["name"] for v in pod.get("volumes", [])
              if v.get("emptyDir", {}).get("medium") == "Memory"}
    return any(m["mountPath"] == "/dev/shm" and m["name"] in memory
               for m in container.get("volumeMounts", []))


def cluster_spec_problems(spec: dict, cfg) -> list[str]:
    """What keeps a RayCluster spec from running `cfg` (empty: nothing)."""
    problems = []
    pools = plan_pools(cfg)
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    if set(groups) != {p.name for p in pools}:
        problems.append(f"worker groups {sorted(groups)} != pools {sorted(p.name for p in pools)}")
    head = spec["headGroupSpec"]["rayStartParams"]
    if head.get("num-gpus") != "0" or head.get("num-cpus") != "0":
        problems.append("the head must offer no CPUs or GPUs (no pool may land on it)")
    nodes = []
    for name, g in groups.items():
        resources = _start_resources(g["rayStartParams"], cfg.cluster.sandbox_resource)
        container = g["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        if float(limits.get("nvidia.com/gpu", 0)) != resources["GPU"]:
            problems.append(f"group {name}: nvidia.com/gpu limit != rayStartParams num-gpus")
        if float(limits["cpu"]) < resources["CPU"]:
            problems.append(f"group {name}: cpu limit below rayStartParams num-cpus")
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        if resources["GPU"] and not any(cfg.model.path.startswith(m + "/") for m in mounts):
            problems.append(f"group {name}: model.path {cfg.model.path} is not on a mounted volume")
        if resources["GPU"] and not _takes_collective_env(container):
            problems.append(f"group {name}: no NCCL/gloo settings (envFrom the optional "
                            "ConfigMap sluice-collectives)")
        if resources["GPU"] and not _mounts_memory_at_dev_shm(g["template"]["spec"], container):
            problems.append(f"group {name}: no memory volume at /dev/shm (a pod's own is 64 MiB; "
                            "vLLM's TP workers, NCCL and Ray need GBs there)")
        nodes += [Node(f"{name}-{i}", name, resources) for i in range(int(g["replicas"]))]
    for check in check_pool_resources(pools, nodes):
        if not check.ok:
            problems.append(f"{check.what}: {check.detail}")
    sandbox = groups.get("sandbox", {}).get("rayStartParams", {})
    if cfg.cluster.sandbox_resource not in _start_resources(sandbox, "") if sandbox else True:
        problems.append(f"the sandbox group does not offer '{cfg.cluster.sandbox_resource}'")
    if not _takes_collective_env(spec["headGroupSpec"]["template"]["spec"]["containers"][0]):
        problems.append("the head (the driver, which forwards them to every worker) gets no "
                        "NCCL/gloo settings (envFrom the optional ConfigMap sluice-collectives)")
    head_mounts = [m["mountPath"] for m in
                   spec["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]]
    if not any(cfg.envs.tasks.startswith(m + "/") for m in head_mounts):
        problems.append(f"the driver (head) cannot read envs.tasks {cfg.envs.tasks}")
    return problems


def test_raycluster_runs_the_swe_recipe(swe):
    cluster = _load("raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert cluster_spec_problems(cluster["spec"], swe) == []


def test_raycluster_validator_catches_a_short_or_mislabelled_cluster(swe):
    spec = _load("raycluster.yaml")["spec"]
    short = copy.deepcopy(spec)
    next(g for g in short["workerGroupSpecs"] if g["groupName"] == "sandbox")["replicas"] = 44
    assert any("pool sandbox" in p and "1 of 45" in p for p in cluster_spec_problems(short, swe))
    unlabelled = copy.deepcopy(spec)
    del next(g for g in unlabelled["workerGroupSpecs"]
             if g["groupName"] == "sandbox")["rayStartParams"]["resources"]
    assert any("does not offer 'sandbox'" in p for p in cluster_spec_problems(unlabelled, swe))
    no_shm = copy.deepcopy(spec)
    judge = next(g for g in no_shm["workerGroupSpecs"] if g["groupName"] == "judge")
    judge["template"]["spec"]["volumes"] = [v for v in judge["template"]["spec"]["volumes"]
                                            if "emptyDir" not in v]
    assert [p for p in cluster_spec_problems(no_shm, swe) if "/dev/shm" in p] == [
        "group judge: no memory volume at /dev/shm (a pod's own is 64 MiB; vLLM's TP workers, "
        "NCCL and Ray need GBs there)"]
    no_env = copy.deepcopy(spec)
    del no_env["headGroupSpec"]["template"]["spec"]["containers"][0]["envFrom"]
    assert [p for p in cluster_spec_problems(no_env, swe) if "NCCL" in p] == [
        "the head (the driver, which forwards them to every worker) gets no NCCL/gloo settings "
        "(envFrom the optional ConfigMap sluice-collectives)"]
    fewer_gpus = copy.deepcopy(spec)
    next(g for g in fewer_gpus["workerGroupSpecs"] if g["groupName"] == "rollout")["replicas"] = 3
    assert any(p.startswith("pool ") for p in cluster_spec_problems(fewer_gpus, swe))


def test_rayjob_runs_doctor_then_the_recipe_on_the_same_cluster(swe):
    job = _load("rayjob.yaml")
    assert job["kind"] == "RayJob"
    assert job["spec"]["rayClusterSpec"] == _load("raycluster.yaml")["spec"]
    entry = job["spec"]["entrypoint"]
    assert re.search(r"python -m launch\.doctor recipe=swe_grpo\.yaml && python -m trainer\.main "
                     r"recipe=swe_grpo\.yaml", entry)


def _sbatch_components(text: str) -> list[dict[str, str]]:
    components: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if line.strip() == "#SBATCH hetjob":
            components.append({})
        elif line.startswith("#SBATCH "):
            for opt in line.removeprefix("#SBATCH ").split():
                key, _, value = opt.lstrip("-").partition("=")
                components[-1][key] = value
    return components


def sbatch_problems(text: str, cfg) -> list[str]:
    problems = []
    comps = _sbatch_components(text)
    if len(comps) != 3:
        return [f"expected 3 het components (head, GPU, sandbox), found {len(comps)}"]
    _, gpu, sandbox = comps
    gpu_nodes, sandbox_nodes = int(gpu["nodes"]), int(sandbox["nodes"])
    for var, count in (("NUM_GPU_NODES", gpu_nodes), ("NUM_SANDBOX_NODES", sandbox_nodes)):
        if f"{var}={count}" not in text:
            problems.append(f"{var} does not match the #SBATCH node count {count}")
    nodes = [Node(f"gpu{i}", "gpu", {"CPU": float(gpu["cpus-per-task"]),
                                      "GPU": float(gpu["gpus-per-node"])})
             for i in range(gpu_nodes)]
    nodes += [Node(f"cpu{i}", "cpu", {"CPU": float(sandbox["cpus-per-task"]),
                                       cfg.cluster.sandbox_resource: 1.0})
              for i in range(sandbox_nodes)]
    problems += [f"{c.what}: {c.detail}" for c in check_pool_resources(plan_pools(cfg), nodes)
                 if not c.ok]
    for role in ("head", "gpu", "sandbox", "wait"):
        if f"launch/ray_start.sh {role}" not in text:
            problems.append(f"no `launch/ray_start.sh {role}` step")
    return problems


def test_sbatch_het_components_hold_the_swe_pools(swe):
    text = (LAUNCH / "slurm" / "sluice.sbatch").read_text()
    assert sbatch_problems(text, swe) == []
    fewer = text.replace("--nodes=45 ", "--nodes=40 ").replace("NUM_SANDBOX_NODES=45",
                                                              "NUM_SANDBOX_NODES=40")
    assert any(p.startswith("pool sandbox") for p in sbatch_problems(fewer, swe))
    assert sbatch_problems(text.replace("NUM_GPU_NODES=7", "NUM_GPU_NODES=6"), swe)


def _ray_start(*args: str, **env: str) -> str:
    out = subprocess.run(["bash", str(LAUNCH / "ray_start.sh"), *args], capture_output=True,
                         text=True, env={**os.environ, "SLUICE_RAY_DRY_RUN": "1", **env},
                         check=True)
    return out.stdout


def test_ray_start_roles_offer_what_the_pools_need():
    head = _ray_start("head")
    assert "--head" in head and "--num-gpus=0" in head and "--num-cpus=0" in head
    gpu = _ray_start("gpu", "--address", "10.0.0.1:6379", SLUICE_NUM_GPUS="8")
    assert "--num-gpus=8" in gpu and "--address=10.0.0.1:6379" in gpu
    sandbox = _ray_start("sandbox", "--address", "10.0.0.1:6379", "--block")
    assert re.search(r'--resources=\\\{\\"sandbox\\":\\ 1\\\}', sandbox) and "--num-gpus=0" in sandbox
    assert sandbox.rstrip().endswith("--block")
    assert "--node-manager-port=6380" in gpu  # fixed ports, for firewalls
    missing = subprocess.run(["bash", str(LAUNCH / "ray_start.sh"), "gpu"], capture_output=True,
                             text=True, env={**os.environ, "SLUICE_RAY_DRY_RUN": "1"})
    assert missing.returncode == 2 and "--address" in missing.stderr
