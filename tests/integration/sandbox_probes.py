"""Host-side probes shared by the sandbox tests (read by the tests themselves, not via the
code under test)."""

from __future__ import annotations

import os
from pathlib import Path


def live_processes_of_uid(uid: int) -> list[int]:
    """Running (non-zombie) processes of a host uid, read from /proc by the test itself."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def skip_without_container_engine() -> None:
    """Skip the calling test when the container backend cannot run here, with the reason
    (probed once per session: one real sandbox created, used and released)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("the container backend needs root")
    from envs.sandbox.container import probe_container_backend

    problem = probe_container_backend()
    if problem is not None:
        pytest.skip(f"no working container engine: {problem}")


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (e.g. a container's conmon)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != str(os.getpid()):
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def container_leftovers(sandbox: object) -> list[str]:
    """What a released ContainerSandbox left on the host: its folder, mounts, cgroup dirs,
    processes of its uid or naming its container, and the container itself."""
    import subprocess
    import time

    from envs.sandbox.container import ContainerSandbox

    assert isinstance(sandbox, ContainerSandbox)
    left = [f"path {p}" for p in sandbox.host_paths() if os.path.lexists(p)]
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    left += [f"mount {m}" for m in mounts
             if any(m.startswith(p) for p in sandbox.host_paths()) or sandbox.container_id in m]
    deadline = time.monotonic() + 3.0
    while (pids := live_processes_of_uid(sandbox.host_uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left += [f"process {pid} of uid {sandbox.host_uid}" for pid in pids]
    left += [f"process {pid} naming the container" for pid in processes_mentioning(sandbox.container_id)]
    listed = subprocess.run([sandbox.engine_name, "ps", "-a", "-q", "--no-trunc"],
                            capture_output=True, text=True, check=True).stdout.split()
    left += [f"container {c}" for c in listed if c == sandbox.container_id]
    return left
