"""SandboxPool over real LocalSandboxes: warm and per-task acquires, release that leaves
nothing on the host, the FIFO cap, timeouts, recovery of a sandbox whose workspace
vanished, and the capture of a final workspace (a broken sandbox's included)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from envs.pool import SANDBOX_FAULT_EXIT_CODE, SandboxPool
from envs.sandbox import workspace
from envs.sandbox.base import SandboxLimits, SandboxSpec

SMALL = SandboxLimits(memory_mb=256, max_processes=64)
GENERIC = SandboxSpec(limits=SMALL)


def leftovers(sandboxes: list) -> list[str]:
    """Host paths and live processes the given LocalSandboxes still own."""
    left = [p for sb in sandboxes for p in sb.host_paths() if os.path.lexists(p)]
    uids = {sb.host_uid for sb in sandboxes}
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields and int(fields["Uid"].split()[0]) in uids and fields["State"].split()[0] != "Z":
            left.append(f"process {entry}")
    return left


class RecordingPool:
    """A pool over LocalSandbox.create that remembers every sandbox it made and keeps
    their snapshots in `snapshot_dir`."""

    def __init__(self, snapshot_dir: Path, **kwargs: object) -> None:
        from envs.sandbox.local import LocalSandbox, LocalSandboxConfig

        self.made: list = []
        self.snapshot_dir = snapshot_dir
        config = LocalSandboxConfig(snapshot_dir=str(snapshot_dir))

        async def create(spec: SandboxSpec) -> LocalSandbox:
            sandbox = await LocalSandbox.create(spec, config)
            self.made.append(sandbox)
            return sandbox

        options: dict = {"max_sandboxes": 3, "num_warm": 1, "warm_limits": SMALL,
                         "snapshot_interval_s": 0.0, **kwargs}
        self.pool = SandboxPool(create, **options)


@pytest.fixture
async def recording(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RecordingPool]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    recording = RecordingPool(tmp_path_factory.mktemp("snapshots"))
    await recording.pool.start()
    yield recording
    await recording.pool.close()
    assert leftovers(recording.made) == []
    assert list(recording.snapshot_dir.iterdir()) == []  # every snapshot tar was discarded


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_warm_acquire_exec_release_lifecycle(recording: RecordingPool) -> None:
    pool = recording.pool
    assert pool.stats().num_warm == 1
    lease = await pool.acquire(GENERIC)
    assert lease.warm
    sandbox = recording.made[0]
    result = await pool.exec(lease, "echo hi; echo err >&2", 10)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hi\n", "err\n")
    await pool.release(lease)
    assert leftovers([sandbox]) == []
    await wait_until(lambda: pool.stats().num_warm == 1)  # refilled
    stats = pool.stats()
    assert (stats.num_in_use, stats.num_warm_hits, stats.num_execs) == (0, 1, 1)
    assert stats.create.count == 2 and stats.create.max_s > 0


async def test_a_per_task_sandbox_is_created_from_its_source_dir(recording: RecordingPool,
                                                                 tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 41\n")
    lease = await recording.pool.acquire(SandboxSpec(source_dir=str(tmp_path), limits=SMALL))
    assert not lease.warm
    result = await recording.pool.exec(lease, ["python3", "-c",
                                               "from pkg.mod import VALUE; print(VALUE + 1)"], 10)
    assert result.stdout == "42\n"
    assert await recording.pool.read_file(lease, "pkg/mod.py") == b"VALUE = 41\n"
    assert recording.pool.stats().num_warm == 1  # the warm one was not used
    await recording.pool.release(lease)


async def test_timeouts_are_results_and_counted(recording: RecordingPool) -> None:
    lease = await recording.pool.acquire(GENERIC)
    result = await recording.pool.exec(lease, "sleep 30", 0.5)
    assert result.timed_out and result.exit_code == 137
    assert (await recording.pool.exec(lease, "echo still-here", 10)).stdout == "still-here\n"
    assert recording.pool.stats().num_timeouts == 1
    await recording.pool.release(lease)


async def test_a_vanished_workspace_is_recreated_from_the_last_snapshot(
        recording: RecordingPool) -> None:
    pool = recording.pool
    lease = await pool.acquire(GENERIC)
    assert lease.warm  # so it is the one sandbox made so far
    await pool.exec(lease, "mkdir -p d && echo v1 > d/state.txt", 10)
    await wait_until(lambda: pool.stats().num_snapshots >= 1)
    broken = recording.made[0]
    workspace.unmount(broken.workspace_dir)
    os.rmdir(broken.workspace_dir)  # what a host cleanup racing the sandbox would do
    fault = await pool.exec(lease, "cat d/state.txt", 10)
    assert fault.exit_code == SANDBOX_FAULT_EXIT_CODE
    assert "recreated from its last checkpoint" in fault.stderr
    assert (await pool.exec(lease, "cat d/state.txt", 10)).stdout == "v1\n"
    stats = pool.stats()
    assert (stats.num_crashes, stats.num_recreates) == (1, 1)
    assert leftovers([broken]) == []
    await pool.checkpoint(lease)
    assert len(list(recording.snapshot_dir.iterdir())) == 1  # older tars are discarded
    await pool.release(lease)


async def test_callers_beyond_the_cap_queue_and_all_finish(recording: RecordingPool) -> None:
    pool = recording.pool
    in_use: list[int] = []

    async def trajectory(i: int) -> str:
        lease = await pool.acquire(GENERIC)
        in_use.append(pool.stats().num_in_use + pool.stats().num_warm)
        try:
            return (await pool.exec(lease, f"sleep 0.2; echo {i}", 10)).stdout
        finally:
            await pool.release(lease)

    outputs = await asyncio.gather(*(trajectory(i) for i in range(7)))
    assert outputs == [f"{i}\n" for i in range(7)]
    stats = pool.stats()
    assert max(in_use) <= 3 and stats.queue_wait.max_s > 0.1
    assert stats.num_in_use == 0 and stats.queue_length == 0


async def test_the_final_workspace_is_captured_against_the_source(recording: RecordingPool,
                                                                  tmp_path: Path) -> None:
    (tmp_path / "keep.py").write_text("KEEP = 1\n")
    (tmp_path / "edit.py").write_text("VALUE = 1\n")
    (tmp_path / "gone.py").write_text("GONE = 1\n")
    pool = recording.pool
    lease = await pool.acquire(SandboxSpec(source_dir=str(tmp_path), limits=SMALL))
    await pool.exec(lease, "echo 'VALUE = 2' > edit.py && rm gone.py && mkdir new && "
                           "echo hi > new/n.txt", 10)
    changes = await pool.workspace_changes(lease, 1 << 20)
    assert changes.written == {"edit.py": b"VALUE = 2\n", "new/n.txt": b"hi\n"}
    assert changes.deleted == ("gone.py",) and changes.problem == ""
    too_big = await pool.workspace_changes(lease, 5)
    assert too_big.written == {} and "exceed 5 bytes" in too_big.problem
    await pool.release(lease)


async def test_a_broken_sandbox_is_captured_from_its_last_snapshot(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    recording = RecordingPool(tmp_path_factory.mktemp("snapshots"), num_warm=0, max_recreates=0)
    pool = recording.pool
    try:
        lease = await pool.acquire(SandboxSpec(source_dir=str(tmp_path), limits=SMALL))
        await pool.exec(lease, "echo v1 > state.txt", 10)
        await wait_until(lambda: pool.stats().num_snapshots >= 1)
        broken = recording.made[0]
        workspace.unmount(broken.workspace_dir)
        os.rmdir(broken.workspace_dir)
        fault = await pool.exec(lease, "echo v2 > state.txt", 10)
        assert fault.exit_code == SANDBOX_FAULT_EXIT_CODE  # gone for good: no recreates left
        changes = await pool.workspace_changes(lease, 1 << 20)
        assert changes.written == {"state.txt": b"v1\n"}  # what the agent would get back
        await pool.release(lease)
    finally:
        await pool.close()
    assert leftovers(recording.made) == []
    assert list(recording.snapshot_dir.iterdir()) == []
