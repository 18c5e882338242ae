"""Helpers for whole-run tests (not a test): a system temp folder of the run's own, and
faults injected from outside a run the way they happen in production, never through a
hook in the code under test: SIGKILL of one live engine actor (a node or process dies),
and a wiper that removes live sandbox workspaces (a host cleanup or a crashed sandbox)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from envs.sandbox import workspace


@contextlib.contextmanager
def own_temp_folder() -> Iterator[Path]:
    """TMPDIR for the Ray workers and processes started meanwhile: sandbox folders, their
    workspace mounts and snapshots go there, so a test can look at (or wipe) its own and
    never another test's or run's on this machine. Ray stays in its own folder
    (RAY_TMPDIR). Searchable by all (0711): sandbox uids pass through it."""
    folder = tempfile.mkdtemp(prefix="sluice-t-", dir=tempfile.gettempdir())
    os.chmod(folder, 0o711)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR", tempfile.gettempdir()))
            env.setenv("TMPDIR", folder)
            yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def kill_one_engine() -> int:
    """SIGKILL the process of one live EngineActor of this Ray cluster; its pid."""
    import ray._private.state as ray_state

    live = [a for a in ray_state.actors().values()
            if a["ActorClassName"] == "EngineActor" and a["State"] == "ALIVE"]
    assert len(live) == 2, f"expected two live engines, found {len(live)}"
    pid = int(live[0]["Pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


class WorkspaceWiper(threading.Thread):
    """Removes live sandbox workspaces under `root` (a run's own temp folder: its
    sandboxes only, never another run's on this machine) a few times a second, until it
    has removed `limit` of them or is stopped."""

    def __init__(self, root: Path, limit: int) -> None:
        super().__init__(daemon=True)
        self.root, self.limit = root, limit
        self.stop = threading.Event()
        self.wiped = 0

    def run(self) -> None:
        while self.wiped < self.limit and not self.stop.wait(0.3):
            for ws in glob.glob(os.path.join(self.root, "sluice-sandbox-*", "workspace")):
                try:
                    workspace.unmount(ws)
                    os.rmdir(ws)
                    self.wiped += 1
                except OSError:
                    pass  # released meanwhile, or not mounted yet
                if self.wiped >= self.limit:
                    break
