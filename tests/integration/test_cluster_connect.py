"""cluster.address (issue 13, finding 6): 'local' starts a private Ray cluster even when
another one runs on the machine and RAY_ADDRESS points at it; joining takes an explicit
address, and forwards the driver's NCCL/gloo settings to the workers; an address nothing
answers at is a one-line config error within seconds.

The outside cluster is a real `ray start --head` with its own temp folder (so no other
test on this machine can find it) and is stopped by killing its own processes, never
with `ray stop`, which would stop every cluster on the machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from envs.reaper import ray_session_members

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

PROBE = """
import json, sys
import ray
from trainer.run.pools import connect_cluster
from trainer.run.recipe import load_config
cfg = load_config(None, ["model.path=tiny", "cluster.local_num_cpus=2", *sys.argv[1:]])
connect_cluster(cfg)
print(json.dumps({"resources": ray.cluster_resources(),
                  "gcs": ray.get_runtime_context().gcs_address,
                  "session": ray._private.worker._global_node.get_session_dir_path()}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outside_cluster():
    """(address, session folder) of a `ray start --head` cluster offering 'outside'."""
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths are capped
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=1",
                    '--resources={"outside": 1}', f"--temp-dir={temp}",
                    "--include-dashboard=false", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=180, cwd=temp)
    session = os.path.realpath(os.path.join(temp, "session_latest"))
    from ray._private.services import get_node_ip_address

    try:
        yield f"{get_node_ip_address()}:{port}", session
    finally:
        for pid in ray_session_members(session):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def probe(tmp_path: Path, *overrides: str, ray_address: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), SLUICE_STATE_DIR=str(tmp_path / "state"))
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    proc = subprocess.run([sys.executable, "-c", PROBE, *overrides], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_local_starts_a_private_cluster_beside_a_running_one(tmp_path, outside_cluster):
    address, session = outside_cluster
    outside_pids = set(ray_session_members(session))
    assert outside_pids, "the outside cluster has no processes"
    # RAY_ADDRESS set, as `ray start` tells users to export it: still a private cluster.
    mine = probe(tmp_path, "cluster.address=local", ray_address=address)
    assert mine["gcs"] != address and mine["session"] != session
    assert "outside" not in mine["resources"]
    assert mine["resources"]["sandbox"] == 1.0 and mine["resources"]["CPU"] == 2.0
    # The run's own cluster is gone with it; the outside one is untouched.
    assert list(ray_session_members(mine["session"])) == [] or _gone_soon(mine["session"])
    assert outside_pids <= set(ray_session_members(session))
    # Joining takes the explicit address.
    joined = probe(tmp_path, f"cluster.address={address}")
    assert joined["gcs"] == address and joined["resources"]["outside"] == 1.0
    assert outside_pids <= set(ray_session_members(session))


def _gone_soon(session: str, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not list(ray_session_members(session)):
            return True
        time.sleep(0.5)
    return False


ENV_PROBE = """
import json, os, sys
import ray
from trainer.run.pools import join_cluster
join_cluster(sys.argv[1])
seen = ray.get(ray.remote(num_cpus=1, resources={"outside": 1})(
    lambda: {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME",
                                          "SLUICE_NOT_FORWARDED")}).remote())
print(json.dumps(seen))
"""


def test_a_joining_driver_forwards_its_collective_settings_to_the_workers(tmp_path, outside_cluster):
    """The outside cluster's node was started without them: only the driver has them."""
    address, _ = outside_cluster
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), NCCL_SOCKET_IFNAME="lo", NCCL_DEBUG="WARN",
               GLOO_SOCKET_IFNAME="lo", SLUICE_NOT_FORWARDED="1")
    proc = subprocess.run([sys.executable, "-c", ENV_PROBE, address], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN", "GLOO_SOCKET_IFNAME": "lo",
        "SLUICE_NOT_FORWARDED": None}


def test_an_address_nothing_answers_at_is_a_clear_error(monkeypatch):
    import ray

    from trainer.run.pools import ClusterConnectionError, connect_cluster
    from trainer.run.recipe import load_config

    port = free_port()  # bound and released: nothing listens there
    cfg = load_config(None, ["model.path=tiny", f"cluster.address=127.0.0.1:{port}"])
    start = time.monotonic()
    with pytest.raises(ClusterConnectionError) as err:
        connect_cluster(cfg)
    assert time.monotonic() - start < 60  # ray.init alone would retry for minutes
    assert not ray.is_initialized()
    assert str(err.value) == (
        f"cluster.address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} (Connection "
        f"refused). Start the head there (`ray start --head --port={port}`), fix the address, "
        "or set cluster.address=local for a private cluster on this machine")
    cfg = load_config(None, ["model.path=tiny", "cluster.address=head-node"])
    with pytest.raises(ClusterConnectionError, match="is not 'local', 'auto', 'host:port'"):
        connect_cluster(cfg)
