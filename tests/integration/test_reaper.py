"""The stale-state reaper (envs.reaper; issue 13, finding 5): what a SIGKILLed sandbox
worker or driver leaves (workspace tmpfs mount, sandbox folder, cgroup, container,
snapshot tar, a process of the sandbox's uid, the private Ray cluster's daemons) is
removed at the next start; live sandboxes, other uids, folders without sluice's exact
names and clusters sluice did not start are untouched.

Each test builds real state in a child process (tests/integration/reaper_victim.py),
kills it with SIGKILL and reaps within a private scope: its own folder, lease folder and
a uid range no other sandbox on this machine uses."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from envs.owner import owner_tag, process_start_time
from envs.reaper import ReapScope, ray_session_members, reap_stale_state, record_ray_session

ROOT = Path(__file__).resolve().parents[2]
VICTIM = Path(__file__).with_name("reaper_victim.py")
FIRST_UID = 1_310_000  # outside the backends' default range: only these tests use it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandbox state needs root")


def kill_after_ready(*args: str, env: dict[str, str] | None = None) -> dict:
    """Run the victim until it reports its state, then SIGKILL it; that state."""
    proc = subprocess.Popen([sys.executable, str(VICTIM), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        pytest.fail(f"victim exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    proc.kill()
    proc.wait(timeout=60)
    return json.loads(line)


def mounts() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def alive(pid: int) -> bool:
    return process_start_time(pid) is not None


def wait_dead(pid: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


def sleeper(uid: int) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                             "sleep", "3600"])


@pytest.fixture()
def scope(tmp_path):
    # Sandbox uids must pass through every folder above theirs, which pytest's tmp_path
    # (0700) does not allow: a folder of its own in /tmp.
    root = tempfile.mkdtemp(prefix="reaper-test-", dir="/tmp")
    os.chmod(root, 0o755)
    yield ReapScope(roots=(root,), lease_dir=str(tmp_path / "leases"), first_uid=FIRST_UID,
                    num_uids=16, state_dir=str(tmp_path / "state"))
    shutil.rmtree(root, ignore_errors=True)


def test_a_killed_local_sandbox_worker_leaves_nothing_after_the_reaper(scope):
    from envs.sandbox.base import SandboxSpec
    from envs.sandbox.local import LocalSandbox, LocalSandboxConfig

    root = scope.roots[0]
    stale = kill_after_ready("local", root, scope.lease_dir, str(FIRST_UID))
    folder, workspace = stale["sandbox_dir"], os.path.join(stale["sandbox_dir"], "workspace")
    # What the killed worker left: the reaper has work to do.
    assert os.path.isdir(folder) and os.path.isfile(stale["snapshot"])
    assert f" {workspace} " in mounts()
    assert alive(stale["sleeper"])
    assert all(os.path.isdir(c) for c in stale["cgroups"])

    # Live state in the same scope (this process holds the lease) and unrelated state.
    live = asyncio.run(LocalSandbox.create(SandboxSpec(), LocalSandboxConfig(
        root_dir=root, first_host_uid=FIRST_UID + 8, num_host_uids=4, lease_dir=scope.lease_dir)))
    live_process, outsider = sleeper(live.host_uid), sleeper(FIRST_UID - 1)
    unrelated = [os.path.join(root, "sluice-sandbox-notes"),  # not <uid>-<suffix>
                 os.path.join(root, f"sluice-sandbox-{FIRST_UID - 1}-x"),  # uid outside range
                 os.path.join(root, "sluice-snapshot-old.tar"),  # no owner tag
                 os.path.join(root, f"sluice-snapshot-{owner_tag()}-x.tar")]  # live owner
    for path in unrelated:
        Path(path).mkdir() if not path.endswith(".tar") else Path(path).write_bytes(b"")
    try:
        report = reap_stale_state(scope)

        assert not os.path.lexists(folder) and not os.path.exists(stale["snapshot"])
        assert f" {workspace} " not in mounts()
        assert wait_dead(stale["sleeper"])
        assert not any(os.path.exists(c) for c in stale["cgroups"])
        assert report.folders == [folder] and report.files == [stale["snapshot"]]
        assert report.mounts == [workspace] and report.cgroups == sorted(stale["cgroups"])
        assert f"pid {stale['sleeper']} (uid {stale['uid']})" in report.processes \
            or any(f"pid {stale['sleeper']} (cgroup" in p for p in report.processes)
        assert report.errors == []

        live_dir = live.host_paths()[0]
        assert os.path.isdir(live_dir) and f" {live_dir}/workspace " in mounts()
        assert alive(live_process.pid) and alive(outsider.pid)
        assert all(os.path.lexists(p) for p in unrelated)
        assert reap_stale_state(scope).num_removed == 0  # a second pass finds nothing
    finally:
        for proc in (live_process, outsider):
            proc.kill()
            proc.wait()
        asyncio.run(live.release())


def test_the_socket_folder_of_a_killed_engine_is_removed_and_a_live_ones_kept(scope):
    """rollout.engine.new_ipc_dir: vLLM's sockets live in a folder tagged with the engine's
    process, which its shutdown removes; after a kill the next start's reaper does."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_tag = f"{owner_tag().partition('.')[0]}.{gone.pid}"
    root = scope.roots[0]
    dead, live = (os.path.join(root, f"sluice-vllm-ipc-{tag}-x") for tag in (dead_tag, owner_tag()))
    for folder in (dead, live):
        os.mkdir(folder)
        Path(folder, "0a9bf83a-c04a-4108-89f6-3df7cf09cc9a").write_bytes(b"")
    report = reap_stale_state(scope)
    assert report.folders == [dead] and not os.path.exists(dead) and os.path.isdir(live)


