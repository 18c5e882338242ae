"""Helper process for test_reaper.py (not a test): builds the state a sandbox worker or a
driver holds, prints where it is as one JSON line, then waits to be killed (SIGKILL),
which leaves that state behind exactly as a killed run does.

    python tests/integration/reaper_victim.py local ROOT LEASE_DIR FIRST_UID
    python tests/integration/reaper_victim.py container ROOT LEASE_DIR FIRST_UID
    python tests/integration/reaper_victim.py ray        (SLUICE_STATE_DIR says where records go)

local/container: a real sandbox of that backend (leased uid, folder, workspace tmpfs,
cgroup or container), a snapshot tar, and a process of the sandbox's uid that outlives
this one (a command left running, as a crashed worker leaves it), inside the sandbox's
cgroup. ray: the private Ray cluster of `cluster.address=local`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time


def start_sleeper(uid: int, cgroup_dirs: list[str]) -> int:
    proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                             "sleep", "3600"], start_new_session=True)
    for folder in cgroup_dirs:
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write(str(proc.pid))
    return proc.pid


async def sandbox_state(backend: str, root: str, lease_dir: str, first_uid: int) -> dict:
    from envs.sandbox.base import SandboxSpec

    if backend == "local":
        from envs.sandbox.local import LocalSandbox, LocalSandboxConfig

        sandbox = await LocalSandbox.create(SandboxSpec(), LocalSandboxConfig(
            root_dir=root, snapshot_dir=root, first_host_uid=first_uid, num_host_uids=4,
            lease_dir=lease_dir))
    else:
        from envs.sandbox.container import ContainerSandbox, ContainerSandboxConfig

        sandbox = await ContainerSandbox.create(SandboxSpec(), ContainerSandboxConfig(
            root_dir=root, snapshot_dir=root, first_host_uid=first_uid, num_host_uids=4,
            lease_dir=lease_dir))
    await sandbox.write_file("notes.txt", b"work in progress\n")
    snapshot = await sandbox.snapshot()
    sandbox_dir, *cgroups = sandbox.host_paths()
    out = {"uid": sandbox.host_uid, "sandbox_dir": sandbox_dir, "cgroups": cgroups,
           "snapshot": snapshot.tar_path}
    if backend == "local":
        out["sleeper"] = start_sleeper(sandbox.host_uid, cgroups)
    else:
        out["container"] = f"sluice-sandbox-{sandbox.host_uid}"
    return out


def ray_state() -> dict:
    import ray

    from trainer.run.pools import connect_cluster
    from trainer.run.recipe import load_config

    connect_cluster(load_config(None, ["model.path=tiny", "cluster.local_num_cpus=1"]))

    @ray.remote
    def pid() -> int:
        return os.getpid()

    worker = ray.get(pid.remote())  # a worker process of the cluster, as a run has
    return {"session_dir": ray._private.worker._global_node.get_session_dir_path(),
            "worker": worker}


def main() -> None:
    kind = sys.argv[1]
    if kind == "ray":
        state = ray_state()
    else:
        state = asyncio.run(sandbox_state(kind, sys.argv[2], sys.argv[3], int(sys.argv[4])))
    print(json.dumps(state), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