def test_a_killed_container_sandbox_worker_leaves_no_container(scope):
    from envs.sandbox.container import probe_container_backend

    if (why := probe_container_backend()) is not None:
        pytest.skip(f"no container backend here: {why}")
    from envs.sandbox import engine

    stale = kill_after_ready("container", scope.roots[0], scope.lease_dir, str(FIRST_UID))
    cli = engine.detect_engine()

    def exists(name: str) -> bool:
        return subprocess.run(cli.command("container", "exists", name)).returncode == 0

    assert exists(stale["container"]) and os.path.isdir(stale["sandbox_dir"])
    report = reap_stale_state(scope)
    assert report.containers == [stale["container"]] and not exists(stale["container"])
    assert not os.path.lexists(stale["sandbox_dir"]) and report.errors == []
    assert f" {stale['sandbox_dir']}/workspace " not in mounts()


def test_a_killed_driver_leaves_no_ray_process(scope, tmp_path):
    stale = kill_after_ready("ray", env={"SLUICE_STATE_DIR": scope.state_dir})
    session = stale["session_dir"]
    time.sleep(2)  # the raylet notices its driver is gone; the agents stay
    left = list(ray_session_members(session))
    assert left, "a SIGKILLed driver left no Ray process: nothing to test"

    # A session of a live owner (this process) and one nobody recorded (`ray start`)
    # keep their processes.
    mine, foreign = tmp_path / "session_mine", tmp_path / "session_foreign"
    record_ray_session(str(mine), scope.state_dir)
    keep = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", str(s)])
            for s in (mine, foreign)]
    try:
        report = reap_stale_state(scope)
        assert report.ray_sessions == [session]
        assert all(wait_dead(pid) for pid in left), [p for p in left if alive(p)]
        assert list(ray_session_members(session)) == []
        assert all(alive(p.pid) for p in keep)
        # The dead driver's record is gone; the live owner's stays.
        assert [p.name for p in Path(scope.state_dir).iterdir()] == \
            [f"ray-session-{os.getpid()}.json"]
    finally:
        for proc in keep:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
